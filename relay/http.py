"""Health, readiness and Prometheus metrics over HTTP, on a daemon thread beside the relay.

* ``GET /healthz``: 200 ``ok`` while the relay's loop is alive (it passed within
  ``stall_seconds``); 503 ``starting``, ``stopped`` or ``stalled`` otherwise.
  For a liveness probe: a database outage does not fail it (the loop keeps backing off), also
  one that was there before the relay's first pass.
* ``GET /readyz``: 200 ``ok`` when the database answers ``SELECT 1`` (within ``db_timeout``,
  cached ``db_cache_seconds``) and the relay is neither paused nor draining; else 503 and
  ``draining``, ``paused`` or ``database_unreachable``.
  For monitoring, not for a sidecar's readiness probe: a sidecar's readiness gates its pod's.
* ``GET /metrics``: the relay's registry in the Prometheus text format.

Anything else is a 404. The probes answer a code word only: whoever reaches the port learns
nothing of the database (its host, user, driver errors). The detail (the driver's error, the
stall's length, the pause's reason) goes to the ``relay.http`` log (``action=http_probe``)
each time a probe's answer changes. Requests are not logged; a failed one is, in one line
(``action=http_error``), never as a traceback on stderr.

At most ``max_connections`` connections are served at once, each given ``head_seconds`` to
send its request line and headers: a slow or idle client holds a slot (a thread, a
descriptor) for that long at most, more clients never take more, and none of them can keep a
probe out (see :class:`_HTTPServer`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import sys
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
_MAX_CONNECTIONS = 16  # probes and scrapes come a few a second and are answered in milliseconds
_HEAD_SECONDS = 5.0  # a probe sends its request line and headers at once
_TALLY_SECONDS = 60.0  # connections closed for their deadline or the limit: one line a minute
_WARN_CODES = frozenset({"stalled", "database_unreachable"})


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
        self._lock = threading.Lock()
        self._answers: dict[str, str] = {}  # probe -> its last code word

    def healthz(self) -> tuple[int, str, bytes]:
        loop_at = self.relay.loop_at
        if loop_at is None:  # before the first pass: alive while it tries to reach the database
            loop_at = self.relay.waiting_at
        if loop_at is None:
            code = "stopped" if self.relay.state is RelayState.DRAINING else "starting"
            return self._answer("/healthz", code)
        stalled = time.monotonic() - loop_at
        if stalled > self.stall_seconds:
            detail = f"no pass of the loop for {stalled:.0f}s (limit {self.stall_seconds:g}s)"
            return self._answer("/healthz", "stalled", detail)
        return self._answer("/healthz", "ok")

    def readyz(self) -> tuple[int, str, bytes]:
        relay = self.relay
        if relay.state is RelayState.DRAINING:
            return self._answer("/readyz", "draining")
        if relay.paused:
            return self._answer("/readyz", "paused", f"sending paused: {relay.pause_code}")
        error = self.database.check()
        if error is not None:
            return self._answer("/readyz", "database_unreachable", error)
        return self._answer("/readyz", "ok")

    def _answer(self, probe: str, code: str, detail: str = "") -> tuple[int, str, bytes]:
        """The page says ``code`` only; the log says it with ``detail`` when the probe's code
        changes (a probe every second would repeat the same line every second)."""
        with self._lock:
            changed = self._answers.get(probe, "ok") != code
            self._answers[probe] = code
        if changed:
            _log.log(
                logging.WARNING if code in _WARN_CODES else logging.INFO,
                "%s answers %s%s",
                probe,
                code,
                f": {detail}" if detail else "",
                extra={"action": "http_probe", "probe": probe, "code": code},
            )
        status = HTTPStatus.OK if code == "ok" else HTTPStatus.SERVICE_UNAVAILABLE
        return status, _TEXT, f"{code}\n".encode()

    def metrics_page(self) -> tuple[int, str, bytes]:
        return HTTPStatus.OK, CONTENT_TYPE_LATEST, self.metrics.exposition()


class _Tally:
    """Counts connections ended for one reason; :meth:`flush` (from the accept loop) logs the
    count at most once per ``_TALLY_SECONDS``: a flood of slow or resetting clients would
    otherwise flood the log too."""

    def __init__(self, what: str, action: str, verb: str = "closed") -> None:
        self._what, self._action, self._verb = what, action, verb
        self._lock = threading.Lock()
        self._count = 0
        self._logged_at = -math.inf

    def add(self) -> None:
        with self._lock:
            self._count += 1

    def flush(self) -> None:
        now = time.monotonic()
        with self._lock:
            count = self._count
            if not count or now - self._logged_at < _TALLY_SECONDS:
                return
            self._count, self._logged_at = 0, now
        _log.warning(
            "%s %d connection(s) %s",
            self._verb,
            count,
            self._what,
            extra={"action": self._action, "connections": count},
        )


class _HTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once, each given
    ``head_seconds`` to send its request line and headers.

    A connection over the limit takes the slot of the oldest one still sending its head
    (closed at once): slow clients cannot keep a probe out, which answers within
    milliseconds of its head. With none to take, it is closed at once, without a thread. The
    deadline is checked between polls of the accept loop (``service_actions``, every
    ``poll_interval``).
    """

    daemon_threads = True
    request_queue_size = 64  # socketserver's 5 drops a burst's connections for a second

    def __init__(
        self, address: tuple[str, int], app: _App, *, max_connections: int, head_seconds: float
    ) -> None:
        self.app = app
        self.max_connections = max_connections
        self.head_seconds = head_seconds
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        # connections still sending their head -> their deadline, oldest first
        self._heads: dict[socket.socket, float] = {}
        self._late = _Tally(f"that sent no request within {head_seconds:g}s", "http_timeout")
        self._over = _Tally(f"over the limit of {max_connections}", "http_busy")
        self._reset = _Tally(
            "ended by the client mid-request (reset, closed)", "http_error", verb="counted"
        )
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False) and not (
            self._close_oldest_head() and self._slots.acquire(timeout=1.0)
        ):
            self._over.add()
            self.shutdown_request(request)
            return
        with self._lock:
            self._heads[request] = time.monotonic() + self.head_seconds
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: socketserver closes the connection
            self.head_received(request)
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.head_received(request)
            self._slots.release()

    def sending_head(self, request: socket.socket) -> bool:
        with self._lock:
            return request in self._heads

    def head_received(self, request: socket.socket) -> bool:
        """Whether ``request`` may be answered: False once it was closed for its deadline or
        for a connection over the limit."""
        with self._lock:
            return self._heads.pop(request, None) is not None

    def _close_oldest_head(self) -> bool:
        with self._lock:
            if not self._heads:
                return False
            oldest = next(iter(self._heads))
            del self._heads[oldest]
        self._over.add()
        _shut(oldest)
        return True

    def service_actions(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [request for request, deadline in self._heads.items() if deadline <= now]
            for request in late:
                del self._heads[request]
        for request in late:
            self._late.add()
            _shut(request)
        self._late.flush()
        self._over.flush()
        self._reset.flush()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One log line instead of socketserver's traceback on stderr; a client that resets or
        closes mid-request is only counted (anyone can do that a thousand times a minute)."""
        if isinstance(sys.exception(), ConnectionError):
            self._reset.add()
            return
        _log.warning(
            "request from %s failed: %s",
            client_address[0],
            _one_line(sys.exception()),
            extra={"action": "http_error"},
        )


def _shut(request: socket.socket) -> None:
    """End a connection's reads: its handler sees the end of the stream and returns."""
    with contextlib.suppress(OSError):  # already closed by its handler
        request.shutdown(socket.SHUT_RDWR)


def _one_line(exc: BaseException | None) -> str:
    return _clip(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


def _clip(text: str) -> str:
    """One short line: a request line of 64 KiB is the client's, not the log's."""
    text = " ".join(text.split())
    return text if len(text) <= 200 else text[:199] + "…"


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    server_version = "outbox-relay"
    sys_version = ""
    timeout = 10.0  # each read and write; the head's deadline is the server's

    def parse_request(self) -> bool:
        """The request line and headers; a connection the server closed gets no answer."""
        if not self.server.sending_head(self.connection):
            return False
        parsed = super().parse_request()
        return self.server.head_received(self.connection) and parsed

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

    def log_error(self, format: str, *args: Any) -> None:
        """A request refused (malformed, a method other than GET and HEAD) or timed out: one
        log line instead of a line on stderr."""
        _log.warning(
            "request from %s refused: %s",
            self.client_address[0],
            _clip(format % args),
            extra={"action": "http_error"},
        )

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
    host: str = "127.0.0.1",
    *,
    stall_seconds: float | None = None,
    db_timeout: float = 2.0,
    db_cache_seconds: float = 1.5,
    max_connections: int = _MAX_CONNECTIONS,
    head_seconds: float = _HEAD_SECONDS,
) -> Server:
    """Serve ``/healthz``, ``/readyz`` and ``/metrics`` for ``relay`` on ``host:port`` (port 0:
    any free port, see ``Server.port``) from a daemon thread. Raises ``OSError`` if the port
    cannot be bound.

    ``stall_seconds`` (default: the longer of 60 s and the lease) is how long the loop may go
    without a pass before ``/healthz`` fails: a loop stalled that long no longer renews the
    leases of its sends in flight. ``max_connections`` and ``head_seconds``: the connections
    served at once and the time each has to send its request head (see the module's docstring).
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
    httpd = _HTTPServer(
        (host, port), app, max_connections=max_connections, head_seconds=head_seconds
    )
    server = Server(httpd)
    server.start()
    _log.info(
        "serving /healthz, /readyz and /metrics on %s:%d",
        host,
        server.port,
        extra={"action": "http_started"},
    )
    return server
