"""OpenTelemetry: the enqueue's trace context stored in the row, the relay's process spans
linked to it, a settle span per saved batch; nothing when OpenTelemetry is absent, and never
a failed enqueue or send when it breaks. On SQLite, PostgreSQL and MariaDB."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session

from outbox import Email, Outbox, Status
from outbox import tracing as app_tracing
from outbox.message import TRACE_KEY
from outbox.schema import messages
from outbox.sqlite import enable_savepoints
from relay import tracing as relay_tracing
from relay.senders import Transient
from relay.testing import FakeSender, run_until_idle
from tests.support.db import statuses
from tests.support.factories import email
from tests.support.hand_clocks import Clock
from tests.support.inprocess import closing, relay_for, settle

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def provider():
    """A tracer provider for this module's tests only (the global one is never set)."""
    provider = TracerProvider()
    app_tracing.use_tracer_provider(provider)
    relay_tracing.use_tracer_provider(provider)
    yield provider
    app_tracing.use_tracer_provider(None)
    relay_tracing.use_tracer_provider(None)
    provider.shutdown()


@pytest.fixture(scope="module")
def _exporter(provider):
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture
def spans(_exporter):
    """The spans finished during the test."""
    assert relay_tracing.flush()  # an earlier test's, made late by the telemetry thread
    _exporter.clear()
    yield _exporter
    assert relay_tracing.flush()
    _exporter.clear()


@pytest.fixture
def app_tracer(provider):
    return provider.get_tracer("the-app")


def payload_of(engine: sa.Engine, message_id: int) -> dict:
    with engine.connect() as conn:
        stored = conn.execute(
            sa.select(messages.c.payload).where(messages.c.id == message_id)
        ).scalar_one()
    return json.loads(stored) if isinstance(stored, str) else stored


def named(spans: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    assert relay_tracing.flush()  # the relay's spans are made on its telemetry thread
    return [s for s in spans.get_finished_spans() if s.name == name]


def traceparent(context: trace.SpanContext) -> str:
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def test_an_enqueue_in_a_span_stores_the_context_of_its_create_span(backend, spans, app_tracer):
    with app_tracer.start_as_current_span("checkout") as request, Session(backend.engine) as s:
        result = Outbox().enqueue(s, email(1), category="transactional")
        s.commit()
    [create] = named(spans, "outbox create")
    assert create.kind is SpanKind.PRODUCER
    assert create.parent is not None
    assert create.parent.span_id == request.get_span_context().span_id
    assert create.context.trace_id == request.get_span_context().trace_id
    assert dict(create.attributes) == {
        "messaging.system": "outbox",
        "messaging.operation.type": "create",
        "messaging.operation.name": "create",
        "messaging.destination.name": "transactional",
        "messaging.message.id": str(result.id),
        "outbox.duplicate": False,
    }
    stored = payload_of(backend.engine, result.id)
    assert stored[TRACE_KEY] == {"traceparent": traceparent(create.context)}
    assert Email.from_payload(stored) == email(1)


def test_enqueue_many_and_both_async_forms_store_a_context_each_call(backend, spans, app_tracer):
    ob = Outbox()
    with app_tracer.start_as_current_span("bulk"), Session(backend.engine) as s:
        many = ob.enqueue_many(s, [email(1), email(2), email(3)])
        s.commit()

    async def scenario():
        engine = create_async_engine(backend.async_url)
        enable_savepoints(engine)
        try:
            Sessions = async_sessionmaker(engine)
            with app_tracer.start_as_current_span("async") as request:
                async with Sessions.begin() as session:
                    one = await ob.enqueue_async(session, email(4))
                    two = await ob.enqueue_many_async(session, [email(5), email(6)])
            return request, [one, *two]
        finally:
            await engine.dispose()

    request, async_results = asyncio.run(scenario())
    batch, single, pair = named(spans, "outbox create")
    assert batch.attributes["messaging.batch.message_count"] == 3
    assert "messaging.message.id" not in batch.attributes
    assert single.attributes["messaging.message.id"] == str(async_results[0].id)
    assert pair.attributes["messaging.batch.message_count"] == 2
    # the app's span is current inside run_sync's greenlet too
    parents = [span.parent.span_id if span.parent else None for span in (single, pair)]
    assert parents == [request.get_span_context().span_id] * 2
    expected = [batch] * 3 + [single] + [pair] * 2
    for result, span in zip([*many, *async_results], expected, strict=True):
        stored = payload_of(backend.engine, result.id)[TRACE_KEY]
        assert stored == {"traceparent": traceparent(span.context)}


def test_an_enqueue_without_a_current_span_stores_nothing(backend, spans):
    with Session(backend.engine) as s:
        result = Outbox().enqueue(s, email(1))
        s.commit()
    assert TRACE_KEY not in payload_of(backend.engine, result.id)
    assert spans.get_finished_spans() == ()


def test_every_attempt_links_to_the_enqueue_and_each_save_to_its_attempts(
    backend, spans, app_tracer
):
    with app_tracer.start_as_current_span("signup"), Session(backend.engine) as s:
        (mid,) = [Outbox().enqueue(s, email(1)).id]
        s.commit()
    [create] = named(spans, "outbox create")
    clock = Clock()
    sender = FakeSender([Transient(code="Throttling", message="slow down", throttled=True)])
    with closing(relay_for(backend, sender, clock)) as relay:
        settle(relay)
        clock.advance(3600)
        settle(relay)
    assert statuses(backend.engine) == {mid: Status.SENT}

    first, second = named(spans, "outbox process")
    for attempt, span in enumerate((first, second), start=1):
        assert span.kind is SpanKind.CONSUMER
        assert span.parent is None, "a root span: the enqueue is a link, not a parent"
        [link] = span.links
        assert link.context.trace_id == create.context.trace_id
        assert link.context.span_id == create.context.span_id
        assert span.attributes["messaging.system"] == "outbox"
        assert span.attributes["messaging.operation.type"] == "process"
        assert span.attributes["messaging.destination.name"] == "default"
        assert span.attributes["messaging.message.id"] == str(mid)
        assert span.attributes["outbox.category"] == "default"
        assert span.attributes["outbox.attempt"] == attempt
    assert first.attributes["outbox.outcome"] == "transient"
    assert first.attributes["outbox.error_code"] == "Throttling"
    assert first.attributes["error.type"] == "Throttling"
    assert first.status.status_code is StatusCode.ERROR
    assert "outbox.provider_message_id" not in first.attributes
    assert second.attributes["outbox.outcome"] == "accepted"
    assert second.attributes["outbox.provider_message_id"] == f"fake-{mid}-2"
    assert "outbox.error_code" not in second.attributes
    assert second.status.status_code is StatusCode.UNSET

    settles = named(spans, "outbox settle")
    linked = [link.context.span_id for s in settles for link in s.links]
    assert linked == [first.context.span_id, second.context.span_id]
    for span in settles:
        assert span.kind is SpanKind.CLIENT
        assert span.attributes["messaging.operation.type"] == "settle"
        assert span.attributes["messaging.batch.message_count"] == 1
        assert span.attributes["outbox.applied"] == 1


def test_a_row_without_a_stored_context_gets_an_unlinked_process_span(backend, spans):
    with Session(backend.engine) as s:
        (mid,) = [Outbox().enqueue(s, email(1)).id]
        s.commit()
    with backend.engine.begin() as conn:  # a garbled context does not concern the email
        stored = payload_of(backend.engine, mid)
        stored[TRACE_KEY] = {"traceparent": 7, "tracestate": ["x"]}
        conn.execute(messages.update().where(messages.c.id == mid).values(payload=stored))
    sender = FakeSender()
    with closing(relay_for(backend, sender)) as relay:
        settle(relay)
    assert sender.sent_ids == [mid]
    [process] = named(spans, "outbox process")
    assert process.links == ()
    assert process.attributes["outbox.outcome"] == "accepted"


class _Broken(Exception):
    pass


class _RaisingExporter(SpanExporter):
    def export(self, spans):
        raise _Broken("the collector is gone")

    def shutdown(self):
        pass


class _RaisingProcessor(SpanProcessor):
    def on_start(self, span, parent_context=None):
        raise _Broken("on_start")

    def on_end(self, span):
        raise _Broken("on_end")


def test_a_broken_exporter_or_processor_never_fails_an_enqueue_or_a_send(
    backend, caplog, monkeypatch
):
    broken = TracerProvider()
    broken.add_span_processor(SimpleSpanProcessor(_RaisingExporter()))
    broken.add_span_processor(_RaisingProcessor())
    monkeypatch.setattr(app_tracing, "_warned", False)
    monkeypatch.setattr(relay_tracing, "_warned", False)
    app_tracing.use_tracer_provider(broken)
    relay_tracing.use_tracer_provider(broken)
    try:
        caplog.set_level(logging.DEBUG)
        with TracerProvider().get_tracer("app").start_as_current_span("request"):
            with Session(backend.engine) as s:
                ids = [r.id for r in Outbox().enqueue_many(s, [email(1), email(2)])]
                s.commit()
            with Session(backend.engine) as s:
                ids.append(Outbox().enqueue(s, email(3)).id)
                s.commit()
        sender = FakeSender([Transient(code="Throttling")])
        clock = Clock()
        with closing(relay_for(backend, sender, clock)) as relay:
            settle(relay)
            clock.advance(3600)
            settle(relay)
        assert relay_tracing.flush()  # the relay's spans are made on its telemetry thread
    finally:
        app_tracing.use_tracer_provider(None)
        relay_tracing.use_tracer_provider(None)
        broken.shutdown()
    assert sorted(sender.sent_ids) == ids
    assert set(statuses(backend.engine).values()) == {Status.SENT}
    failed = [r for r in caplog.records if getattr(r, "action", None) == "tracing_failed"]
    warned = [(r.name, r.levelno) for r in failed if r.levelno == logging.WARNING]
    assert warned == [("outbox", logging.WARNING), ("relay", logging.WARNING)], "once per side"
    assert len(failed) > len(warned)


NO_OTEL = textwrap.dedent(
    """
    import json, sys

    sys.modules["opentelemetry"] = None  # any `import opentelemetry...` now fails

    import sqlalchemy as sa
    from sqlalchemy.orm import Session

    import outbox.tracing, relay.tracing
    from outbox import Email, Outbox
    from outbox.schema import messages
    from relay.testing import run_until_idle

    engine = sa.create_engine(sys.argv[1])
    with Session(engine) as session:
        mid = Outbox().enqueue(
            session, Email(sender="shop@example.com", to="ada@example.com", subject="S", text="T")
        ).id
        session.commit()
    sender = run_until_idle(engine)
    with engine.connect() as conn:
        payload = conn.execute(sa.select(messages.c.payload).where(messages.c.id == mid)).scalar()
    payload = json.loads(payload) if isinstance(payload, str) else payload
    print(outbox.tracing.ENABLED, relay.tracing.ENABLED, "trace" in payload, mid)
    print(*sorted(sender.sent_ids))
    """
)


def test_without_opentelemetry_enqueue_and_the_relay_work_and_store_no_context(
    backend, spans, app_tracer
):
    with app_tracer.start_as_current_span("before"), Session(backend.engine) as s:
        traced = Outbox().enqueue(s, email(1)).id  # stored by an app that traces
        s.commit()
    assert TRACE_KEY in payload_of(backend.engine, traced)
    done = subprocess.run(
        [sys.executable, "-c", NO_OTEL, backend.url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    enabled_app, enabled_relay, stored, mid = first.split()
    assert (enabled_app, enabled_relay, stored) == ("False", "False", "False")
    assert second.split() == [str(traced), mid], "the traced row is sent by a relay without it"
    assert set(statuses(backend.engine).values()) == {Status.SENT}


class _SlowProcessor(SpanProcessor):
    """A span processor that blocks (a stalled stdout, an exporter waiting on a collector)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_end(self, span: ReadableSpan) -> None:
        time.sleep(self.seconds)


def test_a_span_processor_that_blocks_never_holds_a_send_or_the_loop(backend):
    """Each relay span's end blocks 3 s, with a 0.5 s send timeout and a 1.5 s lease: the
    answered sends are saved as sent, once each, in well under the block (before, the send's
    future waited for the exporter: past its lease the sweep took the accepted send for an
    unknown outcome, and under "resend" sent it again; the save's span held the loop's
    transaction open)."""
    slow = TracerProvider()
    slow.add_span_processor(_SlowProcessor(3.0))
    relay_tracing.use_tracer_provider(slow)
    try:
        request = TracerProvider().get_tracer("app").start_as_current_span("request")
        with request, Session(backend.engine) as s:
            ids = [r.id for r in Outbox().enqueue_many(s, [email(1), email(2)])]
            s.commit()
        began = time.monotonic()
        sender = run_until_idle(
            backend.engine, send_timeout=0.5, lease_seconds=1.5, drain_seconds=0.5
        )
        took = time.monotonic() - began
    finally:
        assert relay_tracing.flush(timeout=30)
        relay_tracing.use_tracer_provider(None)
        slow.shutdown()
    assert sorted(sender.called_ids) == ids, "each sent once"
    assert set(statuses(backend.engine).values()) == {Status.SENT}
    assert took < 2.5, took
