"""A loopback HTTP proxy in front of the S3 server that delays, fails or drops a seeded
fraction of requests, as a congested or flaky object store does. Bounded: it serves only
127.0.0.1 and stops with the test."""

from __future__ import annotations

import http.client
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
               "proxy-connection"}  # fmt: skip


class FaultyProxy:
    """``error_rate`` of requests get a 503 SlowDown, ``drop_rate`` lose their connection
    without an answer, ``delay_rate`` wait ``delay_s`` first; the rest pass through."""

    def __init__(
        self,
        upstream_port: int,
        *,
        seed: int,
        error_rate: float = 0.0,
        drop_rate: float = 0.0,
        delay_rate: float = 0.0,
        delay_s: float = 0.5,
    ) -> None:
        self.upstream_port = upstream_port
        self.rates = (error_rate, drop_rate, delay_rate)
        self.delay_s = delay_s
        self.counts = {"requests": 0, "503": 0, "dropped": 0, "delayed": 0, "passed": 0}
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _decide(self) -> str:
        with self._lock:
            self.counts["requests"] += 1
            roll = self._rng.random()
            error, drop, delay = self.rates
            if roll < error:
                verdict = "503"
            elif roll < error + drop:
                verdict = "dropped"
            elif roll < error + drop + delay:
                verdict = "delayed"
            else:
                verdict = "passed"
            self.counts[verdict] += 1
            return verdict

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            break
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    return b"".join(chunks)
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _handle(self) -> None:
                body = self._body()
                verdict = proxy._decide()
                if verdict == "dropped":
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                if verdict == "503":
                    payload = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown'
                               b"</Code><Message>Please reduce your request rate.</Message>"
                               b"</Error>")  # fmt: skip
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                if verdict == "delayed":
                    time.sleep(proxy.delay_s)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body or None, headers=headers)
                    answer = upstream.getresponse()
                    data = answer.read()
                finally:
                    upstream.close()
                self.send_response(answer.status, answer.reason)
                for key, value in answer.getheaders():
                    if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        return Handler
