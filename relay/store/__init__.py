"""Every SQL statement of the relay, each a function named by intent, one module per concern;
this package re-exports them (``from relay import store; store.claim_batch(...)``).

The rules that keep the relay safe:

* Every transition is **one conditional UPDATE** whose WHERE names the state it expects, and
  for a claimed row its id and ``claim_token``. Zero rows affected means another relay (or the
  sweep) moved the row first; the caller logs it and moves on. Nothing is load-mutate-saved.
* No function holds a transaction across a provider call: the caller runs them in short
  transactions, never around a send.
* Sweeps and the expiry scan skip rows another transaction holds (``SKIP LOCKED``): a relay
  never waits on another relay's locks.
* MySQL/MariaDB report *matched* rows (``CLIENT_FOUND_ROWS``), so a guarded UPDATE's rowcount
  is reliable there too; MariaDB has no ``UPDATE ... RETURNING``, so the claim reads its rows
  back by claim token.
"""

from __future__ import annotations

from relay.store.attempts import AttemptRecord, attempted_by, record_attempts
from relay.store.budget import (
    book_sends,
    lock_send_budget,
    prune_send_budget,
    prune_send_slots,
    scoped_bookings,
    send_bookings,
    send_slots_in_use,
    take_send_slots,
)
from relay.store.bulk import (
    CANCELLABLE,
    REQUEUEABLE,
    Filter,
    bodies_dropped,
    cancel,
    cancel_many,
    count_messages,
    get_message,
    list_messages,
    message_ids,
    recent_payloads,
    requeue,
    requeue_many,
    statuses_of,
)
from relay.store.catalog import OUTBOX_TABLES, missing_tables, read_lag, read_view
from relay.store.claims import (
    Claim,
    Expired,
    Taking,
    Took,
    claim_batch,
    count_due,
    count_locked_due,
    expire,
    extend_lease,
    lock_batch,
    mark_send_started,
    mark_send_started_at,
    take_batch,
)
from relay.store.finalize import (
    SentSave,
    apply_decision,
    fail,
    finalize_sent,
    finalize_sent_many,
    finalize_sent_recorded,
    hold_unknown,
    release,
    release_unsent,
    release_unstarted,
    save_sent,
    schedule_retry,
)
from relay.store.passes import save_and_lock
from relay.store.reconcile import (
    MAX_RECONCILE_AFTER,
    Confirmed,
    Reconciled,
    reconcile_unknown,
    resolve_confirmed,
)
from relay.store.relays import (
    BEAT_BEFORE_RECEIVE,
    RECEIVE_AFTER_HEARTBEAT,
    PausedScope,
    RelayHolder,
    RelayPauses,
    heartbeat_held,
    live_heartbeats,
    pauses_refused,
    pauses_text,
    read_pauses,
    register,
    relay_pauses,
    stop_held,
)
from relay.store.suppressions import suppressed_among
from relay.store.sweep import (
    StaleLease,
    settle_expired_leases,
    sweep_candidates,
    sweep_expired_leases,
)

__all__ = [
    "BEAT_BEFORE_RECEIVE",
    "CANCELLABLE",
    "MAX_RECONCILE_AFTER",
    "OUTBOX_TABLES",
    "RECEIVE_AFTER_HEARTBEAT",
    "REQUEUEABLE",
    "AttemptRecord",
    "Claim",
    "Confirmed",
    "Expired",
    "Filter",
    "PausedScope",
    "Reconciled",
    "RelayHolder",
    "RelayPauses",
    "SentSave",
    "StaleLease",
    "Taking",
    "Took",
    "apply_decision",
    "attempted_by",
    "bodies_dropped",
    "book_sends",
    "cancel",
    "cancel_many",
    "claim_batch",
    "count_due",
    "count_locked_due",
    "count_messages",
    "expire",
    "extend_lease",
    "fail",
    "finalize_sent",
    "finalize_sent_many",
    "finalize_sent_recorded",
    "get_message",
    "heartbeat_held",
    "hold_unknown",
    "list_messages",
    "live_heartbeats",
    "lock_batch",
    "lock_send_budget",
    "mark_send_started",
    "mark_send_started_at",
    "message_ids",
    "missing_tables",
    "pauses_refused",
    "pauses_text",
    "prune_send_budget",
    "prune_send_slots",
    "read_lag",
    "read_pauses",
    "read_view",
    "recent_payloads",
    "reconcile_unknown",
    "record_attempts",
    "register",
    "relay_pauses",
    "release",
    "release_unsent",
    "release_unstarted",
    "requeue",
    "requeue_many",
    "resolve_confirmed",
    "save_and_lock",
    "save_sent",
    "schedule_retry",
    "scoped_bookings",
    "send_bookings",
    "send_slots_in_use",
    "settle_expired_leases",
    "statuses_of",
    "stop_held",
    "suppressed_among",
    "sweep_candidates",
    "sweep_expired_leases",
    "take_batch",
    "take_send_slots",
]
