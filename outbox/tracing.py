"""OpenTelemetry on the app side: each enqueue's trace context, stored in its rows.

With the ``otel`` extra installed and a valid span current in the caller (a request's span),
each batch ``enqueue`` writes runs in a short PRODUCER span ``outbox create``, and that span's
W3C trace context (``traceparent``, ``tracestate``) is stored in each row's payload under
:data:`outbox.message.TRACE_KEY`; the relay links its ``outbox process`` spans to it
(:mod:`relay.tracing`). Without OpenTelemetry, or with no span current, nothing is done and
nothing is stored. Anything OpenTelemetry raises is logged once and swallowed: tracing never
fails an enqueue. Why the context goes in the payload, and in this form: docs/design.md,
"Decisions".
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from contextvars import Token
from types import TracebackType
from typing import Any

from outbox.message import TRACE_KEY

__all__ = ["ENABLED", "creating", "use_tracer_provider"]

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the otel extra is not installed: tracing is off, at no cost
    ENABLED = False
else:
    ENABLED = True
    # W3C trace context only, whatever OTEL_PROPAGATORS says: what is stored is part of the
    # payload format, and baggage (the app's key-values) does not belong in a stored row
    _PROPAGATOR = TraceContextTextMapPropagator()
    _tracer: trace.Tracer = trace.get_tracer(__name__)

_log = logging.getLogger("outbox")
_warned = False

_Written = Callable[[Sequence[tuple[int, bool]]], None]


def use_tracer_provider(provider: Any) -> None:
    """Trace through ``provider`` (an OpenTelemetry ``TracerProvider``) instead of the global
    one; ``None`` goes back to the global one. For tests, and apps that keep their provider out
    of the global."""
    global _tracer
    if ENABLED:
        _tracer = trace.get_tracer(__name__, tracer_provider=provider)


def creating(rows: Sequence[dict[str, Any]]) -> _Off | _Create:
    """A context for writing ``rows`` (built by :func:`outbox.enqueue.build_row`): entering
    it starts the ``outbox create`` span and stores its context in each row's payload, and
    gives a function to call with what the write returned. Does nothing when tracing is off
    or no span is current."""
    if not ENABLED or not rows:
        return _OFF
    return _Create(rows)


def _failed() -> None:
    """Log what OpenTelemetry raised: the first time as a warning, then at debug level."""
    global _warned
    level = logging.DEBUG if _warned else logging.WARNING
    _warned = True
    _log.log(
        level,
        "tracing failed; the enqueue goes on without it",
        exc_info=True,
        extra={"action": "tracing_failed"},
    )


def _nothing(written: Sequence[tuple[int, bool]]) -> None:
    pass


class _Off:
    """Tracing off: nothing to do."""

    __slots__ = ()

    def __enter__(self) -> _Written:
        return _nothing

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


_OFF = _Off()


# W3C trace context: a version-00 traceparent, and a tracestate kept only when short and
# printable ASCII (it comes from the caller's request headers, so from anyone; W3C lets it be
# cut). Bounded, it fits the room each row's size estimate leaves (outbox.enqueue).
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_TRACESTATE = re.compile(r"[ -~]{1,512}")


def _bounded(carrier: dict[str, str]) -> dict[str, str]:
    """What of ``carrier`` is stored: nothing without a well-formed ``traceparent``."""
    parent = carrier.get("traceparent", "")
    if not _TRACEPARENT.fullmatch(parent):
        return {}
    state = carrier.get("tracestate", "")
    if state and _TRACESTATE.fullmatch(state) and '"' not in state and "\\" not in state:
        return {"traceparent": parent, "tracestate": state}
    return {"traceparent": parent}


class _Create:
    """The ``outbox create`` span of one batch, current while the batch is written."""

    __slots__ = ("_rows", "_span", "_token")

    def __init__(self, rows: Sequence[dict[str, Any]]) -> None:
        self._rows = rows
        self._span: trace.Span | None = None
        self._token: Token[otel_context.Context] | None = None

    def __enter__(self) -> _Written:
        try:
            self._start()
        except Exception:
            _failed()
        return self._written

    def _start(self) -> None:
        if not trace.get_current_span().get_span_context().is_valid:
            return
        attributes: dict[str, str | int] = {
            "messaging.system": "outbox",
            "messaging.operation.type": "create",
            "messaging.operation.name": "create",
        }
        categories = {row["category"] for row in self._rows}
        if len(categories) == 1:
            attributes["messaging.destination.name"] = categories.pop()
        if len(self._rows) != 1:
            attributes["messaging.batch.message_count"] = len(self._rows)
        span = _tracer.start_span(
            "outbox create", kind=trace.SpanKind.PRODUCER, attributes=attributes
        )
        self._span = span
        current = trace.set_span_in_context(span)
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=current)
        if stored := _bounded(carrier):
            for row in self._rows:
                row["payload"][TRACE_KEY] = dict(stored)
        self._token = otel_context.attach(current)

    def _written(self, written: Sequence[tuple[int, bool]]) -> None:
        """Name the message the span created (one row: its id, and whether it was a
        duplicate)."""
        span = self._span
        if span is None or len(written) != 1:
            return
        try:
            if span.is_recording():
                span.set_attribute("messaging.message.id", str(written[0][0]))
                span.set_attribute("outbox.duplicate", written[0][1])
        except Exception:
            _failed()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        span = self._span
        if span is None:
            return
        try:
            if self._token is not None:
                otel_context.detach(self._token)
            if exc is not None:
                span.record_exception(exc)
                span.set_status(trace.StatusCode.ERROR, type(exc).__name__)
            span.end()
        except Exception:
            _failed()
