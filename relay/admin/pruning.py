"""The ``prune`` command: finished messages with their attempts and events, events matched to
no message, and the rows of relays that stopped, deleted in short transactions, never inside
the dedup window; the bodies of finished messages past ``--keep-bodies`` dropped; the prune
itself written to the operators' log."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import click
import sqlalchemy as sa

from outbox.schema import TERMINAL, OperatorAction, Status
from relay.admin import options
from relay.admin.batches import Interrupted, progress, show_progress, why_stopped
from relay.admin.output import detail, text, to_json
from relay.cli_options import database_url, option
from relay.clock import read_database_time
from relay.store import operator as ops

__all__ = ["prune"]


def _span(value: timedelta) -> str:
    """A duration in the largest unit that states it exactly: ``30 days``, ``36 hours``."""
    seconds = value.total_seconds()
    for unit, size in (("week", 604800), ("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            count = int(seconds // size)
            return f"{count} {unit}{'s' if count != 1 else ''}"
    count_s = f"{seconds:g}"
    return f"{count_s} second{'' if count_s == '1' else 's'}"


def _prunable_statuses(include_unknown_outcome: bool) -> tuple[str, ...]:
    statuses = [s.value for s in TERMINAL]
    if include_unknown_outcome:
        statuses.append(Status.UNKNOWN_OUTCOME.value)
    return tuple(statuses)


def _seconds(keep: timedelta | None) -> float | None:
    return None if keep is None else keep.total_seconds()


def _horizons(bodies_before: datetime | None, failed_before: datetime | None) -> str:
    """Which finished messages lose their body, in words."""
    said = [
        f"{which} finished before {text(cutoff)}" if cutoff is not None else f"{which}: never"
        for which, cutoff in (("sent, cancelled, expired", bodies_before),
                              ("failed", failed_before))
    ]  # fmt: skip
    return "; ".join(said)


@click.command()
@database_url
@option(
    "--older-than",
    type=options.DURATION,
    required=True,
    show_default=False,
    help="Delete finished messages created and last changed longer ago than this.",
)
@option(
    "--dedup-window",
    type=options.DURATION,
    default="30d",
    help="Never delete messages younger than this: a pruned key can be enqueued again.",
)
@option(
    "--unmatched-events-older-than",
    type=options.DURATION,
    default="3d",
    help="Delete events matched to no message (unmatched, foreign, malformed) received longer "
    "ago than this, whatever --older-than and --dedup-window say.",
)
@option(
    "--stopped-relays-older-than",
    type=options.DURATION,
    default="7d",
    help="Delete the outbox_relays rows of relays that stopped cleanly longer ago than this.",
)
@option(
    "--keep-bodies",
    type=options.KEEP,
    default="7d",
    help="Drop the body (the payload: html, text, attachments, headers) of sent, cancelled "
    "and expired messages last changed longer ago than this, keeping the row, its key and its "
    "history; 0: at once; never: keep them.",
)
@option(
    "--keep-failed-bodies",
    type=options.KEEP,
    default="30d",
    help="The same for failed messages, which can be requeued only while they keep their "
    "body (once the cause is fixed); 0: at once; never: keep them.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(1, 100_000),
    default=1000,
    envvar="OUTBOX_PRUNE_BATCH_SIZE",  # not OUTBOX_BATCH_SIZE: that one is the relay's
    show_envvar=True,
    show_default=True,
    help="Rows deleted per transaction.",
)
@click.option(
    "--include-unknown-outcome",
    is_flag=True,
    help="Delete old unknown_outcome messages too (their fate is then never known).",
)
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@options.actor
@click.option(
    "--json", "as_json", is_flag=True, help="Machine-readable result (counts, cutoff, clamping)."
)
def prune(
    database_url: str, older_than: timedelta, dedup_window: timedelta,
    unmatched_events_older_than: timedelta, stopped_relays_older_than: timedelta,
    keep_bodies: timedelta | None, keep_failed_bodies: timedelta | None, batch_size: int,
    include_unknown_outcome: bool, dry_run: bool, actor: str, as_json: bool,
) -> None:  # fmt: skip
    """Delete finished messages (sent, resolved as delivered, failed, cancelled, expired),
    their attempts and their events, older than the cutoff; and events matched to no message
    older than --unmatched-events-older-than.

    Pruning a message forgets its idempotency key, so the same key could be enqueued and sent
    again: messages younger than --dedup-window are never pruned, whatever --older-than says
    (a line on stderr says so when it clamps). unknown_outcome messages are kept unless
    --include-unknown-outcome. The operators' log is never pruned; the prune itself is
    written to it (one row, its counts and cutoff). Deletes in batches of --batch-size, each
    its own short transaction; a progress bar shows on a terminal.

    Then the bodies of the finished messages it kept are dropped: of sent, cancelled and
    expired ones last changed longer ago than --keep-bodies (7 days), of failed ones after
    --keep-failed-bodies (30 days). Their rows, keys, recipients, subjects and histories stay
    until the rows are pruned, and `show` says when the body went. A message without its body
    cannot be requeued.
    """
    clamped = older_than < dedup_window
    statuses = _prunable_statuses(include_unknown_outcome)
    with options.database(database_url) as engine:
        if clamped:
            click.echo(
                f"--older-than {_span(older_than)} is inside the dedup window "
                f"({_span(dedup_window)}): pruning messages older than {_span(dedup_window)} "
                "instead",
                err=True,
            )
        with engine.connect() as conn:
            now = read_database_time(conn)
            cutoff = now - max(older_than, dedup_window)
            unmatched_cutoff = now - unmatched_events_older_than
            relays_cutoff = now - stopped_relays_older_than
            bodies_cutoff = None if keep_bodies is None else now - keep_bodies
            failed_cutoff = None if keep_failed_bodies is None else now - keep_failed_bodies
            bodies = (
                ops.count_droppable_bodies(
                    conn,
                    before=bodies_cutoff,
                    failed_before=failed_cutoff,
                    pruned_before=cutoff,
                    statuses=statuses,
                )
                if dry_run
                else 0
            )
            stopped_relays = ops.count_stopped_relays(conn, before=relays_cutoff) if dry_run else 0
            matched = (
                ops.count_prunable_messages(conn, before=cutoff, statuses=statuses)
                if dry_run or show_progress()
                else None
            )
            matched_events = (
                ops.count_prunable_events(
                    conn, before=cutoff, statuses=statuses, unmatched_before=unmatched_cutoff
                )
                if dry_run
                else 0
            )
        facts = {
            "cutoff": cutoff,
            "older_than_seconds": older_than.total_seconds(),
            "dedup_window_seconds": dedup_window.total_seconds(),
            "unmatched_events_cutoff": unmatched_cutoff,
            "unmatched_events_older_than_seconds": unmatched_events_older_than.total_seconds(),
            "stopped_relays_older_than_seconds": stopped_relays_older_than.total_seconds(),
            "bodies_cutoff": bodies_cutoff,
            "failed_bodies_cutoff": failed_cutoff,
            "keep_bodies_seconds": _seconds(keep_bodies),
            "keep_failed_bodies_seconds": _seconds(keep_failed_bodies),
            "include_unknown_outcome": include_unknown_outcome,
        }
        interrupted: Interrupted | None = None
        pruned = _Pruned()
        try:
            if not dry_run:
                _prune_batches(
                    engine, pruned, cutoff, batch_size, matched or 0,
                    statuses=statuses, unmatched_before=unmatched_cutoff,
                    relays_before=relays_cutoff, bodies_before=bodies_cutoff,
                    failed_bodies_before=failed_cutoff,
                    log=ops.LoggedAction(at=now, actor=actor, action=OperatorAction.PRUNE),
                    facts=facts,
                )  # fmt: skip
        except Interrupted as stopped:  # --json still says how many went, then the line
            interrupted = stopped
    if as_json:
        counts = (
            {
                "would_delete": matched,
                "would_delete_events": matched_events,
                "would_delete_relays": stopped_relays,
                "would_drop_bodies": bodies,
            }
            if dry_run
            else {
                "deleted": pruned.messages,
                "deleted_events": pruned.events,
                "deleted_relays": pruned.relays,
                "bodies_dropped": pruned.bodies,
            }
        )
        stop = {"interrupted": interrupted.why} if interrupted else {}
        click.echo(
            to_json(
                {
                    "command": "prune",
                    "dry_run": dry_run,
                    **stop,
                    **counts,
                    **facts,
                    "clamped_to_dedup_window": clamped,
                }
            )
        )
    if interrupted:
        raise interrupted
    if as_json:
        return
    if dry_run:
        click.echo(
            f"would delete {matched} message(s) created before {text(cutoff)}, and "
            f"{matched_events} event(s), and {stopped_relays} stopped relay row(s); would "
            f"drop the bodies of {bodies} message(s) ({_horizons(bodies_cutoff, failed_cutoff)})"
        )
    else:
        click.echo(
            f"deleted {pruned.messages} message(s) created before {text(cutoff)}, and "
            f"{pruned.events} event(s), and {pruned.relays} stopped relay row(s); dropped "
            f"the bodies of {pruned.bodies} message(s) "
            f"({_horizons(bodies_cutoff, failed_cutoff)})"
        )


@dataclasses.dataclass(kw_only=True, slots=True)
class _Pruned:
    """What a prune's committed batches deleted so far."""

    messages: int = 0
    events: int = 0
    relays: int = 0
    bodies: int = 0


def _prune_batches(
    engine: sa.Engine,
    pruned: _Pruned,
    cutoff: datetime,
    batch_size: int,
    expected: int,
    *,
    statuses: Sequence[str],
    unmatched_before: datetime,
    relays_before: datetime,
    bodies_before: datetime | None,
    failed_bodies_before: datetime | None,
    log: ops.LoggedAction,
    facts: dict[str, Any],
) -> None:
    """Delete messages batch by batch until a batch comes back short, then the unmatched
    events received before ``unmatched_before``, then drop the bodies finished before
    ``bodies_before`` (one pass along the ids); each batch commits on its own with the
    prune's log row brought up to date.
    Stopped part way, it says how many were deleted (running it again goes on)."""
    log_id: int | None = None
    phase = "messages"
    after_id = 0
    try:
        with progress(expected, f"prune {expected} message(s)") as advance:
            while phase != "done":
                count = gone = dropped = 0
                with engine.begin() as conn:
                    if log_id is None:  # the first batch: the stopped relays' rows, few
                        pruned.relays = ops.prune_stopped_relays(conn, before=relays_before)
                    if phase == "messages":
                        count, gone = ops.prune_messages(
                            conn, before=cutoff, limit=batch_size, statuses=statuses
                        )
                        if count < batch_size:
                            phase = "events"
                    elif phase == "events":
                        gone = ops.prune_unmatched_events(
                            conn, before=unmatched_before, limit=batch_size
                        )
                        if gone < batch_size:
                            phase = "bodies"
                    else:
                        now = read_database_time(conn)
                        dropped, last = ops.drop_bodies(
                            conn, before=bodies_before, failed_before=failed_bodies_before,
                            now=now, limit=batch_size, after_id=after_id,
                        )  # fmt: skip
                        if last is None:
                            phase = "done"
                        else:
                            after_id = last
                    facts_now = detail(
                        **facts,
                        deleted=pruned.messages + count,
                        deleted_events=pruned.events + gone,
                        deleted_relays=pruned.relays,
                        bodies_dropped=pruned.bodies + dropped,
                    )
                    log_id = ops.log_prune(conn, log_id, dataclasses.replace(log, detail=facts_now))
                pruned.messages += count
                pruned.events += gone
                pruned.bodies += dropped
                advance(count)
    except (KeyboardInterrupt, sa.exc.DBAPIError) as exc:
        why = why_stopped(exc)
        raise Interrupted(
            f"{why}: deleted {pruned.messages} message(s) and dropped the bodies of "
            f"{pruned.bodies} before it stopped; run the command again to do the rest"
        ) from None
