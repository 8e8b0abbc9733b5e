"""The tracing modules without a database: what is stored, what is read back, and nothing at
all when OpenTelemetry is off."""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider

from outbox import Email
from outbox import tracing as app_tracing
from outbox.message import TRACE_KEY
from relay import tracing as relay_tracing
from relay.senders import Accepted, OutgoingMessage

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def rows(count: int = 1) -> list[dict[str, Any]]:
    email = Email(sender="shop@example.com", to="ada@example.com", subject="S", text="T")
    return [{"category": "default", "payload": email.to_payload()} for _ in range(count)]


def test_an_enqueue_without_a_current_span_stores_nothing():
    written = rows(2)
    with app_tracing.creating(written) as created:
        created([(1, False), (2, False)])
    assert all(TRACE_KEY not in row["payload"] for row in written)


def test_an_enqueue_in_a_span_stores_a_traceparent_in_each_row():
    provider = TracerProvider()
    written = rows(2)
    app_tracing.use_tracer_provider(provider)
    try:
        with (
            provider.get_tracer("app").start_as_current_span("request") as request,
            app_tracing.creating(written) as created,
        ):
            created([(1, False), (2, False)])
    finally:
        app_tracing.use_tracer_provider(None)
    trace_id = f"{request.get_span_context().trace_id:032x}"
    stored = [row["payload"][TRACE_KEY] for row in written]
    assert stored[0] == stored[1]
    assert list(stored[0]) == ["traceparent"]
    assert stored[0]["traceparent"].split("-")[1] == trace_id


def test_with_tracing_off_nothing_is_stored_and_the_save_is_not_wrapped(monkeypatch):
    monkeypatch.setattr(app_tracing, "ENABLED", False)
    monkeypatch.setattr(relay_tracing, "ENABLED", False)
    provider = TracerProvider()
    written = rows()
    with (
        provider.get_tracer("app").start_as_current_span("request"),
        app_tracing.creating(written) as created,
    ):
        created([(1, False)])
    assert TRACE_KEY not in written[0]["payload"]

    def save(relay, conn, batch, now):
        return [True for _ in batch]

    assert relay_tracing.settles(save) is save
    assert relay_tracing.stored({TRACE_KEY: {"traceparent": PARENT}}) is None


@pytest.mark.parametrize(
    ("stored", "read"),
    [
        ({"traceparent": PARENT}, {"traceparent": PARENT}),
        (
            {"traceparent": PARENT, "tracestate": "a=1", "baggage": "user=ada"},
            {"traceparent": PARENT, "tracestate": "a=1"},
        ),
        ({"tracestate": "a=1"}, None),
        ({"traceparent": 7}, None),
        ("00-abc", None),
        (None, None),
    ],
    ids=[
        "traceparent",
        "tracestate-kept-rest-dropped",
        "no-traceparent",
        "not-a-str",
        "not-a-dict",
        "null",
    ],
)
def test_the_relay_reads_back_only_a_well_formed_context(stored, read):
    assert relay_tracing.stored({"v": 1, TRACE_KEY: stored}) == read
    assert relay_tracing.stored({"v": 1}) is None


@pytest.mark.parametrize("stored", [{"traceparent": PARENT}, "garbage", 7, None, ["x"]])
def test_from_payload_leaves_the_trace_context_out_whatever_it_holds(stored):
    email = Email(sender="shop@example.com", to="ada@example.com", subject="S", text="T")
    payload = {**email.to_payload(), TRACE_KEY: stored}
    assert Email.from_payload(payload) == email
    assert TRACE_KEY not in email.to_payload()


@pytest.mark.parametrize(
    ("carrier", "stored"),
    [
        ({"traceparent": PARENT}, {"traceparent": PARENT}),
        (
            {"traceparent": PARENT, "tracestate": "a=1,b=2"},
            {"traceparent": PARENT, "tracestate": "a=1,b=2"},
        ),
        # from the caller's request headers, so from anyone: bounded before it is in every row
        ({"traceparent": PARENT, "tracestate": "k=" + "v" * 600}, {"traceparent": PARENT}),
        ({"traceparent": PARENT, "tracestate": "k=\\\\" * 20}, {"traceparent": PARENT}),
        ({"traceparent": PARENT, "tracestate": "k=é"}, {"traceparent": PARENT}),
        ({"traceparent": "00-" + "x" * 32 + "-" + "0" * 16 + "-01"}, {}),
        ({"traceparent": PARENT + "-extra"}, {}),
        ({}, {}),
    ],
    ids=[
        "parent",
        "state",
        "state-too-long",
        "state-escapes",
        "state-not-ascii",
        "bad-parent",
        "long-parent",
        "none",
    ],
)
def test_the_stored_context_is_bounded(carrier, stored):
    assert app_tracing._bounded(carrier) == stored


def _outgoing() -> OutgoingMessage:
    email = Email(sender="shop@example.com", to=["a@example.com"], subject="Hi", text="x" * 10_000)
    return OutgoingMessage(id=7, key="k", category="default", attempt=1, email=email)


def test_an_attempt_waiting_for_its_span_holds_no_email():
    """Spans wait in a queue when an exporter stalls: each must not keep its email (1 MB
    attachments, thousands of them) alive."""
    message = _outgoing()
    attempt = relay_tracing.Attempt(message, {"traceparent": PARENT})
    assert message not in gc.get_referents(attempt)
    assert message.email not in gc.get_referents(attempt)
    assert (attempt.id, attempt.category, attempt.attempt) == (7, "default", 1)


def test_a_span_that_cannot_be_queued_never_costs_the_send_its_answer(monkeypatch):
    """Queueing the span runs after the provider answered: if it fails (no thread can be
    started, the interpreter shutting down), the answer is still returned."""
    telemetry = relay_tracing._Telemetry()
    monkeypatch.setattr(relay_tracing, "_telemetry", telemetry)

    def cannot_start(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", cannot_start)
    accepted = Accepted(provider_message_id="p-7")
    send = relay_tracing.Attempt(_outgoing(), None).run(lambda: (accepted, 0.01))
    assert send() == (accepted, 0.01)


def test_spans_are_made_only_while_a_provider_is_set(monkeypatch):
    """With OpenTelemetry installed and no provider, every span would be a no-op: the relay
    makes none (``recording`` is asked at each send and save). A provider set globally, or
    given with ``use_tracer_provider``, is picked up without a restart; one that cannot be
    loaded leaves tracing off, logged, and never fails the caller."""
    from opentelemetry import trace

    assert not relay_tracing.recording()  # this process never sets the global provider
    provider = TracerProvider()
    relay_tracing.use_tracer_provider(provider)
    try:
        assert relay_tracing.recording()
    finally:
        relay_tracing.use_tracer_provider(None)
    assert not relay_tracing.recording()
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)  # set globally
    assert relay_tracing.recording()
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: trace.NoOpTracerProvider())
    assert not relay_tracing.recording()

    def unloadable():
        raise ValueError("no provider named 'nonesuch'")

    monkeypatch.setattr(trace, "get_tracer_provider", unloadable)
    assert not relay_tracing.recording()


def test_with_no_provider_a_save_is_not_traced(monkeypatch):
    calls: list[object] = []
    monkeypatch.setattr(relay_tracing._telemetry, "submit", calls.append)

    @relay_tracing.settles
    def save(relay, conn, batch, now):
        return [True for _ in batch]

    assert save(None, None, [object()], None) == [True]
    assert calls == []
