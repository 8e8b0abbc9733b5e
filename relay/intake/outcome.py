"""What one event did (:class:`Applied`), its log line, and the signals the intake sends for
it once its batch committed."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from outbox.schema import EventType
from relay import signals
from relay.events import SesEvent
from relay.store.events import Effect

__all__ = ["Applied", "announce", "log_applied"]

_log = logging.getLogger("relay.intake")

_KEPT = frozenset({Effect.MALFORMED, Effect.REFUSED})  # left on the queue
# no signal: nothing changed, or not yet (a deferred event is announced once it is applied)
_SILENT = frozenset({Effect.DUPLICATE, Effect.REFUSED, Effect.DEFERRED})


@dataclass(frozen=True, kw_only=True, slots=True)
class Applied:
    """One event's result: its ``effect``, its ``outbox_events`` id (None: not stored), the
    row it was matched to and that row's category, whether it resolved the row to sent, and
    the addresses it newly suppressed."""

    event: SesEvent
    effect: Effect
    event_id: int | None = None
    message_id: int | None = None
    category: str | None = None
    resolved: bool = False
    suppressed: tuple[str, ...] = ()

    @property
    def delete(self) -> bool:
        """Whether its queue message may be deleted: everything but a malformed one (also a
        redelivered one: SQS must count its receives) and one the database refused."""
        if self.effect is Effect.DUPLICATE:
            return self.event.type is not EventType.MALFORMED
        return self.effect not in _KEPT


def log_applied(applied: Applied) -> None:
    """The log line of what ``applied`` did, and one per address it suppressed."""
    event = applied.event
    extra = {
        "action": f"event_{applied.effect.value}",
        "message_id": applied.message_id,
        "event_type": event.type.value,
        "provider_message_id": event.provider_message_id,
    }
    if applied.effect is Effect.DUPLICATE_SEND:
        _log.warning("two sends of this message reached SES", extra=extra)
    elif applied.effect is Effect.MALFORMED:
        _log.warning(
            "not an SES event (%s); left on the queue for its dead-letter queue",
            event.error,
            extra={**extra, "event_key": event.key},
        )
    elif applied.effect is Effect.RESOLVED:
        _log.info("an event proved SES took the send: sent", extra=extra)
    elif applied.effect is Effect.UNMATCHED:
        _log.info("no message of ours: recorded", extra=extra)
    elif applied.effect is Effect.FOREIGN:
        _log.warning(
            "not from the configured topic (%s %s): recorded, applied to no message",
            event.source,
            event.origin or "without an origin",
            extra={**extra, "origin": event.origin},
        )
    elif applied.effect is Effect.DEFERRED:
        _log.info(
            "the message is being sent: event deferred until its relay saved the send",
            extra=extra,
        )
    elif applied.effect is Effect.RECORDED and applied.message_id is not None:
        _log.debug("recorded", extra=extra)
    for address in applied.suppressed:
        _log.info(
            "address suppressed",
            extra={"action": "suppressed", "message_id": applied.message_id, "to": address},
        )


def announce(sender: object, batch: Iterable[Applied]) -> None:
    """Send the intake's signals for ``batch`` (after it committed), from ``sender``: a
    receiver that raises is logged, the others still hear."""
    for applied in batch:
        if applied.message_id is None or applied.effect in _SILENT:
            continue
        event = applied.event
        common = {
            "message_id": applied.message_id,
            "category": applied.category,
            "provider_message_id": event.provider_message_id,
        }
        if applied.resolved:
            _send(signals.reconciled, sender, result="sent", **common)
        detail = {**common, "recipients": event.recipients, "event_at": event.event_at}
        if event.type is EventType.DELIVERY:
            _send(signals.delivered, sender, **detail)
        elif event.type is EventType.BOUNCE:
            kind, _, sub = (event.detail or "").partition("/")
            _send(
                signals.bounced,
                sender,
                bounce_type=kind or None,
                bounce_subtype=sub or None,
                **detail,
            )
        elif event.type is EventType.COMPLAINT:
            _send(signals.complained, sender, feedback_type=event.detail, **detail)


def _send(signal: Any, sender: object, **kw: Any) -> None:
    try:
        signal.send(sender, **kw)
    except Exception:
        _log.exception("a receiver of %s failed", signal.name, extra={"action": "signal_error"})
