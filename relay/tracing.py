"""OpenTelemetry on the relay side: a span per send attempt, linked to its enqueue, and a span
per saved batch.

With the ``otel`` extra installed, each attempt is a CONSUMER span ``outbox process``, a root
span with a link to the trace context the enqueue stored in the row
(:data:`outbox.message.TRACE_KEY`), so every attempt of a message, retries days later
included, points at the same enqueue. Its attributes name the message, the attempt and its
outcome; a transient, permanent or ambiguous outcome sets its status to ERROR. Each batch of
finished sends the loop saves is one CLIENT span ``outbox settle``, linked to the process spans
of the attempts it saves.

No OpenTelemetry code runs on a send thread or the loop: they note the times and the outcome,
and one telemetry thread makes the spans afterwards, with those times, from a bounded queue
(full: a span is dropped, logged once). A span processor or exporter that blocks (a stalled
stdout, an unreachable collector) would otherwise hold an answered send past its lease, to be
swept as ambiguous and sent again, or hold the loop's transaction open. The price: spans of an
instrumented HTTP client are not children of ``outbox process``. Without OpenTelemetry nothing
here runs: the worker builds no :class:`Attempt` and :func:`settles` returns the save
unchanged. Anything OpenTelemetry raises is logged once and swallowed.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ParamSpec, Protocol, TypeVar, cast

from outbox.message import TRACE_KEY
from relay.senders import Accepted, Disabled, Outcome, OutgoingMessage

__all__ = [
    "ENABLED",
    "Attempt",
    "Carrier",
    "flush",
    "recording",
    "settles",
    "stored",
    "use_tracer_provider",
]

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the otel extra is not installed: tracing is off, at no cost
    ENABLED = False
else:
    ENABLED = True
    _PROPAGATOR = TraceContextTextMapPropagator()
    _tracer: trace.Tracer = trace.get_tracer(__name__)

Carrier = dict[str, str]
"""A stored trace context: ``traceparent`` and, if any, ``tracestate``."""

_P = ParamSpec("_P")
_Save = TypeVar("_Save", bound=Callable[..., list[bool]])
_FIELDS = ("traceparent", "tracestate")
_log = logging.getLogger("relay")
_warned = False
_own_provider = False  # use_tracer_provider gave one
_QUEUE = 10_000  # spans waiting for the telemetry thread; past it they are dropped


def use_tracer_provider(provider: Any) -> None:
    """Trace through ``provider`` (an OpenTelemetry ``TracerProvider``) instead of the global
    one; ``None`` goes back to the global one. For tests, and relays embedded in a process
    that keeps its provider out of the global."""
    global _tracer, _own_provider
    if ENABLED:
        _tracer = trace.get_tracer(__name__, tracer_provider=provider)
        _own_provider = provider is not None


def recording() -> bool:
    """Whether the relay's spans go anywhere: OpenTelemetry is installed and a provider is
    set, globally or by :func:`use_tracer_provider`. Asked at each wave and save: with no
    provider every span would be a no-op, yet making one costs about 15 microseconds of CPU
    a send (some 7% of the relay's, in the drain benchmark); a provider set later is picked
    up by the next wave."""
    if not ENABLED:
        return False
    if _own_provider:
        return True
    try:
        provider = trace.get_tracer_provider()
    except Exception:  # a provider named in the environment that cannot be loaded
        _failed()
        return False
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def stored(payload: Mapping[str, Any]) -> Carrier | None:
    """The trace context the enqueue stored in ``payload``; None if there is none, tracing is
    off, or what is there is not one (never raises: it does not concern the email)."""
    if not ENABLED:
        return None
    found = payload.get(TRACE_KEY)
    if not isinstance(found, dict):
        return None
    carrier = {k: v for k in _FIELDS if isinstance(v := found.get(k), str)}
    return carrier if "traceparent" in carrier else None


def _failed() -> None:
    """Log what OpenTelemetry raised: the first time as a warning, then at debug level."""
    global _warned
    level = logging.DEBUG if _warned else logging.WARNING
    _warned = True
    _log.log(
        level,
        "tracing failed; the relay goes on without it",
        exc_info=True,
        extra={"action": "tracing_failed"},
    )


def _root() -> otel_context.Context:
    return otel_context.Context()


class _Telemetry:
    """One daemon thread that makes the spans, from a bounded queue, started on first use."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None]] = queue.Queue(maxsize=_QUEUE)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._dropped = False

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job``; never raises (it runs on send threads and in the loop's
        transaction, after the provider answered: a span must not cost that answer)."""
        try:
            self._submit(job)
        except Exception:
            _failed()

    def _submit(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="outbox-telemetry", daemon=True
                    )
                    self._thread.start()
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            if not self._dropped:
                self._dropped = True
                _log.warning(
                    "tracing falls behind: spans are dropped",
                    extra={"action": "tracing_dropped"},
                )

    def flush(self, timeout: float) -> bool:
        """Wait until what was submitted before is done; False past ``timeout``."""
        if self._thread is None:
            return True
        done = threading.Event()
        try:
            self._jobs.put(done.set, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:
                _failed()


_telemetry = _Telemetry()


def flush(timeout: float = 5.0) -> bool:
    """Wait until the spans of every attempt and save that ended before are made (handed to
    the SDK's processors); False if that took longer than ``timeout`` seconds."""
    return _telemetry.flush(timeout)


class Attempt:
    """One send attempt's ``outbox process`` span. Made on the loop thread; :meth:`run` wraps
    the send, noting its times and outcome for the telemetry thread, which makes the span;
    ``context`` is then the span's, for the ``outbox settle`` span of its save to link to."""

    __slots__ = ("attempt", "carrier", "category", "context", "id")

    def __init__(self, message: OutgoingMessage, carrier: Carrier | None) -> None:
        # the few values the span names, not the message: a queue of spans waiting for a
        # stalled exporter must not hold thousands of emails and their attachments
        self.id = message.id
        self.category = message.category
        self.attempt = message.attempt
        self.carrier = carrier
        self.context: trace.SpanContext | None = None

    def run(self, send: Callable[_P, tuple[Outcome, float]]) -> Callable[_P, tuple[Outcome, float]]:
        """``send`` (which returns the outcome and the call's seconds), timed for the span."""

        def traced(*args: _P.args, **kwargs: _P.kwargs) -> tuple[Outcome, float]:
            began = time.time_ns()
            try:
                result = send(*args, **kwargs)
            except BaseException as exc:
                ended = time.time_ns()
                _telemetry.submit(functools.partial(self._emit, began, ended, None, exc))
                raise
            ended = time.time_ns()
            _telemetry.submit(functools.partial(self._emit, began, ended, result[0], None))
            return result

        return traced

    def _emit(
        self, began: int, ended: int, outcome: Outcome | None, exc: BaseException | None
    ) -> None:
        links = []
        if self.carrier is not None:
            enqueued = trace.get_current_span(_PROPAGATOR.extract(self.carrier))
            if (linked := enqueued.get_span_context()).is_valid:
                links.append(trace.Link(linked))
        span = _tracer.start_span(
            "outbox process",
            context=_root(),
            kind=trace.SpanKind.CONSUMER,
            links=links,
            start_time=began,
            attributes={
                "messaging.system": "outbox",
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "messaging.destination.name": self.category,
                "messaging.message.id": str(self.id),
                "outbox.category": self.category,
                "outbox.attempt": self.attempt,
            },
        )
        self.context = span.get_span_context()
        try:
            if outcome is not None and span.is_recording():
                span.set_attribute("outbox.outcome", type(outcome).__name__.lower())
                if isinstance(outcome, Accepted):
                    if (provider_id := outcome.provider_message_id) is not None:
                        span.set_attribute("outbox.provider_message_id", provider_id)
                else:
                    span.set_attribute("outbox.error_code", outcome.code)
                    if not isinstance(outcome, Disabled):  # given back unsent: no failure
                        span.set_attribute("error.type", outcome.code)
                        span.set_status(trace.StatusCode.ERROR, outcome.code)
            if exc is not None:
                span.record_exception(exc)
                span.set_status(trace.StatusCode.ERROR, type(exc).__name__)
        finally:
            span.end(end_time=ended)


class _Saved(Protocol):
    """A finished send as the loop saves it: its attempt's span, if it has one."""

    @property
    def trace(self) -> Attempt | None: ...


def settles(save: _Save) -> _Save:
    """Decorate ``save(relay, conn, batch, ...)`` (returning, per item of ``batch``, whether
    it applied) so that one ``outbox settle`` span, linked to the batch's attempts, is made
    for it afterwards on the telemetry thread; ``save`` itself when tracing is off."""
    if not ENABLED:
        return save

    @functools.wraps(save)
    def traced(relay: Any, conn: Any, batch: Sequence[_Saved], *args: Any, **kw: Any) -> list[bool]:
        if not batch or not recording():
            return save(relay, conn, batch, *args, **kw)
        attempts = [done.trace for done in batch]
        began = time.time_ns()
        try:
            applied: list[bool] = save(relay, conn, batch, *args, **kw)
        except BaseException as exc:
            ended = time.time_ns()
            _telemetry.submit(functools.partial(_emit_settle, attempts, began, ended, None, exc))
            raise
        ended = time.time_ns()
        _telemetry.submit(functools.partial(_emit_settle, attempts, began, ended, applied, None))
        return applied

    return cast(_Save, traced)


def _emit_settle(
    attempts: list[Attempt | None],
    began: int,
    ended: int,
    applied: list[bool] | None,
    exc: BaseException | None,
) -> None:
    links = [  # the attempts' spans were made before: they were queued first
        trace.Link(attempt.context, {"messaging.message.id": str(attempt.id)})
        for attempt in attempts
        if attempt is not None and attempt.context is not None and attempt.context.is_valid
    ]
    span = _tracer.start_span(
        "outbox settle",
        context=_root(),
        kind=trace.SpanKind.CLIENT,
        links=links,
        start_time=began,
        attributes={
            "messaging.system": "outbox",
            "messaging.operation.type": "settle",
            "messaging.operation.name": "settle",
            "messaging.batch.message_count": len(attempts),
        },
    )
    try:
        if applied is not None and span.is_recording():
            # the rest were no longer this relay's claim: recorded as stale attempts
            span.set_attribute("outbox.applied", sum(applied))
        if exc is not None:
            span.record_exception(exc)
            span.set_status(trace.StatusCode.ERROR, type(exc).__name__)
    finally:
        span.end(end_time=ended)
