"""A fault-injecting HTTP proxy on 127.0.0.1 between s3fs and an S3 endpoint (moto).

s3fs is pointed at the proxy (``endpoint_url``); the proxy forwards every request to the real endpoint unless a
:class:`Fault` rule matches it, in which case it can

* ``error``: answer ``status`` (500, 503...) with an S3 XML error body (``InternalError``, ``SlowDown``...) without
  forwarding, as S3 does under load;
* ``reset``: read part of the request body, then reset the TCP connection (RST) — a connection lost mid-upload;
* ``drop_response``: forward the whole request (the server *does* apply it), then reset the connection instead of
  answering — the ambiguous case where a write succeeded but the client cannot know;
* ``delay``: sleep ``seconds`` before forwarding — slow responses.

Rules match by HTTP method and a path/query substring, and fire on the ``nth`` matching requests (1-based), on a
seeded random ``fraction`` of them, or on all, at most ``limit`` times. Every request is recorded in ``log``
(method, path, action) so tests can assert what happened on the wire. Loopback only; one connection per request
upstream; HTTP/1.1 keep-alive to the client.
"""

from __future__ import annotations

import http.client
import random
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

# status -> (S3 error code, the message real S3 sends): s3fs translates errors to OSError(errno, message), so the
# message text is all that survives of the code — the injected one must be the real one, not a helpful marker
ERROR_CODES = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
    502: ("BadGateway", "Bad Gateway"),
    504: ("GatewayTimeout", "Gateway Timeout"),
}


@dataclass
class Fault:
    """One injection rule (see the module docstring)."""

    kind: str  # "error" | "reset" | "drop_response" | "delay"
    method: str | None = None  # e.g. "PUT"; None matches every method
    path: str | None = None  # substring of the request target (path + query)
    nth: set[int] | None = None  # 1-based indices among matching requests
    fraction: float | None = None  # probability per matching request (seeded)
    limit: int | None = None  # fire at most this many times
    status: int = 503
    seconds: float = 0.0  # for "delay"
    body_fraction: float = 0.5  # for "reset": how much of the body to read first
    seen: int = 0
    fired: int = 0

    def matches(self, method: str, target: str) -> bool:
        return (self.method is None or self.method == method) and (self.path is None or self.path in target)


@dataclass
class Request:
    method: str
    target: str
    action: str


@dataclass
class FaultProxy:
    """The proxy server; use :func:`fault_proxy` to run one."""

    upstream: str
    faults: list[Fault] = field(default_factory=list)
    seed: int = 0
    log: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        u = urlsplit(self.upstream)
        self._up = (u.hostname or "127.0.0.1", u.port or 80)
        self._lock = threading.Lock()
        self._rng = random.Random(self.seed)
        self.url = ""

    def decide(self, method: str, target: str) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if not f.matches(method, target):
                    continue
                f.seen += 1
                if f.limit is not None and f.fired >= f.limit:
                    continue
                hit = (
                    (f.nth is not None and f.seen in f.nth)
                    or (f.fraction is not None and self._rng.random() < f.fraction)
                    or (f.nth is None and f.fraction is None)
                )
                if hit:
                    f.fired += 1
                    return f
            return None

    def record(self, method: str, target: str, action: str) -> None:
        with self._lock:
            self.log.append(Request(method, target, action))

    def count(self, action: str, method: str | None = None, path: str | None = None) -> int:
        with self._lock:
            return sum(
                1
                for r in self.log
                if r.action == action
                and (method is None or r.method == method)
                and (path is None or path in r.target)
            )

    def forward(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> tuple:
        conn = http.client.HTTPConnection(*self._up, timeout=60)
        try:
            conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for k, v in headers:
                conn.putheader(k, v)
            conn.endheaders(body if body else None)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, resp.reason, resp.getheaders(), data
        finally:
            conn.close()


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        proxy = self.server.proxy
        while True:
            line = self.rfile.readline(65537)
            if not line or not line.strip():
                return
            method, target, _ = line.decode("latin-1").split(" ", 2)
            headers: list[tuple[str, str]] = []
            while True:
                h = self.rfile.readline(65537).decode("latin-1")
                if h in ("\r\n", "\n", ""):
                    break
                k, _, v = h.partition(":")
                headers.append((k.strip(), v.strip()))
            hmap = {k.lower(): v for k, v in headers}
            length = int(hmap.get("content-length", "0") or 0)
            fault = proxy.decide(method, target)
            if hmap.get("expect", "").lower() == "100-continue" and (fault is None or fault.kind != "error"):
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self.wfile.flush()
            if fault is not None and fault.kind == "reset":
                self.rfile.read(int(length * fault.body_fraction))
                proxy.record(method, target, "reset")
                self._reset()
                return
            expect = hmap.get("expect", "").lower() == "100-continue"
            body = (
                b"" if (expect and fault is not None and fault.kind == "error") else self.rfile.read(length)
            )
            if fault is not None and fault.kind == "error":
                proxy.record(method, target, f"error {fault.status}")
                code, message = ERROR_CODES.get(fault.status, ERROR_CODES[500])
                payload = (
                    f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                    f"<Message>{message}</Message><RequestId>fault</RequestId></Error>"
                ).encode()
                self._respond(fault.status, code, [("Content-Type", "application/xml")], payload, method)
                if expect:
                    return  # the client never sent the body (no 100 Continue): the connection cannot be reused
                continue
            if fault is not None and fault.kind == "delay":
                time.sleep(fault.seconds)
            status, reason, rheaders, data = proxy.forward(method, target, headers, body)
            if fault is not None and fault.kind == "drop_response":
                proxy.record(method, target, "drop_response")
                self._reset()
                return
            proxy.record(method, target, "delay" if fault is not None else "forward")
            self._respond(status, reason, rheaders, data, method)

    def _respond(self, status: int, reason: str, headers: list, data: bytes, method: str) -> None:
        out = [f"HTTP/1.1 {status} {reason}"]
        for k, v in headers:
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                out.append(f"{k}: {v}")
        length = len(data)
        if method == "HEAD":
            length = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
            data = b""
        out.append(f"Content-Length: {length}")
        self.wfile.write(("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + data)
        self.wfile.flush()

    def _reset(self) -> None:
        # SO_LINGER 0: close() sends RST, as a dropped connection does (not a polite FIN)
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: FaultProxy


@contextmanager
def fault_proxy(upstream: str, faults: list[Fault] | None = None, seed: int = 0) -> Iterator[FaultProxy]:
    """Run a :class:`FaultProxy` on 127.0.0.1 (random port) in front of ``upstream``; ``proxy.url`` is its URL."""
    proxy = FaultProxy(upstream, list(faults or []), seed)
    server = _Server(("127.0.0.1", 0), _Handler)
    server.proxy = proxy
    proxy.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="fault-proxy", daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        server.shutdown()
        server.server_close()
