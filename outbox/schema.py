"""The outbox tables, their indexes, and the enums of the values they store: the one place
statuses (``Status``), relay states (``RelayState``) and attempt outcomes (``AttemptOutcome``)
are defined.

The tables live on their own :data:`metadata` so they never mix with the host app's declarative
base. Host apps create them through the bundled alembic migrations (see
:mod:`outbox.migrations`), never through ``metadata.create_all`` in production.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Dialect

__all__ = [
    "ADDRESS_CHARS",
    "CLAIMABLE",
    "DEFAULT_RECONCILE_AFTER",
    "FAIR_AT_DEFAULT",
    "MAX_BACKOFF_SECONDS",
    "SCOPE_CHARS",
    "STORED_POLICIES",
    "TERMINAL",
    "AmbiguityPolicy",
    "AttemptOutcome",
    "DeliveryStatus",
    "EventType",
    "OperatorAction",
    "RelayState",
    "Status",
    "SuppressionReason",
    "UTCDateTime",
    "attempts",
    "events",
    "intakes",
    "messages",
    "metadata",
    "operator_actions",
    "relays",
    "send_budget",
    "send_budget_lock",
    "send_slots",
    "suppressions",
    "utcnow",
]


class Status(enum.StrEnum):
    """Where a message is in its life. See docs/design.md, "The state machine"."""

    PENDING = "pending"  # enqueued, never attempted (or released/requeued)
    RETRYING = "retrying"  # attempted, failed transiently, due again at next_attempt_at
    PROCESSING = "processing"  # claimed by a relay under a lease
    SENT = "sent"  # the provider accepted it
    FAILED = "failed"  # permanent error or attempts exhausted
    UNKNOWN_OUTCOME = "unknown_outcome"  # the send may or may not have happened; operator decides
    CANCELLED = "cancelled"  # cancelled by an operator before it was sent
    EXPIRED = "expired"  # expires_at passed before it could be sent


class AmbiguityPolicy(enum.StrEnum):
    """What the relay does when it cannot know whether a send reached the provider."""

    HOLD = "hold"  # at most once: park as unknown_outcome for an operator
    RESEND = "resend"  # at least once: retry; a duplicate is better than a loss
    # Held like ``hold``; requeued once, automatically, when the event intake has provably been
    # flowing for ``reconcile_after`` seconds past the attempt without an event for it. Stored
    # as ``ambiguity_policy = 'hold'`` with ``reconcile_after`` set (the column's CHECK predates
    # it, and SQLite cannot change a CHECK without rebuilding the table).
    RECONCILE = "reconcile"


STORED_POLICIES = (AmbiguityPolicy.HOLD, AmbiguityPolicy.RESEND)
DEFAULT_RECONCILE_AFTER = 900.0  # seconds: a reconcile category's window (15 minutes)
# The turn of a row written without one (by an app not yet upgraded): first in line. One
# literal every backend reads as a time, so adding the column rewrites no row.
FAIR_AT_DEFAULT = "1970-01-01 00:00:00"
SCOPE_CHARS = 400  # a budget's scope: "identity:" and an address, or "key:" and a key


class DeliveryStatus(enum.StrEnum):
    """What the provider's events say happened after it accepted a message
    (``outbox_messages.delivery_status``). Several events for one message (one per recipient,
    a delay then a delivery) settle on the most serious: the later names here win over the
    earlier ones, whatever order the events arrive in."""

    DELAYED = "delayed"  # a DeliveryDelay: the receiving server has not taken it yet
    DELIVERED = "delivered"  # the receiving server took it
    REJECTED = "rejected"  # SES refused it after accepting the call (virus, rendering failure)
    SUPPRESSED = "suppressed"  # SES dropped it: the address is on a suppression list
    BOUNCED = "bounced"  # the receiving server refused it
    COMPLAINED = "complained"  # the recipient marked it as spam

    @property
    def rank(self) -> int:
        """Its seriousness: a status is replaced only by one of a higher rank."""
        return _DELIVERY_RANK[self]


_DELIVERY_RANK = {status: rank for rank, status in enumerate(DeliveryStatus, start=1)}


class EventType(enum.StrEnum):
    """The kinds of provider event the intake records (``outbox_events.event_type``)."""

    SEND = "send"
    DELIVERY = "delivery"
    BOUNCE = "bounce"
    COMPLAINT = "complaint"
    REJECT = "reject"
    DELIVERY_DELAY = "delivery_delay"
    RENDERING_FAILURE = "rendering_failure"
    OTHER = "other"  # a well-formed event of a kind that changes nothing (Open, Click, ...)
    MALFORMED = "malformed"  # a queue message that is not an SES event


class SuppressionReason(enum.StrEnum):
    """Why an address is in ``outbox_suppressions``."""

    BOUNCE = "bounce"  # a permanent bounce
    COMPLAINT = "complaint"  # a complaint
    MANUAL = "manual"  # an operator's ``suppressions add``
    SES = "ses"  # imported from the SES account suppression list


class OperatorAction(enum.StrEnum):
    """What an operator did, as recorded in ``outbox_operator_actions``."""

    REQUEUE = "requeue"
    CANCEL = "cancel"
    RESOLVE_DELIVERED = "resolve_delivered"
    RESOLVE_NOT_DELIVERED = "resolve_not_delivered"
    SUPPRESS = "suppress"
    UNSUPPRESS = "unsuppress"
    PRUNE = "prune"


class RelayState(enum.StrEnum):
    """What a relay says it is doing, in its ``outbox_relays`` row (and the
    ``outbox_relay_health`` view)."""

    RUNNING = "running"  # claiming and sending
    PAUSED = "paused"  # all sending paused (the account); probing until it works again
    DRAINING = "draining"  # stopping: claims nothing more, finishes the sends in flight
    STOPPED = "stopped"  # exited cleanly; its relay id is free


class AttemptOutcome(enum.StrEnum):
    """What one attempt found, as stored in ``outbox_attempts.outcome`` and carried by the
    relay's signals. A finalize whose claim was gone is recorded in its ``stale:`` form
    (:attr:`stale`)."""

    ACCEPTED = "accepted"  # the provider took it
    TRANSIENT = "transient"  # a failure worth retrying
    PERMANENT = "permanent"  # refused for good
    AMBIGUOUS = "ambiguous"  # the send may or may not have happened
    DISABLED = "disabled"  # sending is off (paused, quota); given back, no attempt counted
    INVALID_PAYLOAD = "invalid_payload"  # the row's payload is not an email; never sent
    LEASE_EXPIRED = "lease_expired"  # a sweep settled a send whose relay stopped renewing
    REQUEUED = "requeued"  # an operator's requeue
    CANCELLED = "cancelled"  # an operator's cancel
    RESOLVED = "resolved"  # an operator's resolve --delivered
    SUPPRESSED = "suppressed"  # every recipient is suppressed: failed, never sent
    RECONCILED = "reconciled"  # a provider event proved an ambiguous send reached the provider
    RECONCILE_REQUEUED = "reconcile:requeued"  # no event came while the intake flowed: requeued
    STALE_ACCEPTED = "stale:accepted"  # accepted, saved after its claim was gone
    STALE_TRANSIENT = "stale:transient"  # transient, saved after its claim was gone
    STALE_PERMANENT = "stale:permanent"  # permanent, saved after its claim was gone
    STALE_AMBIGUOUS = "stale:ambiguous"  # ambiguous, saved after its claim was gone
    STALE_DISABLED = "stale:disabled"  # disabled, saved after its claim was gone
    STALE_INVALID_PAYLOAD = "stale:invalid_payload"  # invalid payload, its claim gone

    @property
    def stale(self) -> AttemptOutcome:
        """This outcome as recorded by a finalize whose claim no longer held the row
        (``ValueError`` for the sweep's and operators' outcomes, which are never stale)."""
        if self.value.startswith(_STALE):
            return self
        return AttemptOutcome(_STALE + self.value)


_STALE = "stale:"

CLAIMABLE = (Status.PENDING, Status.RETRYING)
MAX_BACKOFF_SECONDS = 30 * 24 * 3600.0  # no retry is scheduled further out than 30 days

TERMINAL = (Status.SENT, Status.FAILED, Status.CANCELLED, Status.EXPIRED)


def utcnow() -> datetime:
    """The current time as an aware UTC datetime (the only kind the outbox stores)."""
    return datetime.now(UTC)


class UTCDateTime(sa.TypeDecorator[datetime]):
    """A timestamp stored in UTC and always returned timezone-aware.

    PostgreSQL stores ``timestamptz``; MySQL/MariaDB and SQLite have no time zones, so the value
    is stored as naive UTC with microseconds and made aware again on load. Naive datetimes are
    refused: their zone would be a guess.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> sa.types.TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        return dialect.type_descriptor(sa.DateTime(timezone=dialect.name == "postgresql"))

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: outbox timestamps must be timezone-aware")
        value = value.astimezone(UTC)
        if dialect.name == "postgresql":
            return value
        return value.replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_name)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

_BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(str(v)) for v in values)})"


def _not_postgresql(
    ddl: Any,
    target: Any,
    bind: Any,
    tables: Any = None,
    state: Any = None,
    *,
    dialect: sa.Dialect,
    compiler: Any = None,
    checkfirst: bool = False,
) -> bool:
    """A ``ddl_if`` test: made on every database but PostgreSQL."""
    return dialect.name != "postgresql"


def _exact(length: int) -> sa.types.TypeEngine[str]:
    """Text compared byte for byte on every backend: MariaDB's default collation would make
    the fairness keys "Acme" and "acme " one key (its turns, its limits)."""
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, collation="utf8mb4_bin"), "mysql", "mariadb"
    )


messages = sa.Table(
    "outbox_messages",
    metadata,
    sa.Column("id", _BigId, sa.Identity(), primary_key=True),
    sa.Column("idempotency_key", sa.String(255), nullable=False),
    sa.Column("category", sa.String(64), nullable=False),
    sa.Column("priority", sa.SmallInteger(), nullable=False, server_default="0"),
    sa.Column("status", sa.String(20), nullable=False, server_default=Status.PENDING.value),
    sa.Column("payload", sa.JSON(), nullable=False),
    sa.Column("recipients", sa.Text(), nullable=False),
    sa.Column("recipient_count", sa.SmallInteger(), nullable=False),
    sa.Column("subject", sa.Text(), nullable=True),
    sa.Column("attempt_count", sa.Integer(), nullable=False, server_default="0"),
    sa.Column("max_attempts", sa.Integer(), nullable=False),
    sa.Column("backoff_base", sa.Double(), nullable=False),
    sa.Column("backoff_cap", sa.Double(), nullable=False),
    sa.Column("ambiguity_policy", sa.String(10), nullable=False),
    sa.Column("next_attempt_at", UTCDateTime(), nullable=False),
    sa.Column("expires_at", UTCDateTime(), nullable=True),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
    sa.Column("claim_token", sa.String(36), nullable=True),
    sa.Column("claimed_by", sa.String(255), nullable=True),
    sa.Column("claimed_at", UTCDateTime(), nullable=True),
    sa.Column("lease_expires_at", UTCDateTime(), nullable=True),
    sa.Column("send_started_at", UTCDateTime(), nullable=True),
    sa.Column("last_attempt_at", UTCDateTime(), nullable=True),
    sa.Column("sent_at", UTCDateTime(), nullable=True),
    sa.Column("provider_message_id", sa.String(255), nullable=True),
    sa.Column("last_error_code", sa.String(100), nullable=True),
    sa.Column("last_error_message", sa.Text(), nullable=True),
    sa.Column("delivery_status", sa.String(20), nullable=True),
    sa.Column("delivery_status_at", UTCDateTime(), nullable=True),
    sa.Column("reconcile_after", sa.Double(), nullable=True),
    # fair sending: the row's tenant (or any lane), and its turn in the claim's order, a time
    # at or after next_attempt_at: docs/design.md, "Fair sending"
    sa.Column("fairness_key", _exact(255), nullable=True),
    sa.Column("fair_at", UTCDateTime(), nullable=False, server_default=FAIR_AT_DEFAULT),
    # the turn it took in its key's line, when it was written due (None: no key, or
    # scheduled for later); the next message of the key is placed after the latest
    sa.Column("line_at", UTCDateTime(), nullable=True),
    # when prune dropped its payload (its address lists kept), past --keep-bodies:
    # docs/design.md, "Body retention"
    sa.Column("body_dropped_at", UTCDateTime(), nullable=True),
    # PostgreSQL holds the key's uniqueness in ix_outbox_messages_idempotency_key, below
    sa.UniqueConstraint("idempotency_key").ddl_if(callable_=_not_postgresql),
    sa.CheckConstraint(_in("status", tuple(Status)), name="status"),
    sa.CheckConstraint(_in("ambiguity_policy", STORED_POLICIES), name="ambiguity_policy"),
    sa.CheckConstraint(_in("delivery_status", tuple(DeliveryStatus)), name="delivery_status"),
    mysql_engine="InnoDB",
)

# The claim reads one status at a time (pending, then retrying) in its turn order, so it is an
# index range scan on every backend; partial where the backend allows, so finished rows cost
# nothing. next_attempt_at last: the due test is read from the index.
sa.Index(
    "ix_outbox_messages_claim",
    messages.c.status,
    messages.c.priority,
    messages.c.fair_at,
    messages.c.id,
    messages.c.next_attempt_at,
    postgresql_where=sa.text(_in("status", CLAIMABLE)),
    sqlite_where=sa.text(_in("status", CLAIMABLE)),
)
# Enqueue reads the last turn in a key's line at a priority (outbox/fairness.py), backwards.
# The status is a column for MariaDB, which has no partial index: without it a key's line
# would be read among its sent rows (whose turns may lie hours ahead after a fast drain).
sa.Index(
    "ix_outbox_messages_fairness",
    messages.c.fairness_key,
    messages.c.status,
    messages.c.priority,
    messages.c.line_at,
    postgresql_where=sa.text("status = 'pending' AND line_at IS NOT NULL"),
    sqlite_where=sa.text("status = 'pending' AND line_at IS NOT NULL"),
)
# PostgreSQL: the key's uniqueness, in pattern order, so a key prefix (``LIKE 'order-42%'``,
# the console's key filter) is a range of this index whatever the database's collation; and
# created_at's block ranges (BRIN: a few pages, written almost never, as rows come in time
# order), so a date range reads its own rows. docs/design.md, "The console's messages page".
sa.Index(
    "ix_outbox_messages_idempotency_key",
    messages.c.idempotency_key,
    unique=True,
    postgresql_ops={"idempotency_key": "varchar_pattern_ops"},
).ddl_if(dialect="postgresql")
sa.Index("ix_outbox_messages_created_at", messages.c.created_at, postgresql_using="brin").ddl_if(
    dialect="postgresql"
)
# Events without the outbox's tags (identity notifications) find their row by SES message id.
# A hash index on PostgreSQL: the id is only ever looked up by equality, and a hash entry is a
# fixed ~34 bytes whatever the id's length (a b-tree's holds the id: 87 bytes for SES's 60).
sa.Index(
    "ix_outbox_messages_provider_message_id",
    messages.c.provider_message_id,
    postgresql_using="hash",
    postgresql_where=sa.text("provider_message_id IS NOT NULL"),
    sqlite_where=sa.text("provider_message_id IS NOT NULL"),
)
# The reconcile sweep reads the held sends of the reconcile policy, oldest first.
sa.Index(
    "ix_outbox_messages_reconcile",
    messages.c.status,
    messages.c.send_started_at,
    postgresql_where=sa.text("status = 'unknown_outcome' AND reconcile_after IS NOT NULL"),
    sqlite_where=sa.text("status = 'unknown_outcome' AND reconcile_after IS NOT NULL"),
)
# The sweep finds processing rows whose lease has run out.
sa.Index(
    "ix_outbox_messages_lease",
    messages.c.status,
    messages.c.lease_expires_at,
    postgresql_where=sa.text("status = 'processing'"),
    sqlite_where=sa.text("status = 'processing'"),
)

attempts = sa.Table(
    "outbox_attempts",
    metadata,
    sa.Column("id", _BigId, sa.Identity(), primary_key=True),
    sa.Column(
        "message_id",
        _BigId,
        sa.ForeignKey("outbox_messages.id", ondelete="CASCADE"),
        nullable=False,
        index=True,
    ),
    sa.Column("claim_token", sa.String(36), nullable=True),
    sa.Column("relay_id", sa.String(255), nullable=True),
    sa.Column("started_at", UTCDateTime(), nullable=True),
    sa.Column("finished_at", UTCDateTime(), nullable=False),
    sa.Column("outcome", sa.String(30), nullable=False),
    sa.Column("error_code", sa.String(100), nullable=True),
    sa.Column("error_message", sa.Text(), nullable=True),
    sa.Column("provider_message_id", sa.String(255), nullable=True),
    sa.Column("dropped_recipients", sa.Text(), nullable=True),  # suppressed, not sent to
    mysql_engine="InnoDB",
)

# An identity notification (no tags) names its send by SES message id only; a stale or
# superseded attempt's id is only here. Hash on PostgreSQL, as the messages' (equality only).
sa.Index(
    "ix_outbox_attempts_provider_message_id",
    attempts.c.provider_message_id,
    postgresql_using="hash",
    postgresql_where=sa.text("provider_message_id IS NOT NULL"),
    sqlite_where=sa.text("provider_message_id IS NOT NULL"),
)

relays = sa.Table(
    "outbox_relays",
    metadata,
    sa.Column("relay_id", sa.String(255), primary_key=True),
    sa.Column("host", sa.String(255), nullable=False),
    sa.Column("pid", sa.Integer(), nullable=False),
    sa.Column("started_at", UTCDateTime(), nullable=False),
    sa.Column("heartbeat_at", UTCDateTime(), nullable=False),
    sa.Column("state", sa.String(20), nullable=False),
    # the relay's scoped pauses as compact JSON, written with each heartbeat (NULL: none);
    # bounded by the relay (relay/store/relays.py), well under MariaDB's 64 KB TEXT
    sa.Column("paused_scopes", sa.Text(), nullable=True),
    mysql_engine="InnoDB",
)

# The send budget every relay shares (--max-send-rate): the sends booked in the last seconds,
# and one row whose lock relays take to book, one at a time. See relay/ratelimit.py.
send_budget = sa.Table(
    "outbox_send_budget",
    metadata,
    sa.Column("id", _BigId, sa.Identity(), primary_key=True),
    sa.Column("relay_id", sa.String(255), nullable=False),
    sa.Column("reserved_at", UTCDateTime(), nullable=False),  # when the sends may start
    sa.Column("recipients", sa.Integer(), nullable=False),
    sa.Column("occupied_until", UTCDateTime(), nullable=False, index=True),
    # whose budget: '' the shared --max-send-rate, 'key:...' or 'identity:...' a --key-limit
    # or --identity-limit's
    sa.Column("scope", _exact(SCOPE_CHARS), nullable=False, server_default=""),
    mysql_engine="InnoDB",
)

# The sends in flight of the scopes with a most-in-flight limit: one row per send started,
# counted while its message is still processing under the same claim (so a relay that dies
# frees its slots when its lease is swept), deleted once it no longer counts.
send_slots = sa.Table(
    "outbox_send_slots",
    metadata,
    sa.Column("id", _BigId, sa.Identity(), primary_key=True),
    sa.Column("scope", _exact(SCOPE_CHARS), nullable=False, index=True),
    sa.Column("message_id", _BigId, nullable=False),
    sa.Column("claim_token", sa.String(36), nullable=False),
    sa.Column("taken_at", UTCDateTime(), nullable=False),
    mysql_engine="InnoDB",
)

send_budget_lock = sa.Table(
    "outbox_send_budget_lock",
    metadata,
    sa.Column("id", sa.SmallInteger(), primary_key=True, autoincrement=False),
    mysql_engine="InnoDB",
)

# Every provider event the intake took from its queue, once (``event_key``: a digest of the
# event itself, so a replay or a duplicate delivery of the same event is recorded once).
# No bodies: SES events carry headers and addresses only, and the intake keeps neither headers
# nor the event's text. ``message_id`` is the row it was matched to (no foreign key: a row can
# be pruned before its late events arrive; ``tagged_message_id`` keeps what the event named).
events = sa.Table(
    "outbox_events",
    metadata,
    sa.Column("id", _BigId, sa.Identity(), primary_key=True),
    sa.Column("event_key", sa.String(64), nullable=False),
    sa.Column("received_at", UTCDateTime(), nullable=False),  # the database's clock
    sa.Column("event_type", sa.String(30), nullable=False),
    sa.Column("event_at", UTCDateTime(), nullable=True),  # SES's clock
    sa.Column("mail_at", UTCDateTime(), nullable=True),  # SES's clock: when it took the send
    sa.Column("provider_message_id", sa.String(255), nullable=True),
    sa.Column("message_id", _BigId, nullable=True, index=True),
    sa.Column("tagged_message_id", sa.String(64), nullable=True),
    sa.Column("claim_token", sa.String(36), nullable=True),
    sa.Column("detail", sa.String(255), nullable=True),
    sa.Column("recipients", sa.Text(), nullable=True),
    sa.Column("effect", sa.String(30), nullable=False),
    sa.Column("error", sa.Text(), nullable=True),
    sa.Column("source", sa.String(20), nullable=False),
    sa.Column("intake_id", sa.String(255), nullable=True),  # the replica that recorded it
    sa.UniqueConstraint("event_key"),
    mysql_engine="InnoDB",
)
sa.Index("ix_outbox_events_received_at", events.c.received_at)
# The intake's pass over events deferred while their row was being sent, oldest first.
sa.Index(
    "ix_outbox_events_deferred",
    events.c.effect,
    events.c.received_at,
    events.c.id,
    postgresql_where=sa.text("effect = 'deferred'"),
    sqlite_where=sa.text("effect = 'deferred'"),
)

# Addresses the relay never mails (lower-cased). Compared byte for byte: MariaDB's default
# collation would make "jose@" and "josé@" one key.
ADDRESS_CHARS = 320  # the longest address RFC 5321 allows; a suppression is keyed on it
_Address = _exact(ADDRESS_CHARS)

suppressions = sa.Table(
    "outbox_suppressions",
    metadata,
    sa.Column("address", _Address, primary_key=True),
    sa.Column("reason", sa.String(20), nullable=False),
    sa.Column("detail", sa.String(255), nullable=True),
    sa.Column("event_id", _BigId, nullable=True),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("actor", sa.String(255), nullable=False),
    sa.CheckConstraint(_in("reason", tuple(SuppressionReason)), name="reason"),
    mysql_engine="InnoDB",
)

# Each event intake replica's view of its queue: the moments it found the queue empty
# (``caught_up_at``, the database's clock) are what prove that no older event is still
# waiting there, and the queue's visibility timeout bounds how long a message another replica
# took and dropped stays hidden. The reconcile sweep reads them.
intakes = sa.Table(
    "outbox_intakes",
    metadata,
    sa.Column("intake_id", sa.String(255), primary_key=True),
    sa.Column("queue_url", sa.Text(), nullable=False),
    sa.Column("visibility_timeout", sa.Double(), nullable=False),  # seconds
    sa.Column("started_at", UTCDateTime(), nullable=False),
    sa.Column("heartbeat_at", UTCDateTime(), nullable=False),
    sa.Column("caught_up_at", UTCDateTime(), nullable=True),
    mysql_engine="InnoDB",
)

# Who did what, when and why: every operator command that changes rows or suppressions.
operator_actions = sa.Table(
    "outbox_operator_actions",
    metadata,
    sa.Column("id", _BigId, sa.Identity(), primary_key=True),
    sa.Column("at", UTCDateTime(), nullable=False),
    sa.Column("actor", sa.String(255), nullable=False),
    sa.Column("action", sa.String(30), nullable=False),
    sa.Column("message_id", _BigId, nullable=True, index=True),
    sa.Column("address", sa.String(ADDRESS_CHARS), nullable=True),
    sa.Column("reason", sa.Text(), nullable=True),
    sa.Column("detail", sa.Text(), nullable=True),
    mysql_engine="InnoDB",
)
