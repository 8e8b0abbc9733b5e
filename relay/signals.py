"""Blinker signals sent by the relay on every transition.

Receivers get the :class:`~relay.worker.Relay` as sender and keyword arguments
``message_id``, ``category`` and, where they apply, ``code`` and ``provider_message_id``.
They fire after the transition committed, from the relay's main thread.
"""

from __future__ import annotations

from blinker import Namespace

__all__ = [
    "claimed",
    "expired",
    "failed",
    "released",
    "retry_scheduled",
    "sent",
    "stale_finalize",
    "unknown_outcome",
]

_signals = Namespace()

claimed = _signals.signal("relay.claimed", doc="A message was claimed under a lease.")
sent = _signals.signal("relay.sent", doc="The provider accepted a message.")
retry_scheduled = _signals.signal("relay.retry_scheduled", doc="A retry was scheduled.")
failed = _signals.signal("relay.failed", doc="A message failed for good.")
unknown_outcome = _signals.signal(
    "relay.unknown_outcome", doc="A send may or may not have happened; parked for an operator."
)
released = _signals.signal("relay.released", doc="A claim was given back, no attempt counted.")
expired = _signals.signal("relay.expired", doc="A message passed its expires_at unsent.")
stale_finalize = _signals.signal(
    "relay.stale_finalize", doc="A finalize found its claim gone; the attempt was recorded."
)
