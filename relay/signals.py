"""Blinker signals sent by the relay on every transition.

Receivers get the :class:`~relay.worker.Relay` as sender and keyword arguments
``message_id``, ``category`` and, where they apply, ``code`` and ``provider_message_id``.
They fire after the transition committed, from the relay's main thread.

The signals sent when a send or sweep is finalized (``sent``, ``retry_scheduled``, ``failed``,
``unknown_outcome``, ``released``, ``stale_finalize``) also carry ``outcome``: what the attempt
found, an :class:`~outbox.AttemptOutcome` (``accepted``, ``transient``, ``permanent``,
``ambiguous``, ``disabled``, ``invalid_payload``, ``lease_expired`` for the sweep; never a
``stale:`` form, ``stale_finalize`` says that), or None for a claim given back unstarted; and
``duration`` (seconds the provider call took; None when there was no call). Receivers should
accept ``**kwargs``: more may be added.

The event intake's signals (``delivered``, ``bounced``, ``complained``) fire after the event's
effect committed, with ``message_id``, ``category``, ``provider_message_id``, ``recipients``
(the addresses the event names) and ``event_at`` (SES's time); ``bounced`` also carries
``bounce_type`` and ``bounce_subtype``, ``complained`` ``feedback_type``. The sender of these is
the intake. ``reconciled`` fires when an ambiguous send was settled without an operator:
``result`` is ``"sent"`` (a provider event proved SES took it; ``provider_message_id`` given) or
``"requeued"`` (the intake flowed past the window with no event for it).
"""

from __future__ import annotations

from blinker import Namespace

__all__ = [
    "bounced",
    "claim_completed",
    "claimed",
    "complained",
    "delivered",
    "expired",
    "failed",
    "reconciled",
    "released",
    "retry_scheduled",
    "save_failed",
    "sent",
    "stale_finalize",
    "unknown_outcome",
]

_signals = Namespace()

claimed = _signals.signal("relay.claimed", doc="A message was claimed under a lease.")
claim_completed = _signals.signal(
    "relay.claim_completed",
    doc="A claim transaction committed: ``duration`` (seconds), ``count`` (messages claimed), "
    "``expired`` (due messages it found past expires_at).",
)
sent = _signals.signal("relay.sent", doc="The provider accepted a message.")
retry_scheduled = _signals.signal("relay.retry_scheduled", doc="A retry was scheduled.")
failed = _signals.signal("relay.failed", doc="A message failed for good.")
unknown_outcome = _signals.signal(
    "relay.unknown_outcome", doc="A send may or may not have happened; parked for an operator."
)
released = _signals.signal("relay.released", doc="A claim was given back, no attempt counted.")
expired = _signals.signal("relay.expired", doc="A message passed its expires_at unsent.")
save_failed = _signals.signal(
    "relay.save_failed",
    doc="A finished send could not be saved (its row was deleted or changed under it): set "
    "aside and logged with its outcome and ``provider_message_id``; the relay goes on.",
)
stale_finalize = _signals.signal(
    "relay.stale_finalize", doc="A finalize found its claim gone; the attempt was recorded."
)
delivered = _signals.signal("relay.delivered", doc="SES reported a message delivered.")
bounced = _signals.signal("relay.bounced", doc="SES reported a bounce for a message.")
complained = _signals.signal("relay.complained", doc="A recipient complained about a message.")
reconciled = _signals.signal(
    "relay.reconciled",
    doc="An ambiguous send was settled without an operator: ``result`` is sent or requeued.",
)
