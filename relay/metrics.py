"""Prometheus metrics of one relay, on a registry of its own.

The reference, with what each metric means and the queries to alert on, is
``docs/metrics.md`` (a test keeps it to exactly what a relay and its intake expose); the
tables below are its summary.

:class:`RelayMetrics` counts what the relay's signals report (connected with ``sender=relay``,
so several relays in one process never mix their numbers) and reads the relay's state when
scraped. The lag comes from the ``outbox_lag`` view, read on a short connection of the relay's
engine by the scraping thread, at most once every ``lag_interval`` seconds: never on the
relay's own loop. The lag per fairness key is read the same way from the queued rows (one
statement, :func:`relay.store.catalog.read_due_by_key`), at most once every ``key_interval``
seconds: it counts every due row, so it is read less often.

=================================== ========= ==================== =================================
name                                type      labels               what
=================================== ========= ==================== =================================
``outbox_messages_total``           counter   outcome, category    transitions this relay made:
                                                                   sent, retry_scheduled, failed,
                                                                   unknown_outcome, released,
                                                                   expired, stale_finalize,
                                                                   save_failed
``outbox_claims_total``             counter   category             messages claimed under a lease
``outbox_claim_duration_seconds``   histogram                      claim transactions (checkout,
                                                                   claim statements, commit),
                                                                   including those finding nothing
``outbox_send_duration_seconds``    histogram category             provider calls
``outbox_in_flight``                gauge                          sends in progress
``outbox_send_rate_limit``          gauge                          this relay's current limit in
                                                                   recipients/s; absent when
                                                                   unlimited
``outbox_paused``                   gauge                          1 while the provider has sending
                                                                   paused, else 0
``outbox_scope_paused``             gauge     kind, name, via      1 for each paused configuration
                                                                   set or identity (only its mail
                                                                   is held); absent when none is
``outbox_lag_seconds``              gauge     category             age of the oldest due message
                                                                   (0 while none is due: the
                                                                   built-in categories and those
                                                                   given from the first scrape,
                                                                   others once seen due)
``outbox_due_messages``             gauge     category             messages due now
``outbox_lag_refresh_errors_total`` counter                        failed reads of ``outbox_lag``
                                                                   (the lag series are left out
                                                                   until a read works again)
``outbox_key_due_messages``         gauge     key                  messages due now per fairness
                                                                   key: the ``top_keys`` keys with
                                                                   the most, the rest summed as
                                                                   ``other``, the unkeyed as ``""``
``outbox_key_lag_seconds``          gauge     key                  age of the oldest due message of
                                                                   each of those (0 while none)
``outbox_key_refresh_errors_total`` counter                        failed reads of the per-key lag
                                                                   (its series are left out until
                                                                   a read works again)
``outbox_relay_info``               gauge     relay_id, sender,    always 1
                                              version
``outbox_reconciled_total``         counter   result               ambiguous sends settled without
                                                                   an operator: sent (an event
                                                                   proved it, counted by the
                                                                   intake), requeued (the reconcile
                                                                   sweep, counted by the relay)
=================================== ========= ==================== =================================

With the event intake (``run --events-queue-url``, or ``events`` alone: :class:`IntakeMetrics`):

=================================== ========= ==================== =================================
name                                type      labels               what
=================================== ========= ==================== =================================
``outbox_events_total``             counter   type, effect         events this intake took from its
                                                                   queue: effect as stored
                                                                   (resolved, status, recorded,
                                                                   duplicate_send, unmatched,
                                                                   malformed, deferred), or
                                                                   duplicate, refused; a deferred
                                                                   event (its row was being sent)
                                                                   is counted again with the effect
                                                                   it had once applied
``outbox_event_intake_errors_total`` counter  kind                 failed passes and deletes: sqs,
                                                                   database
``outbox_event_intake_lag_seconds`` gauge                          the database's now minus the
                                                                   newest event's own time (SES's):
                                                                   how far behind SES the intake
                                                                   is; an event stamped more than
                                                                   a minute after its receipt is
                                                                   left out (forged)
``outbox_bounce_rate``              gauge     category             bounced / sent over 24 h, from
                                                                   ``outbox_delivery_summary``
``outbox_complaint_rate``           gauge     category             complained / sent over 24 h
``outbox_event_read_errors_total``  counter                        failed reads of the intake's
                                                                   views (their series are left out
                                                                   until a read works again)
=================================== ========= ==================== =================================

The intake's gauges are read on the scraping thread, at most once every ``summary_interval``
seconds (the delivery summary scans a day of sent rows).

The page leaves out the client library's ``*_created`` series: in the text format they are
gauges of their own, one per counter and histogram child, that no dashboard reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import sqlalchemy as sa
from blinker import NamedSignal
from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from outbox.schema import events
from relay import signals, store
from relay.clock import read_database_time
from relay.intake import Intake
from relay.pause import ScopeKind
from relay.store.catalog import DueByKey, KeyDue, read_due_by_key
from relay.worker import Relay

__all__ = [
    "BUILT_IN_CATEGORIES",
    "CLAIM_BUCKETS",
    "FUTURE_TOLERANCE_SECONDS",
    "OTHER_KEYS",
    "SEND_BUCKETS",
    "TOP_KEYS",
    "UNKEYED",
    "IntakeMetrics",
    "RelayMetrics",
]

# every Outbox has these two categories (outbox.category.DEFAULT_CATEGORIES; the relay does
# not import the app side): their lag series exist from the first scrape
BUILT_IN_CATEGORIES = frozenset({"default", "transactional"})

# The fairness keys with series of their own: a key is anyone's input (a tenant, a domain), so
# the page names the busiest TOP_KEYS and sums the rest under OTHER_KEYS; UNKEYED is no key
# (a key is never empty). A key spelled "other" is counted in OTHER_KEYS: one series a label.
TOP_KEYS = 20
OTHER_KEYS = "other"
UNKEYED = ""

_log = logging.getLogger("relay.metrics")

SEND_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
CLAIM_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

_OUTCOME_SIGNALS: dict[str, NamedSignal] = {
    "sent": signals.sent,
    "retry_scheduled": signals.retry_scheduled,
    "failed": signals.failed,
    "unknown_outcome": signals.unknown_outcome,
    "released": signals.released,
    "expired": signals.expired,
    "stale_finalize": signals.stale_finalize,
    "save_failed": signals.save_failed,
}

_Receiver = Callable[..., None]


@dataclass(frozen=True, slots=True)
class _Due:
    count: float
    lag_seconds: float


def _key_series(due: DueByKey, now: datetime) -> dict[str, _Due]:
    """Each ``key`` label's due count and lag: the unkeyed, the top keys, the rest; a label
    met twice (a key spelled like :data:`OTHER_KEYS`) is one series of both."""
    found: dict[str, KeyDue] = {}

    def add(label: str, d: KeyDue) -> None:
        seen = found.get(label)
        if seen is not None:
            oldest = [t for t in (seen.oldest_due_at, d.oldest_due_at) if t is not None]
            d = KeyDue(
                key=None,
                due_count=seen.due_count + d.due_count,
                oldest_due_at=min(oldest, default=None),
            )
        found[label] = d

    add(UNKEYED, due.unkeyed)
    for d in due.top:
        add(d.key or UNKEYED, d)
    add(OTHER_KEYS, due.rest)
    return {
        label: _Due(
            float(d.due_count),
            0.0 if d.oldest_due_at is None else max(0.0, (now - d.oldest_due_at).total_seconds()),
        )
        for label, d in found.items()
    }


class _Every:
    """Runs a read at most once every ``seconds``; a scrape that finds another one reading
    goes on with the last values rather than wait. The read sets :attr:`read_at`."""

    def __init__(self) -> None:
        self.read_at = -float("inf")
        self._lock = threading.Lock()

    def run(self, read: Callable[[], None], seconds: float) -> None:
        if time.monotonic() - self.read_at < seconds or not self._lock.acquire(blocking=False):
            return
        try:
            if time.monotonic() - self.read_at >= seconds:
                read()
        finally:
            self._lock.release()


def _package_version() -> str:
    try:
        return version("sqlalchemy-outbox")
    except PackageNotFoundError:
        return "unknown"


class RelayMetrics:
    """The metrics of ``relay``, in :attr:`registry` (a ``CollectorRegistry`` of its own).

    Create it before ``relay.run()`` so nothing goes uncounted; :meth:`close` disconnects it.
    With ``intake`` (the event intake running in the same process) its metrics are on the
    same registry (:class:`IntakeMetrics`).

    The lag and due gauges have a sample of 0 for each category with nothing due that is
    built in (``default``, ``transactional``: every ``Outbox`` has them), named in
    ``categories`` (an app's ``Outbox.categories``), or was seen due since: a rule or a panel
    on them has a series from the first scrape, and ``absent()`` says the lag cannot be read.

    The per-key gauges name the ``top_keys`` fairness keys with the most due messages; the
    ``other`` and unkeyed series are there from the first scrape, 0 while none is due.
    """

    def __init__(
        self,
        relay: Relay,
        *,
        lag_interval: float = 5.0,
        intake: Intake | None = None,
        categories: Iterable[str] = (),
        key_interval: float = 30.0,
        top_keys: int = TOP_KEYS,
    ) -> None:
        if isinstance(top_keys, bool) or not isinstance(top_keys, int) or top_keys < 0:
            raise ValueError(f"top_keys must be an int, 0 or more, not {top_keys!r}")
        self.relay = relay
        self.lag_interval = lag_interval
        self.key_interval = key_interval
        self.top_keys = top_keys
        self.registry = CollectorRegistry()
        r = self.registry
        self.messages = Counter(
            "outbox_messages",
            "Message transitions made by this relay, by outcome.",
            ["outcome", "category"],
            registry=r,
        )
        self.claims = Counter(
            "outbox_claims", "Messages claimed under a lease.", ["category"], registry=r
        )
        self.claim_duration = Histogram(
            "outbox_claim_duration_seconds",
            "Seconds one claim transaction took (connection, claim statements, commit).",
            buckets=CLAIM_BUCKETS,
            registry=r,
        )
        self.send_duration = Histogram(
            "outbox_send_duration_seconds",
            "Seconds one provider call took.",
            ["category"],
            buckets=SEND_BUCKETS,
            registry=r,
        )
        Info("outbox_relay", "The relay this process runs.", registry=r).info(
            {
                "relay_id": relay.relay_id,
                "sender": relay.sender.name,
                "version": _package_version(),
            }
        )
        r.register(_StateCollector(self))
        self.lag_errors = 0  # failed reads of outbox_lag
        self._lag_every = _Every()
        self._lag: dict[str, _Due] | None = None  # None: never read, or the last read failed
        self.key_errors = 0  # failed reads of the lag per key
        self._keys_every = _Every()
        self._keys: dict[str, _Due] | None = None  # by key label; None as _lag
        # reported as 0 while none is due; replaced, never changed, as scrapes read it meanwhile
        self._categories = BUILT_IN_CATEGORIES | frozenset(categories)
        self._receivers: list[tuple[NamedSignal, _Receiver]] = []
        for outcome, signal in _OUTCOME_SIGNALS.items():
            self._connect(signal, self._counter(outcome))
        self._connect(signals.claimed, self._on_claimed)
        self._connect(signals.claim_completed, self._on_claim_completed)
        self.reconciled = _reconciled_counter(r)
        self._connect(signals.reconciled, _count_reconciled(self.reconciled))
        self.intake = (
            None
            if intake is None
            else IntakeMetrics(intake, registry=r, reconciled=self.reconciled)
        )

    # -- signals ---------------------------------------------------------------------------

    def _connect(self, signal: NamedSignal, receiver: _Receiver) -> None:
        # Weak references (blinker's default): the receivers live as long as this object.
        signal.connect(receiver, sender=self.relay)
        self._receivers.append((signal, receiver))

    def _counter(self, outcome: str) -> _Receiver:
        def receive(_sender: Any, **kw: Any) -> None:
            category = str(kw.get("category") or "")
            self.messages.labels(outcome=outcome, category=category).inc()
            duration = kw.get("duration")
            if duration is not None:
                self.send_duration.labels(category=category).observe(duration)

        return receive

    def _on_claimed(self, _sender: Any, **kw: Any) -> None:
        self.claims.labels(category=str(kw.get("category") or "")).inc()

    def _on_claim_completed(self, _sender: Any, **kw: Any) -> None:
        self.claim_duration.observe(kw["duration"])

    def close(self) -> None:
        """Stop counting (disconnect from the relay's signals)."""
        for signal, receiver in self._receivers:
            signal.disconnect(receiver, sender=self.relay)
        self._receivers.clear()
        if self.intake is not None:
            self.intake.close()

    # -- lag -------------------------------------------------------------------------------

    def refresh_lag(self) -> None:
        """Read ``outbox_lag`` now, on a short connection from the relay's engine."""
        try:
            with self.relay.engine.connect() as conn:
                rows = store.read_lag(conn)
        except Exception as exc:
            self.lag_errors += 1
            self._lag = None
            _log.warning(
                "cannot read outbox_lag: %s",
                getattr(exc, "orig", None) or exc,
                extra={"action": "metrics_lag_error"},
            )
            return
        finally:
            self._lag_every.read_at = time.monotonic()
        due = {str(r.category): _Due(float(r.due_count), float(r.lag_seconds)) for r in rows}
        self._categories = self._categories | frozenset(due)
        self._lag = due

    def lag(self) -> dict[str, tuple[float, float]] | None:
        """``{category: (due_count, lag_seconds)}``, read again if older than ``lag_interval``;
        None if the last read failed. A scrape that finds another one reading uses the last
        values rather than wait."""
        self._lag_every.run(self.refresh_lag, self.lag_interval)
        due = self._lag
        if due is None:
            return None
        idle = {c: (0.0, 0.0) for c in self._categories}
        return idle | {c: (d.count, d.lag_seconds) for c, d in due.items()}

    def refresh_keys(self) -> None:
        """Read the due messages per fairness key now, on a short connection from the relay's
        engine."""
        try:
            with self.relay.engine.connect() as conn:
                now = read_database_time(conn)
                due = read_due_by_key(conn, now=now, top=self.top_keys)
        except Exception as exc:
            self.key_errors += 1
            self._keys = None
            _log.warning(
                "cannot read the lag per fairness key: %s",
                getattr(exc, "orig", None) or exc,
                extra={"action": "metrics_key_error"},
            )
            return
        finally:
            self._keys_every.read_at = time.monotonic()
        self._keys = _key_series(due, now)

    def keys(self) -> dict[str, tuple[float, float]] | None:
        """``{key label: (due_count, lag_seconds)}`` (:data:`UNKEYED`, the top keys,
        :data:`OTHER_KEYS`), read again if older than ``key_interval``; None if the last read
        failed."""
        self._keys_every.run(self.refresh_keys, self.key_interval)
        keys = self._keys
        if keys is None:
            return None
        return {label: (d.count, d.lag_seconds) for label, d in keys.items()}

    # -- exposition ------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format, without ``*_created`` series."""
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated(Collector):
    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for metric in self._registry.collect():
            created = metric.name + "_created"
            metric.samples = [s for s in metric.samples if s.name != created]
            yield metric


class _StateCollector(Collector):
    """The gauges read from the relay (and the lag view) at scrape time."""

    def __init__(self, metrics: RelayMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        relay = self._metrics.relay
        yield GaugeMetricFamily("outbox_in_flight", "Sends in progress.", value=relay.in_flight)
        yield GaugeMetricFamily(
            "outbox_paused",
            "1 while the provider has sending paused, else 0.",
            value=1.0 if relay.paused else 0.0,
        )
        scoped = GaugeMetricFamily(
            "outbox_scope_paused",
            "1 for each paused configuration set or sending identity (only its mail is held).",
            labels=["kind", "name", "via"],
        )
        for scope in relay.pauses.scopes:  # a copy: the loop thread may pause or resume meanwhile
            if scope.kind is not ScopeKind.ACCOUNT:
                scoped.add_metric([scope.kind.value, scope.name, scope.via], 1.0)
        yield scoped
        limit = GaugeMetricFamily(
            "outbox_send_rate_limit",
            "This relay's current send limit in recipients per second (absent: no limit).",
        )
        rate = relay.limiter.rate
        if rate is not None:
            limit.add_metric([], rate)
        yield limit
        lag = GaugeMetricFamily(
            "outbox_lag_seconds",
            "Age of the oldest message due now, from the outbox_lag view.",
            labels=["category"],
        )
        due = GaugeMetricFamily(
            "outbox_due_messages",
            "Messages due now, from the outbox_lag view.",
            labels=["category"],
        )
        for category, (count, seconds) in sorted((self._metrics.lag() or {}).items()):
            lag.add_metric([category], seconds)
            due.add_metric([category], count)
        yield lag
        yield due
        yield CounterMetricFamily(
            "outbox_lag_refresh_errors",
            "Reads of the outbox_lag view that failed.",
            value=self._metrics.lag_errors,
        )
        key_due = GaugeMetricFamily(
            "outbox_key_due_messages",
            'Messages due now per fairness key: the busiest keys, the rest as key="other", '
            'the unkeyed as key="".',
            labels=["key"],
        )
        key_lag = GaugeMetricFamily(
            "outbox_key_lag_seconds",
            "Age of the oldest message due now per fairness key, as outbox_key_due_messages.",
            labels=["key"],
        )
        for key, (count, seconds) in (self._metrics.keys() or {}).items():
            key_due.add_metric([key], count)
            key_lag.add_metric([key], seconds)
        yield key_due
        yield key_lag
        yield CounterMetricFamily(
            "outbox_key_refresh_errors",
            "Reads of the due messages per fairness key that failed.",
            value=self._metrics.key_errors,
        )


def _reconciled_counter(registry: CollectorRegistry) -> Counter:
    return Counter(
        "outbox_reconciled",
        "Ambiguous sends settled without an operator, by result (sent, requeued).",
        ["result"],
        registry=registry,
    )


def _count_reconciled(counter: Counter) -> _Receiver:
    def receive(_sender: Any, **kw: Any) -> None:
        counter.labels(result=str(kw.get("result") or "")).inc()

    return receive


@dataclass(frozen=True, slots=True)
class _IntakeReading:
    lag_seconds: float | None  # None: no event seen yet
    rates: dict[str, tuple[float, float]]  # category: (bounce rate, complaint rate)


_RATES = sa.text("SELECT category, bounce_rate, complaint_rate FROM outbox_delivery_summary")
_LAG_WINDOW = timedelta(hours=1)  # the newest event is looked for among those received since
# How far after its receipt an event's own time may be and still be believed. An honest event
# happened before the intake received it; its time can only read later by the skew between
# SES's clock and the database's, which NTP keeps well under a second (AWS's within a
# millisecond). A minute leaves room for a database host whose clock drifted, and is the most
# lag a forged timestamp can hide; a time further ahead is forged (or a broken clock) and says
# nothing about how far behind the intake is.
FUTURE_TOLERANCE_SECONDS = 60


def _believable(conn: sa.Connection) -> sa.ColumnElement[bool]:
    """``event_at <= received_at + FUTURE_TOLERANCE_SECONDS``, computed by the database in the
    form it stores timestamps in (SQLite: text, to the millisecond)."""
    e = events.c
    seconds = FUTURE_TOLERANCE_SECONDS
    name = conn.dialect.name
    latest: sa.ColumnElement[Any]
    if name == "postgresql":
        latest = e.received_at + sa.text(f"interval '{seconds} seconds'")
    elif name in ("mysql", "mariadb"):
        latest = sa.func.timestampadd(sa.literal_column("SECOND"), seconds, e.received_at)
    else:
        latest = sa.func.strftime("%Y-%m-%d %H:%M:%f", e.received_at, f"+{seconds} seconds")
    return e.event_at <= latest


def _read_intake(conn: sa.Connection) -> _IntakeReading:
    """The intake's lag and the delivery rates, on ``conn``. The newest event is looked for
    among those received in the last hour (the received_at index), else it is the last one
    received: never a scan of the whole event table. An event whose own time is later than
    its receipt (beyond :data:`FUTURE_TOLERANCE_SECONDS`) is left out: one forged event
    stamped in the future would otherwise read as an intake with no lag, whatever its
    backlog."""
    now = read_database_time(conn)
    e = events.c
    believable = _believable(conn)
    newest = conn.execute(
        sa.select(sa.func.max(e.event_at)).where(e.received_at >= now - _LAG_WINDOW, believable)
    ).scalar()
    if newest is None:
        newest = conn.execute(
            sa.select(e.event_at)
            .where(e.event_at.is_not(None), believable)
            .order_by(e.received_at.desc())
            .limit(1)
        ).scalar()
    lag = None if newest is None else max(0.0, (now - newest).total_seconds())
    rates = {
        str(r.category): (float(r.bounce_rate or 0.0), float(r.complaint_rate or 0.0))
        for r in conn.execute(_RATES)
    }
    return _IntakeReading(lag, rates)


class IntakeMetrics:
    """The metrics of an event intake, on ``registry`` (its own unless given: a relay's, so
    one page serves both; ``reconciled`` is then the relay's counter, which this one also
    counts the intake's ``reconciled`` signals on). :meth:`close` disconnects it."""

    def __init__(
        self,
        intake: Intake,
        *,
        registry: CollectorRegistry | None = None,
        reconciled: Counter | None = None,
        summary_interval: float = 30.0,
    ) -> None:
        self.intake = intake
        self.summary_interval = summary_interval
        self.registry = registry if registry is not None else CollectorRegistry()
        self.reconciled = (
            reconciled if reconciled is not None else _reconciled_counter(self.registry)
        )
        self._receiver = _count_reconciled(self.reconciled)
        signals.reconciled.connect(self._receiver, sender=intake)
        self.read_errors = 0
        self._lock = threading.Lock()
        self._reading: _IntakeReading | None = None
        self._read_at = -float("inf")
        self.registry.register(_IntakeCollector(self))

    def close(self) -> None:
        signals.reconciled.disconnect(self._receiver, sender=self.intake)

    def refresh(self) -> None:
        """Read the lag and the rates now, on a short connection of the intake's engine."""
        try:
            with self.intake.engine.connect() as conn:
                reading = _read_intake(conn)
        except Exception as exc:
            self.read_errors += 1
            self._reading = None
            _log.warning(
                "cannot read the event intake's views: %s",
                getattr(exc, "orig", None) or exc,
                extra={"action": "metrics_intake_error"},
            )
            return
        finally:
            self._read_at = time.monotonic()
        self._reading = reading

    def reading(self) -> _IntakeReading | None:
        """The last reading, taken again if older than ``summary_interval`` (a scrape that
        finds another one reading uses the last one); None if the last read failed."""
        if time.monotonic() - self._read_at >= self.summary_interval and self._lock.acquire(
            blocking=False
        ):
            try:
                if time.monotonic() - self._read_at >= self.summary_interval:
                    self.refresh()
            finally:
                self._lock.release()
        return self._reading

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format, without ``*_created`` series."""
        return generate_latest(_WithoutCreated(self.registry))


class _IntakeCollector(Collector):
    def __init__(self, metrics: IntakeMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        intake = self._metrics.intake
        counted = CounterMetricFamily(
            "outbox_events",
            "Events taken from the queue, by type and effect.",
            labels=["type", "effect"],
        )
        for (kind, effect), n in sorted(intake.counts.items()):
            counted.add_metric([kind, effect], n)
        yield counted
        errors = CounterMetricFamily(
            "outbox_event_intake_errors",
            "Failed intake passes and deletes, by kind (sqs, database).",
            labels=["kind"],
        )
        for kind in ("sqs", "database"):
            errors.add_metric([kind], intake.errors[kind])
        yield errors
        reading = self._metrics.reading()
        lag = GaugeMetricFamily(
            "outbox_event_intake_lag_seconds",
            "The database's now minus the newest event's own time (absent: no event yet).",
        )
        bounce = GaugeMetricFamily(
            "outbox_bounce_rate",
            "Bounced over sent in the last 24 h, from outbox_delivery_summary.",
            labels=["category"],
        )
        complaint = GaugeMetricFamily(
            "outbox_complaint_rate",
            "Complained over sent in the last 24 h, from outbox_delivery_summary.",
            labels=["category"],
        )
        if reading is not None:
            if reading.lag_seconds is not None:
                lag.add_metric([], reading.lag_seconds)
            for category, (bounces, complaints) in sorted(reading.rates.items()):
                bounce.add_metric([category], bounces)
                complaint.add_metric([category], complaints)
        yield lag
        yield bounce
        yield complaint
        yield CounterMetricFamily(
            "outbox_event_read_errors",
            "Reads of the intake's views that failed.",
            value=self._metrics.read_errors,
        )
