"""Health, readiness and Prometheus metrics of a relay running in a thread, over real HTTP."""

from __future__ import annotations

import collections
import contextlib
import importlib.metadata
import logging
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from outbox import Category, Outbox
from outbox.exceptions import ConfigurationError
from outbox.schema import attempts, messages
from relay.db import CONNECT_TIMEOUT, make_engine
from relay.http import start_http_server
from relay.metrics import RelayMetrics
from relay.pause import Scope, ScopeKind
from relay.senders import Accepted, Disabled, OutgoingMessage, Permanent, Transient
from relay.testing import FakeSender
from relay.worker import Relay
from tests.support.factories import enqueue
from tests.support.inprocess import relay_for
from tests.support.waiting import wait_for

VERSION = importlib.metadata.version("sqlalchemy-outbox")
OB = Outbox(categories=[Category(name="fast", max_attempts=5, backoff_base=0.02, backoff_cap=0.05)])


class Page:
    def __init__(self, status: int, body: str, content_type: str) -> None:
        self.status, self.body, self.content_type = status, body, content_type


class Endpoint:
    """A relay's HTTP server and its metrics."""

    def __init__(self, server, metrics: RelayMetrics) -> None:
        self.server, self.metrics = server, metrics

    def get(self, path: str, method: str = "GET") -> Page:
        url = f"http://127.0.0.1:{self.server.port}{path}"
        request = urllib.request.Request(url, method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return Page(
                    response.status, response.read().decode(), response.headers["Content-Type"]
                )
        except urllib.error.HTTPError as exc:
            with exc:
                return Page(exc.code, exc.read().decode(), exc.headers["Content-Type"])

    def samples(self) -> dict[tuple[str, frozenset], float]:
        """Every sample of /metrics, parsed by the Prometheus client's own parser."""
        page = self.get("/metrics")
        assert page.status == 200
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(page.body)
            for s in family.samples
        }


def value(samples, name: str, **labels) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def named(samples, name: str) -> dict[frozenset, float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


@contextmanager
def serving(relay: Relay, *, lag_interval: float = 0.0, **http):
    metrics = RelayMetrics(relay, lag_interval=lag_interval)
    server = start_http_server(relay, metrics, 0, "127.0.0.1", **http)
    try:
        yield Endpoint(server, metrics)
    finally:
        server.stop()
        metrics.close()


@contextmanager
def running(relay: Relay):
    thread = threading.Thread(target=relay.run, name="relay-under-test", daemon=True)
    thread.start()
    try:
        wait_for(lambda: relay.loop_at is not None)
        yield thread
    finally:
        relay.request_stop()
        thread.join(10)
    assert not thread.is_alive()


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def actions(self, action: str) -> list[str]:
        """The messages of the lines with ``action``."""
        return [r.getMessage() for r in self.records if getattr(r, "action", None) == action]


@contextmanager
def http_log():
    """The ``relay.http`` logger's records, whatever another test made of the ``relay``
    logger's level or propagation."""
    logger = logging.getLogger("relay.http")
    records, level = Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)


@contextmanager
def unstarted_relay(tmp_path):
    """A relay never run (its /healthz says starting), on a database it never opens."""
    url = f"sqlite:///{tmp_path / 'unused.db'}"
    engine = make_engine(url)
    try:
        yield relay_for(None, FakeSender(), engine=engine, url=url)
    finally:
        engine.dispose()


def db_counts(engine, query: str) -> dict[tuple, int]:
    with engine.connect() as conn:
        return {tuple(row[:-1]): int(row[-1]) for row in conn.execute(sa.text(query))}


# -- health and readiness ------------------------------------------------------------------


def test_health_and_readiness_follow_the_relay_loop(backend):
    relay = relay_for(backend, FakeSender())
    with serving(relay) as http:
        page = http.get("/healthz")
        assert (page.status, page.body) == (503, "starting\n")
        with running(relay):
            page = http.get("/healthz")
            assert (page.status, page.body, page.content_type) == (
                200,
                "ok\n",
                "text/plain; charset=utf-8",
            )
            assert (http.get("/readyz").status, http.get("/readyz").body) == (200, "ok\n")
            assert http.get("/healthz?probe=k8s").status == 200
            assert (http.get("/healthz", method="HEAD").status, http.get("/nope").status) == (
                200,
                404,
            )
            assert http.get("/metrics/extra").status == 404
        assert (http.get("/healthz").status, http.get("/healthz").body) == (503, "stopped\n")
        assert (http.get("/readyz").status, http.get("/readyz").body) == (503, "draining\n")


def test_healthz_fails_while_the_loop_is_stuck(backend):
    """A clock that blocks stands in for a loop stuck on a hung connection."""
    gate = threading.Event()
    gate.set()

    def clock() -> datetime:
        gate.wait(10)
        return datetime.now(UTC)

    relay = relay_for(backend, FakeSender(), clock=clock)
    with http_log() as log, serving(relay, stall_seconds=0.3) as http, running(relay):
        assert http.get("/healthz").status == 200
        gate.clear()
        time.sleep(0.6)
        page = http.get("/healthz")
        assert (page.status, page.body) == (503, "stalled\n")
        assert http.get("/healthz").body == "stalled\n"
        gate.set()
        wait_for(lambda: http.get("/healthz").status == 200)
    (stalled, recovered) = log.actions("http_probe")
    assert stalled.startswith("/healthz answers stalled: no pass of the loop for ")
    assert stalled.endswith("s (limit 0.3s)")
    assert recovered == "/healthz answers ok"


def test_readyz_is_503_while_paused_and_the_lag_shows_the_waiting_message(backend):
    (mid,) = enqueue(backend.engine, 1)
    sender = FakeSender(lambda m: Disabled(code="AccountSendingPausedException", pause=True))
    relay = relay_for(backend, sender, pause_seconds=300)
    with http_log() as log, serving(relay) as http, running(relay):
        wait_for(lambda: relay.paused)
        page = http.get("/readyz")
        assert (page.status, page.body) == (503, "paused\n")
        assert log.actions("http_probe") == [
            "/readyz answers paused: sending paused: AccountSendingPausedException"
        ]
        assert http.get("/healthz").status == 200, "a paused relay is alive"
        # The released message is due and nobody sends it: make it two minutes late.
        with backend.engine.begin() as conn:
            conn.execute(
                sa.update(messages)
                .where(messages.c.id == mid)
                .values(next_attempt_at=datetime.now(UTC) - timedelta(seconds=120))
            )
        samples = http.samples()
        assert value(samples, "outbox_paused") == 1.0
        assert value(samples, "outbox_messages_total", outcome="released", category="default") == 1
        assert 119.0 <= value(samples, "outbox_lag_seconds", category="default") < 180.0
        assert value(samples, "outbox_due_messages", category="default") == 1.0
        assert value(samples, "outbox_send_duration_seconds_count", category="default") == 1
        assert len(sender.calls) == 1, "no probe before pause_seconds"
    with backend.engine.connect() as conn:
        status = conn.execute(sa.select(messages.c.status)).scalar_one()
    assert status == "pending"


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://outbox:s3cret-pw@127.0.0.1:1/outbox",
        "mysql+pymysql://outbox:s3cret-pw@127.0.0.1:1/outbox",
        "sqlite:////nonexistent-outbox-dir/sub/outbox.db",
    ],
    ids=["postgresql", "mysql", "sqlite"],
)
def test_readyz_says_database_unreachable_and_logs_the_error_without_its_password(url):
    """The driver's error names the host, port and user: the page says only the code word,
    to anyone who reaches the port; the log has the error, once, not once a probe."""
    engine = make_engine(url)
    try:
        relay = relay_for(None, FakeSender(), engine=engine, url=url)
        with http_log() as log, serving(relay) as http:
            page = http.get("/readyz")
            assert (page.status, page.body) == (503, "database_unreachable\n")
            assert http.get("/readyz").body == page.body
            (line,) = log.actions("http_probe")
            assert line.startswith("/readyz answers database_unreachable: OperationalError: ")
            assert "s3cret-pw" not in line
            (record,) = [r for r in log.records if r.getMessage() == line]
            assert (record.levelname, record.probe, record.code) == (
                "WARNING",
                "/readyz",
                "database_unreachable",
            )
            # /metrics still answers; the lag it cannot read is left out and counted.
            samples = http.samples()
            assert value(samples, "outbox_lag_refresh_errors_total") == 1.0
            assert named(samples, "outbox_lag_seconds") == {}
            assert value(samples, "outbox_paused") == 0.0
    finally:
        engine.dispose()


def test_readyz_answers_within_its_timeout_when_the_database_hangs():
    """A server that accepts connections and never answers: the probe gives up after
    db_timeout, and later requests do not pile up more probes behind the hung one."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/outbox"
        engine = make_engine(url)
        try:
            relay = relay_for(None, FakeSender(), engine=engine, url=url)
            with http_log() as log, serving(relay, db_timeout=0.3) as http:
                began = time.monotonic()
                page = http.get("/readyz")
                assert time.monotonic() - began < 2.0
                assert (page.status, page.body) == (503, "database_unreachable\n")
                assert log.actions("http_probe") == [
                    "/readyz answers database_unreachable: no answer within 0.3s"
                ]
                probes = [t for t in threading.enumerate() if t.name == "outbox-db-probe"]
                began = time.monotonic()
                assert http.get("/readyz").status == 503
                assert time.monotonic() - began < 0.25, "the hung probe is not waited on again"
                again = [t for t in threading.enumerate() if t.name == "outbox-db-probe"]
                assert len(probes) == len(again) == 1
        finally:
            listener.close()  # resets the connection the probe waits on
            for t in threading.enumerate():
                if t.name == "outbox-db-probe":
                    t.join(10)
            engine.dispose()


def test_healthz_passes_while_a_relay_started_during_an_outage_waits_for_its_database():
    """A liveness probe must not restart a relay for an outage a restart cannot fix, also one
    that was there before the relay's first pass (the wait for the schema is the loop)."""
    url = "postgresql+psycopg://postgres@127.0.0.1:1/outbox"  # connection refused
    engine = make_engine(url)
    # backoff is capped at a heartbeat interval (lease / 4 = 1.25 s here), under the stall
    # limit, as 30 s is under 60 s in production
    relay = relay_for(None, FakeSender(), engine=engine, url=url)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            relay.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name="relay-without-db", daemon=True)
    try:
        with serving(relay, stall_seconds=2.5) as http:
            thread.start()
            wait_for(lambda: http.get("/healthz").status == 200)
            time.sleep(4.0)  # past the stall limit, refused connections and backoff all along
            assert (http.get("/healthz").status, http.get("/healthz").body) == (200, "ok\n")
            assert http.get("/readyz").status == 503
    finally:
        relay.request_stop()
        thread.join(10)
        engine.dispose()
    assert not thread.is_alive()
    assert errors == [], "a relay stopped before its database answered exits cleanly"
    assert (relay.loop_at, relay.waiting_at) == (None, None)


def test_healthz_fails_once_a_relay_refused_to_start(tmp_path):
    """A relay whose run() raised before its loop (no outbox tables here; its id in use goes
    the same way) is not alive: /healthz must not answer 200 for the rest of the stall limit."""
    url = f"sqlite:///{tmp_path / 'never-migrated.db'}"
    engine = make_engine(url)
    relay = relay_for(None, FakeSender(), engine=engine, url=url)
    try:
        with serving(relay, stall_seconds=60) as http:
            with pytest.raises(ConfigurationError, match="lacks the outbox tables"):
                relay.run()
            assert http.get("/healthz").status == 503
    finally:
        engine.dispose()
    assert (relay.loop_at, relay.waiting_at) == (None, None)


def test_a_database_host_that_never_answers_does_not_stall_the_loop_past_its_health():
    """The relay's engine gives up a connection attempt after CONNECT_TIMEOUT seconds (libpq
    alone waits minutes), so the loop goes on backing off and /healthz stays 200."""
    accepted: list[socket.socket] = []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/outbox"
        engine = make_engine(url)
        relay = relay_for(None, FakeSender(), engine=engine, url=url)
        thread = threading.Thread(target=relay.run, name="relay-db-silent", daemon=True)
        stall = CONNECT_TIMEOUT * 0.8
        try:
            with serving(relay, stall_seconds=stall) as http:
                thread.start()
                began = time.monotonic()
                while time.monotonic() - began < CONNECT_TIMEOUT + stall * 0.5:
                    with contextlib.suppress(TimeoutError):
                        accepted.append(listener.accept()[0])  # and never answer
                assert len(accepted) >= 2, "the first attempt was given up and retried"
                assert http.get("/healthz").status == 200
        finally:
            relay.request_stop()
            for conn in accepted:
                conn.close()
            thread.join(10)
            engine.dispose()
    assert not thread.is_alive()


# -- the endpoint's own limits --------------------------------------------------------------


def test_the_endpoint_listens_on_the_loopback_unless_told_otherwise(tmp_path):
    with unstarted_relay(tmp_path) as relay:
        metrics = RelayMetrics(relay, lag_interval=0.0)
        server = start_http_server(relay, metrics, 0)
        try:
            assert server.host == "127.0.0.1"
        finally:
            server.stop()
            metrics.close()


def test_slow_clients_take_a_bounded_number_of_threads_and_healthz_still_answers(tmp_path):
    """60 clients each sending a byte a second, never a whole request: they hold at most
    the connection limit's threads (16), and a probe is answered at once among them."""
    with unstarted_relay(tmp_path) as relay, serving(relay) as http:
        before = threading.active_count()
        clients: list[socket.socket] = []
        try:
            for _ in range(60):
                client = socket.create_connection(("127.0.0.1", http.server.port), timeout=5)
                clients.append(client)
                client.sendall(b"G")
            for _ in range(3):
                time.sleep(1.0)
                for client in clients:
                    with contextlib.suppress(OSError):  # closed by the server
                        client.sendall(b"E")
                assert threading.active_count() - before <= 16
                began = time.monotonic()
                page = http.get("/healthz")
                assert (page.status, page.body) == (503, "starting\n")
                assert time.monotonic() - began < 1.0
        finally:
            for client in clients:
                client.close()


def test_a_client_that_never_finishes_its_request_is_closed_after_the_head_deadline(tmp_path):
    """A byte a second resets no deadline: the request head has 5 s in all, then the
    connection is closed without an answer, and the log says so in one line."""
    with (
        unstarted_relay(tmp_path) as relay,
        http_log() as log,
        serving(relay) as http,
        socket.create_connection(("127.0.0.1", http.server.port), timeout=10) as client,
    ):
        began = time.monotonic()
        received = None
        for byte in b"GET /healthz HTTP/1.0\r\nX-Slow: " + b"x" * 20:
            try:
                client.sendall(bytes([byte]))
                client.settimeout(1.0)
                received = client.recv(100)
            except TimeoutError:
                continue
            except OSError:  # reset while a byte was on its way
                received = b""
            break
        assert received == b"", "closed, no answer"
        assert 4.5 <= time.monotonic() - began < 7.0
        wait_for(lambda: log.actions("http_timeout"))
        assert log.actions("http_timeout") == [
            "closed 1 connection(s) that sent no request within 5s"
        ]


def test_clients_that_reset_mid_request_are_counted_in_one_log_line_nothing_on_stderr(
    tmp_path, capfd
):
    """Anyone who reaches the port can reset a thousand connections a minute: each is
    counted, one line a minute says how many, and socketserver's traceback never reaches
    stderr."""
    with unstarted_relay(tmp_path) as relay, http_log() as log, serving(relay) as http:
        for _ in range(30):
            with socket.create_connection(("127.0.0.1", http.server.port), timeout=5) as client:
                client.sendall(b"GET /healthz HTTP/1.0\r\nHost: relay\r\n")
                time.sleep(0.02)  # the server waits for the rest of the head
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        wait_for(lambda: log.actions("http_error"))
        time.sleep(0.5)  # room for more lines, were there any
        assert http.get("/healthz").status == 503, "still serving"
    (line,) = log.actions("http_error")
    assert "connection(s) ended by the client mid-request" in line
    assert "\n" not in line
    assert capfd.readouterr().err == ""


# -- metrics -------------------------------------------------------------------------------


def test_metrics_match_what_the_database_holds(backend):
    """8 messages: two fail transiently once, one twice, one permanently."""
    ids = enqueue(backend.engine, 8, outbox=OB, category="fast", short=True)
    script = {("#0", 1), ("#1", 1), ("#3", 1), ("#3", 2)}

    def outcome(message: OutgoingMessage):
        if (message.email.subject, message.attempt) in script:
            return Transient(code="ServiceUnavailable")
        if message.email.subject == "#2":
            return Permanent(code="MessageRejected")
        return Accepted(provider_message_id=f"p-{message.id}")

    sender = FakeSender(outcome, latency=0.01)
    relay = relay_for(backend, sender, relay_id="http-relay")
    with serving(relay) as http, running(relay):
        open_states = "SELECT COUNT(*) FROM outbox_messages WHERE status IN "
        open_states += "('pending', 'retrying', 'processing')"
        wait_for(lambda: db_counts(backend.engine, open_states) == {(): 0})

        def finished_counting():
            s = http.samples()
            done = value(s, "outbox_messages_total", outcome="sent", category="fast") or 0
            done += value(s, "outbox_messages_total", outcome="failed", category="fast") or 0
            return done == len(ids)

        wait_for(finished_counting)  # signals fire just after each commit
        samples = http.samples()

    by_status = db_counts(
        backend.engine, "SELECT category, status, COUNT(*) FROM outbox_messages GROUP BY 1, 2"
    )
    summary = db_counts(
        backend.engine, "SELECT category, status, message_count FROM outbox_status_summary"
    )
    assert by_status == summary == {("fast", "sent"): 7, ("fast", "failed"): 1}
    counters = {
        (labels["category"], labels["outcome"]): v
        for labels, v in ((dict(k), v) for k, v in named(samples, "outbox_messages_total").items())
    }
    with backend.engine.connect() as conn:
        attempt_outcomes = collections.Counter(
            conn.execute(sa.select(attempts.c.outcome)).scalars()
        )
    assert attempt_outcomes == {"accepted": 7, "transient": 4, "permanent": 1}
    assert counters == {
        ("fast", "sent"): summary["fast", "sent"],
        ("fast", "failed"): summary["fast", "failed"],
        ("fast", "retry_scheduled"): attempt_outcomes["transient"],
    }
    sends = sum(attempt_outcomes.values())
    assert len(sender.calls) == sends == 12
    assert value(samples, "outbox_claims_total", category="fast") == sends
    assert value(samples, "outbox_send_duration_seconds_count", category="fast") == sends
    assert value(samples, "outbox_send_duration_seconds_sum", category="fast") >= 0.01 * sends
    assert value(samples, "outbox_send_duration_seconds_bucket", category="fast", le="+Inf") == 12
    assert value(samples, "outbox_claim_duration_seconds_count") > 0
    assert value(samples, "outbox_claim_duration_seconds_sum") > 0
    assert value(samples, "outbox_in_flight") == 0.0
    assert value(samples, "outbox_paused") == 0.0
    assert named(samples, "outbox_send_rate_limit") == {}, "absent: no limit"
    assert value(
        samples, "outbox_relay_info", relay_id="http-relay", sender="fake", version=VERSION
    )


def test_a_scoped_pause_shows_in_its_own_gauge_and_the_relay_stays_unpaused(backend):
    """An identity paused by the provider: ``outbox_scope_paused`` names it while the account
    gauge stays 0 (the rest of the mail goes on), and the series goes when the pause ends."""
    denied = Scope(ScopeKind.IDENTITY, "promo@example.com")
    refusing = threading.Event()
    refusing.set()
    accepted: list[int] = []

    def answer(m: OutgoingMessage):
        if refusing.is_set() and m.email.sender == "promo@example.com":
            return Disabled(code="AccessDeniedException", pause=True, scope=denied)
        accepted.append(m.id)
        return Accepted(provider_message_id=f"id-{m.id}")

    enqueue(backend.engine, 2, short=True, sender="promo@example.com")
    shop = enqueue(backend.engine, 3, short=True, prefix="shop")
    sender = FakeSender(answer)
    relay = relay_for(backend, sender, pause_seconds=0.5)
    with serving(relay) as http, running(relay):
        wait_for(lambda: relay.pauses.paused(denied))
        wait_for(lambda: set(shop) <= set(accepted))
        samples = http.samples()
        assert value(samples, "outbox_paused") == 0.0
        assert named(samples, "outbox_scope_paused") == {
            frozenset({"kind": "identity", "name": "promo@example.com", "via": ""}.items()): 1.0
        }
        refusing.clear()  # the identity is verified again: the next probe ends the pause
        wait_for(lambda: not relay.pauses.paused(denied), timeout=10)
        assert named(http.samples(), "outbox_scope_paused") == {}


def test_metrics_page_is_prometheus_text_with_conventional_names(backend):
    relay = relay_for(backend, FakeSender())
    with serving(relay) as http:
        page = http.get("/metrics")
    assert (page.status, page.content_type) == (200, CONTENT_TYPE_LATEST)
    families = {f.name: f.type for f in text_string_to_metric_families(page.body)}
    assert families == {
        "outbox_messages": "counter",
        "outbox_claims": "counter",
        "outbox_claim_duration_seconds": "histogram",
        "outbox_send_duration_seconds": "histogram",
        "outbox_relay_info": "gauge",
        "outbox_in_flight": "gauge",
        "outbox_paused": "gauge",
        "outbox_scope_paused": "gauge",
        "outbox_send_rate_limit": "gauge",
        "outbox_lag_seconds": "gauge",
        "outbox_due_messages": "gauge",
        "outbox_lag_refresh_errors": "counter",
        "outbox_key_due_messages": "gauge",
        "outbox_key_lag_seconds": "gauge",
        "outbox_key_refresh_errors": "counter",
        "outbox_reconciled": "counter",  # the reconcile sweep's requeues (every relay runs it)
    }
    assert "_created" not in page.body
    assert "# HELP outbox_send_rate_limit " in page.body
    assert "python_gc" not in page.body, "a registry of its own, not the global one"


def test_in_flight_and_rate_limit_gauges_read_the_running_relay(backend):
    """#0 is throttled once (the relay halves its rate), #1 hangs in flight until released."""
    enqueue(backend.engine, 2, short=True)
    gate = threading.Event()

    def outcome(message: OutgoingMessage):
        if message.email.subject == "#0" and message.attempt == 1:
            return Transient(code="Throttling", throttled=True)
        if message.email.subject == "#1":
            gate.wait(10)
        return Accepted(provider_message_id=f"p-{message.id}")

    relay = relay_for(backend, FakeSender(outcome), max_send_rate=5.0)
    with serving(relay) as http:
        assert value(http.samples(), "outbox_send_rate_limit") == 5.0
        with running(relay):
            try:
                wait_for(lambda: relay.in_flight == 1 and relay.limiter.rate < 4.0)
                samples = http.samples()
                assert value(samples, "outbox_in_flight") == 1.0
                assert value(samples, "outbox_send_rate_limit") == pytest.approx(2.5, abs=0.5)
            finally:
                gate.set()
            wait_for(lambda: value(http.samples(), "outbox_in_flight") == 0.0)


def test_each_relay_counts_only_its_own_messages(backend):
    enqueue(backend.engine, 3)
    first = relay_for(backend, FakeSender(), relay_id="first", exit_when_idle=True)
    second = relay_for(backend, FakeSender(), relay_id="second")
    with serving(first) as one, serving(second) as two:
        first.run()
        counted = named(one.samples(), "outbox_messages_total")
        assert counted == {frozenset({("outcome", "sent"), ("category", "default")}): 3.0}
        assert named(two.samples(), "outbox_messages_total") == {}
        info = named(two.samples(), "outbox_relay_info")
        assert info == {
            frozenset({("relay_id", "second"), ("sender", "fake"), ("version", VERSION)}): 1.0
        }


def test_lag_is_read_at_most_once_per_interval(backend):
    relay = relay_for(backend, FakeSender())
    idle = {frozenset({("category", c)}): 0.0 for c in ("default", "transactional")}
    with serving(relay, lag_interval=3600) as http:
        assert named(http.samples(), "outbox_lag_seconds") == idle, "nothing due"
        (mid,) = enqueue(backend.engine, 1, outbox=OB, category="fast")
        with backend.engine.begin() as conn:
            conn.execute(
                sa.update(messages)
                .where(messages.c.id == mid)
                .values(next_attempt_at=datetime.now(UTC) - timedelta(seconds=30))
            )
        assert named(http.samples(), "outbox_lag_seconds") == idle, "cached"
        http.metrics.refresh_lag()
        samples = http.samples()
        assert 29.0 <= value(samples, "outbox_lag_seconds", category="fast") < 90.0
        with backend.engine.begin() as conn:
            conn.execute(sa.delete(messages))
        http.metrics.refresh_lag()
        samples = http.samples()
        assert value(samples, "outbox_lag_seconds", category="fast") == 0.0, "seen: kept at 0"
        assert value(samples, "outbox_due_messages", category="fast") == 0.0
