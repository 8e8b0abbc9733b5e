"""Blinker signals sent by the app side of the outbox.

Receivers get the :class:`~outbox.Outbox` as sender and keyword arguments ``result``
(:class:`~outbox.EnqueueResult`) and ``category``. Both fire inside the caller's transaction,
before it commits: a rollback afterwards undoes the enqueue but not the signal.
"""

from __future__ import annotations

from blinker import Namespace

__all__ = ["duplicate_skipped", "enqueued"]

_signals = Namespace()

enqueued = _signals.signal("outbox.enqueued", doc="A new outbox row was written.")
duplicate_skipped = _signals.signal(
    "outbox.duplicate_skipped", doc="The idempotency key existed; nothing was written."
)
