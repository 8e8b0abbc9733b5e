"""The event intake: SES events from an SQS queue, applied to the outbox in one transaction per
batch, deleted from the queue only once their effect committed.

- :mod:`relay.intake.apply`: :func:`apply_events`, what one event does to its row (matching,
  resolve, delivery status, suppressions), and which events are ours (:func:`foreign_origin`).
- :mod:`relay.intake.deferred`: :func:`apply_deferred`, the events that came while their row
  was being sent, applied once it is not.
- :mod:`relay.intake.outcome`: :class:`Applied`, its log line and its signals (:func:`announce`).
- :mod:`relay.intake.loop`: :class:`Intake`, the SQS loop of one replica and its heartbeat.
- :mod:`relay.intake.queue`: the SQS calls (:func:`build_client`, :class:`QueueInfo`).
- :mod:`relay.store.events`: the statements, on ``outbox_events``, ``outbox_suppressions``,
  ``outbox_intakes`` and the rows events match.
"""

from relay.intake.apply import (
    ACTOR,
    apply_events,
    check_topic_arn,
    foreign_origin,
    recipients_of,
)
from relay.intake.deferred import DEFERRED_BATCH, apply_deferred
from relay.intake.loop import (
    COUNT_INTERVAL,
    COUNT_LAG,
    DEFERRED_INTERVAL,
    MAX_MESSAGES,
    Intake,
    default_intake_id,
)
from relay.intake.outcome import Applied, announce
from relay.intake.queue import QueueInfo, build_client
from relay.store.events import (
    Effect,
    find_by_provider_id,
    find_by_tags,
    insert_event,
    raise_delivery_status,
    record_intake,
    record_reconciled_attempt,
    resolve_sent,
    set_event_effect,
    suppress_addresses,
)

__all__ = [
    "ACTOR",
    "COUNT_INTERVAL",
    "COUNT_LAG",
    "DEFERRED_BATCH",
    "DEFERRED_INTERVAL",
    "MAX_MESSAGES",
    "Applied",
    "Effect",
    "Intake",
    "QueueInfo",
    "announce",
    "apply_deferred",
    "apply_events",
    "build_client",
    "check_topic_arn",
    "default_intake_id",
    "find_by_provider_id",
    "find_by_tags",
    "foreign_origin",
    "insert_event",
    "raise_delivery_status",
    "recipients_of",
    "record_intake",
    "record_reconciled_attempt",
    "resolve_sent",
    "set_event_effect",
    "suppress_addresses",
]
