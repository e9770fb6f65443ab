"""Test servers of the fleet tier, all on loopback: moto (a real S3 server with conditional
writes), a fault proxy that sits between the engine and moto, and a deliberately broken S3
stub whose conditional create is not atomic (for ``fleet doctor``)."""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
    "AWS_ALLOW_HTTP": "true",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def moto_server_path() -> str:
    """$TCG_MOTO_SERVER, else the venv's moto_server, else PATH's; fail loudly when it is
    missing (the test extra installs it)."""
    named = os.environ.get("TCG_MOTO_SERVER")
    if named:
        return named
    path = Path(sys.executable).parent / "moto_server"
    if not path.exists():
        found = shutil.which("moto_server")
        if found is None:
            raise RuntimeError("moto_server is missing: install the test extra (moto[server]==5.2.5)")
        return found
    return str(path)


def wait_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


@dataclass
class Moto:
    port: int
    process: subprocess.Popen[bytes]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"b-{uuid.uuid4().hex[:12]}"
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("PUT", f"/{name}")
        r = conn.getresponse()
        r.read()
        assert r.status == 200, r.status
        return name

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        return {**CREDENTIALS, "AWS_ENDPOINT": endpoint or self.endpoint}


@contextmanager
def moto_server() -> Iterator[Moto]:
    port = free_port()
    proc = subprocess.Popen(
        [moto_server_path(), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_port(port)
        yield Moto(port, proc)
    finally:
        proc.kill()
        proc.wait(timeout=30)


# ---------------------------------------------------------------- fault proxy


@dataclass
class Fault:
    """What the proxy does to a request whose path contains ``match`` (and method is ``method``)."""

    kind: str = "pass"  # pass | delay | status | truncate | corrupt | reset
    match: str = ""
    method: str = "GET"
    status: int = 500
    delay: float = 0.0
    hits: int = field(default=0)


class FaultProxy:
    """A loopback HTTP/1.1 proxy in front of an upstream server, one request a connection
    (``Connection: close``), that injects :class:`Fault` into matching requests."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.fault = Fault()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port: int = self.sock.getsockname()[1]
        self.stopped = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.stopped = True
        self.sock.close()

    def _serve(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    @staticmethod
    def _read_request(conn: socket.socket) -> tuple[bytes, dict[str, str], bytes] | None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
            if len(data) > 1 << 20:
                return None
        head, rest = data.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        length = int(headers.get("content-length", "0"))
        while len(rest) < length:
            chunk = conn.recv(min(1 << 20, length - len(rest)))
            if not chunk:
                return None
            rest += chunk
        return lines[0], headers, rest

    def _handle(self, conn: socket.socket) -> None:
        try:
            req = self._read_request(conn)
            if req is None:
                return
            line, headers, body = req
            method, path, _ = line.decode("latin-1").split(" ", 2)
            f = self.fault
            hit = f.kind != "pass" and f.match in path and method == f.method
            if hit:
                f.hits += 1
            if hit and f.kind == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                return
            if hit and f.kind == "status":
                msg = b"<Error><Code>Injected</Code><Message>injected</Message></Error>"
                conn.sendall(
                    f"HTTP/1.1 {f.status} Injected\r\nContent-Length: {len(msg)}\r\n"
                    "Content-Type: application/xml\r\nConnection: close\r\n\r\n".encode()
                    + msg
                )
                return
            if hit and f.kind == "delay":
                time.sleep(f.delay)
            up = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=120)
            fwd = {k: v for k, v in headers.items() if k not in ("connection",)}
            up.request(method, path, body=body, headers=fwd)
            r = up.getresponse()
            payload = r.read()
            out_headers = [(k, v) for k, v in r.getheaders() if k.lower() not in ("connection", "transfer-encoding")]
            if hit and f.kind == "corrupt" and payload:
                mid = len(payload) // 2
                payload = payload[:mid] + bytes([payload[mid] ^ 0xFF]) + payload[mid + 1 :]
            declared = len(payload) if method != "HEAD" else int(r.getheader("Content-Length", "0"))
            if hit and f.kind == "truncate":
                payload = payload[: len(payload) // 2]
            out_headers = [(k, v) for k, v in out_headers if k.lower() != "content-length"]
            out_headers.append(("Content-Length", str(declared)))
            out_headers.append(("Connection", "close"))
            head = f"HTTP/1.1 {r.status} {r.reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in out_headers)
            conn.sendall(head.encode("latin-1") + b"\r\n" + payload)
        except OSError:
            pass
        finally:
            try:
                conn.close()
            except OSError:
                pass


# ------------------------------------------------------- a deliberately broken store


class _BrokenS3(BaseHTTPRequestHandler):
    """Path-style S3 with a non-atomic conditional create: check, pause, then write."""

    objects: ClassVar[dict[str, tuple[bytes, str, float]]] = {}
    lock: ClassVar[threading.Lock] = threading.Lock()
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _meta(self, key: str) -> dict[str, str]:
        _body, etag, mtime = self.objects[key]
        return {"ETag": etag, "Last-Modified": formatdate(mtime, usegmt=True)}

    def do_PUT(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length)
        key = self.path.split("?")[0]
        if self.headers.get("If-None-Match") == "*":
            exists = key in self.objects
            time.sleep(0.05)  # the race window of a non-atomic check-then-write
            if exists:
                return self._reply(412)
        if_match = self.headers.get("If-Match")
        if if_match is not None and (key not in self.objects or self.objects[key][1] != if_match):
            return self._reply(412)
        etag = f'"{uuid.uuid4().hex}"'
        with self.lock:
            self.objects[key] = (body, etag, time.time())
        self._reply(200, headers={"ETag": etag})

    def do_GET(self) -> None:
        key = self.path.split("?")[0]
        if key not in self.objects:
            return self._reply(404, b"<Error><Code>NoSuchKey</Code></Error>")
        self._reply(200, self.objects[key][0], self._meta(key))

    def do_HEAD(self) -> None:
        key = self.path.split("?")[0]
        if key not in self.objects:
            return self._reply(404)
        body = self.objects[key][0]
        self.send_response(200)
        for k, v in self._meta(key).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()

    def do_DELETE(self) -> None:
        self.objects.pop(self.path.split("?")[0], None)
        self._reply(204)


@contextmanager
def broken_s3() -> Iterator[str]:
    """Start the broken stub on a free loopback port; yields its endpoint."""
    handler = type("BrokenS3", (_BrokenS3,), {"objects": {}, "lock": threading.Lock()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def cli(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the installed CLI in a subprocess with ``env`` added."""
    return subprocess.run(
        [sys.executable, "-m", "torch_compiled_graphs.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=timeout,
    )


def point_at(moto: Moto, monkeypatch: Any, tmp_path: Path, timeout_s: str) -> str:
    """A fresh bucket on ``moto`` as ``s3://bucket/fleet``: the AWS_* variables point at
    it, the doctor's verdict cache is private to the test, the remote timeout is
    ``timeout_s`` and no remote comes from the environment."""
    for k, v in moto.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCH_COMPILED_GRAPHS_REMOTE_TIMEOUT_S", timeout_s)
    monkeypatch.delenv("TORCH_COMPILED_GRAPHS_REMOTE", raising=False)
    return f"s3://{moto.create_bucket()}/fleet"
