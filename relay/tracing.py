"""OpenTelemetry on the relay side: a span per send attempt, linked to its enqueue, and a span
per saved batch.

With the ``otel`` extra installed, each attempt runs in a CONSUMER span ``outbox process``,
begun and ended on its send thread around the provider call (an instrumented HTTP client's
spans nest under it). It is a root span with a link to the trace context the enqueue stored
in the row (:data:`outbox.message.TRACE_KEY`), so every attempt of a message, retries days
later included, points at the same enqueue. Its attributes name the message, the attempt and
its outcome; a transient, permanent or ambiguous outcome sets its status to ERROR. Each batch
of finished sends the loop saves runs in one CLIENT span ``outbox settle``, linked to the
process spans of the attempts it saves. Without OpenTelemetry nothing here runs: the worker
builds no :class:`Attempt` and :func:`settles` returns the save unchanged. Anything
OpenTelemetry raises is logged once and swallowed: tracing never fails a send or a save.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from contextvars import Token
from typing import Any, ParamSpec, Protocol, TypeVar, cast

from outbox.message import TRACE_KEY
from relay.senders import Accepted, Disabled, Outcome, OutgoingMessage

__all__ = ["ENABLED", "Attempt", "Carrier", "settles", "stored", "use_tracer_provider"]

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


def use_tracer_provider(provider: Any) -> None:
    """Trace through ``provider`` (an OpenTelemetry ``TracerProvider``) instead of the global
    one; ``None`` goes back to the global one. For tests, and relays embedded in a process
    that keeps its provider out of the global."""
    global _tracer
    if ENABLED:
        _tracer = trace.get_tracer(__name__, tracer_provider=provider)


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


class Attempt:
    """One send attempt's ``outbox process`` span. Made on the loop thread; :meth:`run` wraps
    the send, which begins and ends the span on the send thread; ``context`` is then the
    span's, for the ``outbox settle`` span that saves the attempt to link to."""

    __slots__ = ("carrier", "context", "message")

    def __init__(self, message: OutgoingMessage, carrier: Carrier | None) -> None:
        self.message = message
        self.carrier = carrier
        self.context: trace.SpanContext | None = None

    def run(self, send: Callable[_P, tuple[Outcome, float]]) -> Callable[_P, tuple[Outcome, float]]:
        """``send`` (which returns the outcome and the call's seconds) inside the span."""

        def traced(*args: _P.args, **kwargs: _P.kwargs) -> tuple[Outcome, float]:
            begun = self._begin()
            try:
                result = send(*args, **kwargs)
            except BaseException as exc:
                self._end(begun, None, exc)
                raise
            self._end(begun, result[0], None)
            return result

        return traced

    def _begin(self) -> tuple[trace.Span, Token[otel_context.Context]] | None:
        try:
            links = []
            if self.carrier is not None:
                enqueued = trace.get_current_span(_PROPAGATOR.extract(self.carrier))
                if (linked := enqueued.get_span_context()).is_valid:
                    links.append(trace.Link(linked))
            message = self.message
            span = _tracer.start_span(
                "outbox process",
                context=_root(),
                kind=trace.SpanKind.CONSUMER,
                links=links,
                attributes={
                    "messaging.system": "outbox",
                    "messaging.operation.type": "process",
                    "messaging.operation.name": "process",
                    "messaging.destination.name": message.category,
                    "messaging.message.id": str(message.id),
                    "outbox.category": message.category,
                    "outbox.attempt": message.attempt,
                },
            )
            self.context = span.get_span_context()
            return span, otel_context.attach(trace.set_span_in_context(span))
        except Exception:
            _failed()
            return None

    def _end(
        self,
        begun: tuple[trace.Span, Token[otel_context.Context]] | None,
        outcome: Outcome | None,
        exc: BaseException | None,
    ) -> None:
        if begun is None:
            return
        span, token = begun
        try:
            otel_context.detach(token)
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
            span.end()
        except Exception:
            _failed()


class _Saved(Protocol):
    """A finished send as the loop saves it: its attempt's span, if it has one."""

    @property
    def trace(self) -> Attempt | None: ...


def settles(save: _Save) -> _Save:
    """Decorate ``save(relay, conn, batch, ...)`` (returning, per item of ``batch``, whether
    it applied) to run in one ``outbox settle`` span linked to the batch's attempts; ``save``
    itself when tracing is off."""
    if not ENABLED:
        return save

    @functools.wraps(save)
    def traced(relay: Any, conn: Any, batch: Sequence[_Saved], *args: Any, **kw: Any) -> list[bool]:
        if not batch:
            return save(relay, conn, batch, *args, **kw)
        begun = _begin_settle(batch)
        try:
            applied: list[bool] = save(relay, conn, batch, *args, **kw)
        except BaseException as exc:
            _end_settle(begun, None, exc)
            raise
        _end_settle(begun, applied, None)
        return applied

    return cast(_Save, traced)


def _begin_settle(
    batch: Sequence[_Saved],
) -> tuple[trace.Span, Token[otel_context.Context]] | None:
    try:
        links = [
            trace.Link(attempt.context, {"messaging.message.id": str(attempt.message.id)})
            for done in batch
            if (attempt := done.trace) is not None
            and attempt.context is not None
            and attempt.context.is_valid
        ]
        span = _tracer.start_span(
            "outbox settle",
            context=_root(),
            kind=trace.SpanKind.CLIENT,
            links=links,
            attributes={
                "messaging.system": "outbox",
                "messaging.operation.type": "settle",
                "messaging.operation.name": "settle",
                "messaging.batch.message_count": len(batch),
            },
        )
        return span, otel_context.attach(trace.set_span_in_context(span))
    except Exception:
        _failed()
        return None


def _end_settle(
    begun: tuple[trace.Span, Token[otel_context.Context]] | None,
    applied: list[bool] | None,
    exc: BaseException | None,
) -> None:
    if begun is None:
        return
    span, token = begun
    try:
        otel_context.detach(token)
        if applied is not None and span.is_recording():
            # the rest were no longer this relay's claim: recorded as stale attempts
            span.set_attribute("outbox.applied", sum(applied))
        if exc is not None:
            span.record_exception(exc)
            span.set_status(trace.StatusCode.ERROR, type(exc).__name__)
        span.end()
    except Exception:
        _failed()
