"""Attack review of e85bed0: a provider given after the relay started is picked up; a save
or a send never fails because of ``recording``."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from relay import tracing
from relay.testing import FakeSender
from tests.support.db import row
from tests.support.factories import enqueue
from tests.support.inprocess import closing, relay_for, settle


def test_a_provider_set_after_start_gets_process_and_settle_spans(postgres_backend):
    engine = postgres_backend.engine
    sender = FakeSender()
    relay = relay_for(postgres_backend, sender)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with closing(relay):
        (first,) = enqueue(engine, 1, prefix="a")
        settle(relay)
        assert tracing.flush()
        assert exporter.get_finished_spans() == ()
        tracing.use_tracer_provider(provider)
        try:
            (second,) = enqueue(engine, 1, prefix="b")
            settle(relay)
            assert tracing.flush()
        finally:
            tracing.use_tracer_provider(None)
    names = sorted(s.name for s in exporter.get_finished_spans())
    assert names == ["outbox process", "outbox settle"], names
    assert row(engine, first).status == row(engine, second).status == "sent"


def test_a_raising_provider_lookup_never_fails_a_send(postgres_backend, monkeypatch):
    from opentelemetry import trace

    def broken():
        raise RuntimeError("cannot load provider")

    monkeypatch.setattr(trace, "get_tracer_provider", broken)
    engine = postgres_backend.engine
    sender = FakeSender()
    relay = relay_for(postgres_backend, sender)
    ids = enqueue(engine, 5)
    with closing(relay):
        settle(relay)
    assert sorted(sender.sent_ids) == ids
    assert {row(engine, i).status for i in ids} == {"sent"}
