"""A crafted S3 endpoint on 127.0.0.1 for the hostile-listing tests: it serves the objects it is given,
keys verbatim -- `ckpt/../../escaped.txt` included, which a real server (SeaweedFS) refuses to store but
a malicious or broken one can list. It speaks just enough of the S3 REST API for s3fs: ListObjectsV2
(prefix, delimiter, max-keys), HeadObject, GetObject (with ranges) and HeadBucket; anything else is 501.

    with hostile_s3({"ckpt/config.json": b"{}", "ckpt/../../escaped.txt": b"x"}) as env:  # AWS_* variables
        storage.download_dir("s3://bucket/ckpt", dest)   # must refuse
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

BUCKET = "bucket"


def _handler(objects: dict[str, bytes]):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _split(self) -> tuple[str, str, dict[str, list[str]]]:
            parts = urlsplit(self.path)
            bucket, _, key = unquote(parts.path).lstrip("/").partition("/")
            return bucket, key, parse_qs(parts.query, keep_blank_values=True)

        def _send(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _meta(self, key: str) -> dict[str, str]:
            return {"ETag": f'"{hashlib.md5(objects[key]).hexdigest()}"', "Last-Modified": formatdate(0, usegmt=True),
                    "Content-Type": "application/octet-stream"}

        def do_HEAD(self) -> None:
            bucket, key, _ = self._split()
            if bucket != BUCKET:
                return self._send(404)
            if not key:
                return self._send(200)
            if key in objects:
                self.send_response(200)
                for k, v in self._meta(key).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(objects[key])))
                return self.end_headers()
            return self._send(404)

        def do_GET(self) -> None:
            bucket, key, query = self._split()
            if bucket != BUCKET:
                return self._send(404, b"<Error><Code>NoSuchBucket</Code></Error>")
            if not key:
                return self._list(query)
            if key not in objects:
                return self._send(404, b"<Error><Code>NoSuchKey</Code><Message>no such key</Message></Error>")
            body, code = objects[key], 200
            headers = self._meta(key)
            if rng := self.headers.get("Range"):
                start, _, end = rng.removeprefix("bytes=").partition("-")
                end = int(end) if end else len(body) - 1
                headers["Content-Range"] = f"bytes {start}-{end}/{len(body)}"
                body, code = body[int(start): end + 1], 206
            self._send(code, body, headers)

        def _list(self, query: dict[str, list[str]]) -> None:
            prefix = query.get("prefix", [""])[0]
            delimiter = query.get("delimiter", [""])[0]
            limit = int(query.get("max-keys", ["1000"])[0])
            keys, prefixes = [], set()
            for key in sorted(objects):
                if not key.startswith(prefix):
                    continue
                rest = key[len(prefix):]
                if delimiter and delimiter in rest:
                    prefixes.add(prefix + rest.split(delimiter, 1)[0] + delimiter)
                else:
                    keys.append(key)
            keys = keys[:limit]
            contents = "".join(f"<Contents><Key>{escape(k)}</Key><Size>{len(objects[k])}</Size>"
                               f"<ETag>{escape(self._meta(k)['ETag'])}</ETag>"
                               f"<LastModified>1970-01-01T00:00:00.000Z</LastModified>"
                               f"<StorageClass>STANDARD</StorageClass></Contents>" for k in keys)
            common = "".join(f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>" for p in sorted(prefixes))
            xml = (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>{BUCKET}</Name>'
                   f"<Prefix>{escape(prefix)}</Prefix><KeyCount>{len(keys) + len(prefixes)}</KeyCount>"
                   f"<MaxKeys>{limit}</MaxKeys><IsTruncated>false</IsTruncated>{contents}{common}</ListBucketResult>")
            self._send(200, xml.encode(), {"Content-Type": "application/xml"})

        def do_PUT(self) -> None:
            self._send(501)

        do_POST = do_DELETE = do_PUT

    return Handler


@contextlib.contextmanager
def hostile_s3(objects: dict[str, bytes]) -> Iterator[dict[str, str]]:
    """Serve `objects` (key -> bytes) in bucket `bucket`; yields the AWS_* variables that point s3fs at it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(dict(objects)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.server_address[1]}", "AWS_ACCESS_KEY_ID": "hostile",
               "AWS_SECRET_ACCESS_KEY": "hostile-secret", "AWS_DEFAULT_REGION": "us-east-1"}
    finally:
        server.shutdown()
        server.server_close()
