"""The batching of bulk changes: ``CHANGE_BATCH`` rows per transaction, a progress bar on a
terminal, and an interrupted change that says exactly what it did and what not."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime

import click
import sqlalchemy as sa

from outbox.schema import AttemptOutcome, OperatorAction
from relay import store
from relay.admin.output import detail
from relay.cli_options import first_line
from relay.clock import read_database_time
from relay.store import operator as ops

__all__ = [
    "CHANGE_BATCH",
    "Change",
    "Interrupted",
    "in_batches",
    "operator_attempt",
    "operator_id",
    "progress",
    "show_progress",
    "why_stopped",
]

CHANGE_BATCH = 500  # rows per transaction of requeue and cancel: short locks, few round trips


def show_progress() -> bool:
    """A progress bar only on a terminal: pipes, logs and ``--json`` readers get the result."""
    return sys.stderr.isatty()


@contextlib.contextmanager
def progress(total: int, label: str) -> Iterator[Callable[[int], None]]:
    """``advance(n)`` for a bulk change: a bar on stderr when it is a terminal, else nothing."""
    if not show_progress() or total == 0:
        yield lambda n: None
        return
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        yield bar.update


class Interrupted(click.ClickException):
    """A bulk change stopped part way (Ctrl-C or a database error): what was done, what not."""

    def __init__(
        self, message: str, done: Sequence[int] = (), unchanged: Sequence[int] = ()
    ) -> None:
        super().__init__(message)
        self.done, self.unchanged = list(done), list(unchanged)

    @property
    def why(self) -> str:
        """``interrupted`` or ``database error``: the ``interrupted`` field of ``--json``."""
        return self.message.split(":", 1)[0]


def why_stopped(exc: BaseException) -> str:
    """The head of an :class:`Interrupted` message: ``interrupted`` or the database error."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return f"database error: {first_line(exc)}"


def operator_id(actor: str) -> str:
    """The ``relay_id`` of an operator's attempt rows."""
    return f"operator:{actor}"


def operator_attempt(
    message_id: int,
    now: datetime,
    operator: str,
    done_as: AttemptOutcome,
    reason: str | None,
    provider_message_id: str | None = None,
) -> store.AttemptRecord:
    """The attempt row that records an operator's change of a message."""
    return store.AttemptRecord(
        message_id=message_id,
        claim_token=None,
        relay_id=operator,
        started_at=None,
        finished_at=now,
        outcome=done_as,
        error_message=reason,
        provider_message_id=provider_message_id,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Change:
    """What a bulk change does and how it is recorded."""

    actor: str
    verb: str  # the command: requeue, cancel
    done_as: AttemptOutcome  # the attempt rows' outcome, and the past tense of the output
    action: OperatorAction  # the log rows' action
    allowed: Sequence[str]  # the statuses it changes


def in_batches(
    engine: sa.Engine,
    chosen: Sequence[int],
    reason: str | None,
    change: Change,
    *,
    by_id: bool,
    apply: Callable[..., list[int]],
    advance: Callable[[int], None] | None = None,
    unchanged_since: datetime | None = None,
) -> list[int]:
    """The ids changed, batch by batch in id order. Stopped part way, it says how far it got:
    the batches before are committed, the rest unchanged, so running it again finishes it --
    with the same filters, or with the given ids not yet reached (the same ids again would be
    refused: the ones done are no longer in a status the command changes). ``advance`` is
    told each batch's size (None: a progress bar on a terminal, as the commands show).
    ``unchanged_since``: only rows not changed after it (the moment an operator was shown
    them) are changed; the rest count as moved meanwhile."""
    done: list[int] = []
    reached = 0  # how many of ``chosen`` the committed batches covered
    committing: list[int] = []  # the changes of a batch whose COMMIT is under way
    verb, done_as, actor = change.verb, change.done_as, change.actor
    operator = operator_id(actor)
    try:
        bar = progress(len(chosen), f"{verb} {len(chosen)} message(s)")
        with bar if advance is None else contextlib.nullcontext(advance) as advance_by:
            for start in range(0, len(chosen), CHANGE_BATCH):
                batch = chosen[start : start + CHANGE_BATCH]
                with engine.begin() as conn:
                    now = read_database_time(conn)  # requeued rows are due by the relays' clock
                    before = ops.lock_for_change(conn, batch, change.allowed, unchanged_since)
                    changed = apply(conn, ids=sorted(before), now=now)
                    store.record_attempts(
                        conn,
                        (operator_attempt(i, now, operator, done_as, reason) for i in changed),
                    )
                    ops.log_actions(
                        conn,
                        [
                            ops.LoggedAction(
                                at=now,
                                actor=actor,
                                action=change.action,
                                message_id=i,
                                reason=reason,
                                detail=detail(previous_status=before[i]),
                            )
                            for i in changed
                        ],
                    )
                    committing, since, upto_batch = changed, now, start + len(batch)
                committing = []
                done += changed
                reached = start + len(batch)
                advance_by(len(batch))
    except (KeyboardInterrupt, sa.exc.DBAPIError) as exc:
        why = why_stopped(exc)
        unsure = ""
        if committing:  # stopped during its COMMIT: the attempt rows say whether it happened
            landed = _committed(engine, committing, operator, done_as, since)
            if landed:
                done, reached = done + committing, upto_batch
            elif landed is None:
                unsure = (
                    f"; the batch up to id {chosen[upto_batch - 1]} may also have been "
                    f"{done_as}: `outbox-relay list` shows"
                )
        upto = f" (every id up to {chosen[reached - 1]})" if reached else ""
        again = "running the command again"
        if by_id and reached:
            again += f" with the given ids after {chosen[reached - 1]}"
        raise Interrupted(
            f"{why}: {done_as} {len(done)} of {len(chosen)} message(s){upto}, the others are "
            f"unchanged; {verb} them by {again}{unsure}",
            done,
            chosen[reached:],
        ) from None
    return done


def _committed(
    engine: sa.Engine,
    ids: Sequence[int],
    operator: str,
    done_as: AttemptOutcome,
    since: datetime,
) -> bool | None:
    """Whether a batch whose COMMIT was interrupted landed: its operator attempt rows commit
    with it, so they exist exactly if it did. None if the database cannot say (gone)."""
    try:
        with engine.connect() as conn:
            found = store.attempted_by(
                conn, ids=ids, relay_id=operator, outcome=done_as, since=since
            )
    except (KeyboardInterrupt, sa.exc.DBAPIError):
        return None
    return bool(found)
