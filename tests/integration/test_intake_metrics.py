"""The event intake's Prometheus metrics on the three databases: events by type and effect,
reconciled by result from both its senders (the intake's events, the relay's reconcile sweep),
the intake's lag on the database's clock, and the bounce and complaint rates of the
``outbox_delivery_summary`` view."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta

import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from outbox.schema import Status, messages
from relay import signals
from relay.clock import read_database_time
from relay.config import RelayConfig
from relay.events import parse
from relay.intake import Intake, announce, apply_events
from relay.metrics import IntakeMetrics, RelayMetrics
from relay.testing import FakeSender
from relay.worker import Relay
from tests.support.db import Backend
from tests.support.sqs import ses_event, sns_body, stage


def samples(page: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page.decode())
        for s in family.samples
    }


def sent_row(engine: sa.Engine, provider_id: str, category: str = "default") -> tuple[int, str]:
    """A row sent just now (the summary counts the last 24 h by the database's clock)."""
    token = str(uuid.uuid4())
    mid = stage(engine, Status.SENT, tokens=(token,), provider_id=provider_id)
    with engine.begin() as conn:
        now = read_database_time(conn)
        conn.execute(
            sa.update(messages)
            .where(messages.c.id == mid)
            .values(sent_at=now - timedelta(minutes=1), category=category)
        )
    return mid, token


def test_intake_metrics_count_events_and_read_the_rates_and_the_lag(backend: Backend):
    engine = backend.engine
    intake = Intake(engine=engine, client=None, queue_url="https://sqs.example/1/q")
    metrics = IntakeMetrics(intake, summary_interval=0.0)
    try:
        rows = [sent_row(engine, f"ses-m{n}") for n in range(4)]
        with engine.connect() as conn:
            now = read_database_time(conn)
        bodies = [
            sns_body(
                ses_event(
                    kind,
                    provider_id=f"ses-m{n}",
                    message_id=mid,
                    claim_token=token,
                    at=now - timedelta(seconds=30 + n),
                )
            )
            for n, ((mid, token), kind) in enumerate(
                zip(rows, ["bounce", "complaint", "delivery", "delivery"], strict=True)
            )
        ]
        with engine.begin() as conn:
            applied = apply_events(conn, [parse(b) for b in [*bodies, "{bad"]], now=now)
        for a in applied:
            intake.counts[(a.event.type.value, a.effect.value)] += 1
        got = samples(metrics.exposition())
        assert got[("outbox_events_total", (("effect", "status"), ("type", "bounce")))] == 1
        assert got[("outbox_events_total", (("effect", "malformed"), ("type", "malformed")))] == 1
        assert got[("outbox_bounce_rate", (("category", "default"),))] == pytest.approx(0.25)
        assert got[("outbox_complaint_rate", (("category", "default"),))] == pytest.approx(0.25)
        lag = got[("outbox_event_intake_lag_seconds", ())]
        assert 30 <= lag < 60  # the newest event happened 30 s before the database's now
        assert got[("outbox_event_read_errors_total", ())] == 0
    finally:
        metrics.close()


def test_no_event_yet_means_no_lag_series(backend: Backend):
    intake = Intake(engine=backend.engine, client=None, queue_url="https://sqs.example/1/q")
    metrics = IntakeMetrics(intake, summary_interval=0.0)
    try:
        page = metrics.exposition().decode()
        assert "# TYPE outbox_event_intake_lag_seconds gauge" in page
        assert re.search(r"^outbox_event_intake_lag_seconds ", page, re.MULTILINE) is None
    finally:
        metrics.close()


def test_reconciled_counts_the_intakes_and_the_relays_results_on_one_page(backend: Backend):
    engine = backend.engine
    intake = Intake(engine=engine, client=None, queue_url="https://sqs.example/1/q")
    relay = Relay(engine=engine, sender=FakeSender(), config=RelayConfig(database_url=backend.url))
    metrics = RelayMetrics(relay, intake=intake)
    other = Intake(engine=engine, client=None, queue_url="https://sqs.example/1/q")
    try:
        token = str(uuid.uuid4())
        mid = stage(engine, Status.UNKNOWN_OUTCOME, tokens=(token,))
        with engine.begin() as conn:
            applied = apply_events(
                conn,
                [
                    parse(
                        sns_body(
                            ses_event(
                                "send", provider_id="ses-r", message_id=mid, claim_token=token
                            )
                        )
                    )
                ],
                now=read_database_time(conn),
            )
        announce(intake, applied)
        announce(other, applied)  # another intake in the process: not this page's
        signals.reconciled.send(
            relay, message_id=1, category="default", result="requeued", provider_message_id=None
        )
        got = samples(metrics.exposition())
        assert got[("outbox_reconciled_total", (("result", "sent"),))] == 1
        assert got[("outbox_reconciled_total", (("result", "requeued"),))] == 1
        assert ("outbox_messages_total", (("category", "default"), ("outcome", "sent"))) not in got
    finally:
        metrics.close()
