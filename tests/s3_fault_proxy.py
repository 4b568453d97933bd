"""A fault-injecting HTTP proxy on loopback, in front of a real S3 endpoint (moto_server):
it forwards every request unchanged but answers a chosen share of them itself with the
errors S3 really returns under load (500 InternalError, 503 SlowDown), and delays some.

Deterministic: fault i is decided by a seeded RNG over the request count, so a failing
test replays the same faults.

Permanent faults: with `write_prefix` (e.g. "/bucket/out/"), writes under it (PUT, POST,
DELETE) succeed `allow_writes` times and are then refused forever with `write_error`
(default 403 AccessDenied, as after a revoked policy; (404, "NoSuchBucket", ...) for a
deleted bucket, (500, "InternalError", ...) for a store that never recovers)."""
from __future__ import annotations

import http.client
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, Optional, Tuple
from urllib.parse import urlsplit

_ERRORS = [(500, "InternalError", "We encountered an internal error. Please try again."),
           (503, "SlowDown", "Please reduce your request rate.")]
ACCESS_DENIED = (403, "AccessDenied", "Access Denied")


class FaultProxy:
    def __init__(self, upstream: str, fail_rate: float = 0.2, delay_rate: float = 0.05, delay_s: float = 0.5,
                 seed: int = 0, max_consecutive: int = 2, write_prefix: Optional[str] = None,
                 allow_writes: int = 0, write_error: Tuple[int, str, str] = ACCESS_DENIED):
        u = urlsplit(upstream)
        self.upstream = (u.hostname, u.port)
        self.fail_rate, self.delay_rate, self.delay_s = fail_rate, delay_rate, delay_s
        # per request (method and path): a client's retries of one call get through within
        # max_consecutive + 1 attempts, however many other clients' calls come in between
        self.max_consecutive = max_consecutive
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.requests = self.faults = 0
        self._streaks: Dict[Tuple[str, str], int] = {}
        self.write_prefix, self.allow_writes, self.write_error = write_prefix, allow_writes, write_error
        self.writes = self.write_faults = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _decide(self, method: str, path: str):
        with self.lock:
            self.requests += 1
            if self.write_prefix is not None and method in ("PUT", "POST", "DELETE") \
                    and path.startswith(self.write_prefix):
                if self.writes >= self.allow_writes:
                    self.write_faults += 1
                    return self.write_error, False
                self.writes += 1
            streak = self._streaks.get((method, path), 0)
            fail = streak < self.max_consecutive and self.rng.random() < self.fail_rate
            self._streaks[(method, path)] = streak + 1 if fail else 0
            delay = not fail and self.rng.random() < self.delay_rate
            self.faults += fail
            return (self.rng.choice(_ERRORS) if fail else None), delay

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().strip().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _serve(self):
                body = self._body()
                error, delay = proxy._decide(self.command, self.path)
                if delay:
                    time.sleep(proxy.delay_s)
                if error is not None:
                    status, code, msg = error
                    payload = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                               f"<Message>{msg}</Message></Error>").encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                # HEAD carries no body: pass the object's size on (S3 clients read it from there)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve

        return Handler

    def __enter__(self) -> "FaultProxy":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
