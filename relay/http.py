"""Health, readiness and Prometheus metrics over HTTP, on a daemon thread beside the relay.

* ``GET /healthz``: 200 ``ok`` while the relay's loop is alive (it passed within
  ``stall_seconds``); 503 ``starting``, ``stopped`` or ``loop stalled for Ns`` otherwise.
  For a liveness probe: a database outage does not fail it (the loop keeps backing off), also
  one that was there before the relay's first pass.
* ``GET /readyz``: 200 ``ok`` when the database answers ``SELECT 1`` (within ``db_timeout``,
  cached ``db_cache_seconds``) and the relay is neither paused nor draining; else 503 and the
  reason: ``draining``, ``paused: AccountSendingPausedException``,
  ``database unreachable: ...`` (the driver's first line, never the URL's password).
  For monitoring, not for a sidecar's readiness probe: a sidecar's readiness gates its pod's.
* ``GET /metrics``: the relay's registry in the Prometheus text format.

Anything else is a 404. Requests are not logged.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import sqlalchemy as sa
from prometheus_client import CONTENT_TYPE_LATEST

from outbox.schema import RelayState
from relay.metrics import RelayMetrics
from relay.worker import Relay

__all__ = ["Server", "start_http_server"]

_log = logging.getLogger("relay.http")

_TEXT = "text/plain; charset=utf-8"
_MIN_STALL_SECONDS = 60.0  # above the longest database backoff (30 s) of a healthy loop


class _DatabaseProbe:
    """``SELECT 1`` on a short connection of the relay's engine, on a thread of its own so a
    database that does not answer costs a request ``timeout`` seconds at most, and only one
    probe is ever outstanding."""

    def __init__(self, engine: sa.Engine, *, timeout: float, cache_seconds: float) -> None:
        self._engine = engine
        self._timeout = timeout
        self._cache_seconds = cache_seconds
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._started_at = -math.inf
        self._checked_at = -math.inf
        self._error: str | None = None

    def check(self) -> str | None:
        """None when the database answered, else why not."""
        with self._lock:
            now = time.monotonic()
            thread = self._thread
            if thread is not None and thread.is_alive():
                if now - self._started_at >= self._timeout:
                    return self._no_answer()
            elif now - self._checked_at < self._cache_seconds:
                return self._error
            else:
                thread = threading.Thread(target=self._probe, name="outbox-db-probe", daemon=True)
                self._thread, self._started_at = thread, now
                thread.start()
            deadline = self._started_at + self._timeout
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            return self._no_answer()
        with self._lock:
            return self._error

    def _no_answer(self) -> str:
        return f"no answer within {self._timeout:g}s"

    def _probe(self) -> None:
        try:
            with self._engine.connect() as conn:
                conn.exec_driver_sql("SELECT 1")
            error = None
        except Exception as exc:
            error = _describe(exc, self._engine.url)
        with self._lock:
            self._error, self._checked_at = error, time.monotonic()


def _describe(exc: BaseException, url: sa.URL) -> str:
    """The driver's error, first line, without the password."""
    orig = getattr(exc, "orig", None) or exc
    lines = str(orig).strip().splitlines()
    text = lines[0].strip() if lines else ""
    if url.password:
        text = text.replace(str(url.password), "***")
    text = f"{type(orig).__name__}: {text}" if text else type(orig).__name__
    return text if len(text) <= 200 else text[:199] + "…"


class _App:
    def __init__(
        self,
        relay: Relay,
        metrics: RelayMetrics,
        *,
        stall_seconds: float,
        db_timeout: float,
        db_cache_seconds: float,
    ) -> None:
        self.relay = relay
        self.metrics = metrics
        self.stall_seconds = stall_seconds
        self.database = _DatabaseProbe(
            relay.engine, timeout=db_timeout, cache_seconds=db_cache_seconds
        )

    def healthz(self) -> tuple[int, str, bytes]:
        loop_at = self.relay.loop_at
        if loop_at is None:  # before the first pass: alive while it tries to reach the database
            loop_at = self.relay.waiting_at
        if loop_at is None:
            reason = "stopped" if self.relay.state is RelayState.DRAINING else "starting"
            return _unavailable(reason)
        stalled = time.monotonic() - loop_at
        if stalled > self.stall_seconds:
            return _unavailable(f"loop stalled for {stalled:.0f}s")
        return HTTPStatus.OK, _TEXT, b"ok\n"

    def readyz(self) -> tuple[int, str, bytes]:
        relay = self.relay
        if relay.state is RelayState.DRAINING:
            return _unavailable("draining")
        if relay.paused:
            return _unavailable(f"paused: {relay.pause_code}")
        error = self.database.check()
        if error is not None:
            return _unavailable(f"database unreachable: {error}")
        return HTTPStatus.OK, _TEXT, b"ok\n"

    def metrics_page(self) -> tuple[int, str, bytes]:
        return HTTPStatus.OK, CONTENT_TYPE_LATEST, self.metrics.exposition()


def _unavailable(reason: str) -> tuple[int, str, bytes]:
    return HTTPStatus.SERVICE_UNAVAILABLE, _TEXT, f"{reason}\n".encode()


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], app: _App) -> None:
        self.app = app
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    server_version = "outbox-relay"
    sys_version = ""
    timeout = 10.0

    def do_GET(self) -> None:
        self._respond(body=True)

    def do_HEAD(self) -> None:
        self._respond(body=False)

    def _respond(self, *, body: bool) -> None:
        app = self.server.app
        path = urlsplit(self.path).path
        try:
            if path == "/healthz":
                status, content_type, page = app.healthz()
            elif path == "/readyz":
                status, content_type, page = app.readyz()
            elif path == "/metrics":
                status, content_type, page = app.metrics_page()
            else:
                status, content_type, page = HTTPStatus.NOT_FOUND, _TEXT, b"not found\n"
        except Exception:
            _log.exception("%s failed", path, extra={"action": "http_error"})
            status, content_type, page = HTTPStatus.INTERNAL_SERVER_ERROR, _TEXT, b"error\n"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(page)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if body:
            self.wfile.write(page)

    def log_message(self, format: str, *args: Any) -> None:
        """No access log: probes and scrapes would drown the relay's own lines."""


class Server:
    """The running HTTP server: :attr:`port` (the one bound, also for port 0), :meth:`stop`."""

    def __init__(self, httpd: _HTTPServer) -> None:
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="outbox-http"
        )
        self._thread.daemon = True
        self._stopped = False

    def start(self) -> None:
        self._thread.start()

    @property
    def host(self) -> str:
        return str(self._httpd.server_address[0])

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def start_http_server(
    relay: Relay,
    metrics: RelayMetrics,
    port: int,
    host: str = "0.0.0.0",
    *,
    stall_seconds: float | None = None,
    db_timeout: float = 2.0,
    db_cache_seconds: float = 1.5,
) -> Server:
    """Serve ``/healthz``, ``/readyz`` and ``/metrics`` for ``relay`` on ``host:port`` (port 0:
    any free port, see ``Server.port``) from a daemon thread. Raises ``OSError`` if the port
    cannot be bound.

    ``stall_seconds`` (default: the longer of 60 s and the lease) is how long the loop may go
    without a pass before ``/healthz`` fails: a loop stalled that long no longer renews the
    leases of its sends in flight.
    """
    if stall_seconds is None:
        stall_seconds = max(_MIN_STALL_SECONDS, relay.config.lease_seconds)
    app = _App(
        relay,
        metrics,
        stall_seconds=stall_seconds,
        db_timeout=db_timeout,
        db_cache_seconds=db_cache_seconds,
    )
    server = Server(_HTTPServer((host, port), app))
    server.start()
    _log.info(
        "serving /healthz, /readyz and /metrics on %s:%d",
        host,
        server.port,
        extra={"action": "http_started"},
    )
    return server
