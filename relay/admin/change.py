"""The commands that change messages: ``requeue`` and ``cancel`` (by ids or, with ``--yes``,
by filters, in batches) and ``resolve`` (one message whose fate an operator has established).
Each records the operator's reason as an attempt row and writes the operators' log in the
transaction of its change."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Sequence
from datetime import datetime
from typing import Any, cast

import click
import sqlalchemy as sa

from outbox.schema import AttemptOutcome, OperatorAction, Status, messages
from relay import store
from relay.admin import options
from relay.admin.batches import Change, Interrupted, in_batches, operator_attempt, operator_id
from relay.admin.output import detail, some, text, to_json
from relay.cli_options import database_url
from relay.clock import read_database_time
from relay.store import operator as ops

__all__ = ["cancel", "check_provider_id", "requeue", "resolve", "resolve_one", "select_for_change"]


def select_for_change(
    conn: sa.Connection,
    ids: Sequence[int],
    flt: store.Filter,
    allowed: Iterable[str],
    verb: str,
    *,
    needs_body: bool,
) -> tuple[list[int], list[int]]:
    """The ids a change (the command's or the console's) will make; refuses
    (:class:`click.ClickException`), changing nothing, if any given id is unknown or in a
    status the command cannot change, or (``needs_body``: it would be sent again) lost its
    body to prune. Filters leave such messages out: (the ids to change, the ids left out so)."""
    allowed = tuple(allowed)
    if ids:
        found = store.statuses_of(conn, ids)
        missing = [i for i in ids if i not in found]
        if missing:
            raise click.ClickException(f"no message with id {some(map(str, missing))}")
        wrong = [f"{i} ({found[i]})" for i in ids if found[i] not in allowed]
        if wrong:
            raise click.ClickException(
                f"cannot {verb} {some(wrong)}: only {' or '.join(allowed)} messages"
            )
        dropped = store.bodies_dropped(conn, ids) if needs_body else {}
        if dropped:
            raise click.ClickException(
                f"cannot {verb} {some(map(str, sorted(dropped)))}: prune dropped the body "
                "(--keep-bodies), so there is nothing to send; `outbox-relay show` says when"
            )
        return list(ids), []
    statuses = flt.statuses or allowed
    bad = [s for s in statuses if s not in allowed]
    if bad:
        raise click.BadParameter(
            f"cannot {verb} {', '.join(bad)} messages", param_hint="'--status'"
        )
    chosen = store.Filter(**{**_fields(flt), "statuses": tuple(statuses)})
    if not needs_body:
        return store.message_ids(conn, chosen), []
    # each read on its own: a row that moves between them is in neither, or in the one
    # that says what it is now
    kept = store.message_ids(conn, dataclasses.replace(chosen, has_body=True))
    left_out = store.message_ids(conn, dataclasses.replace(chosen, has_body=False))
    return kept, left_out


def _fields(flt: store.Filter) -> dict[str, Any]:
    return {name: getattr(flt, name) for name in store.Filter.__dataclass_fields__}


def _change(
    database_url: str,
    ids: Sequence[int],
    filters: dict[str, Any],
    yes: bool,
    reason: str | None,
    as_json: bool,
    actor: str,
    *,
    verb: str,
    done_as: AttemptOutcome,
    action: OperatorAction,
    allowed: Sequence[str],
    apply: Callable[..., list[int]],
) -> None:
    """Apply ``apply`` to the chosen messages, ``CHANGE_BATCH`` ids per transaction (each
    batch's rows, their operator attempt rows and their log rows commit together);
    ``done_as`` is the past tense that the output and the attempt rows use (the status's own
    spelling: ``cancelled``).
    """
    if ids and any(filters.values()):
        raise click.UsageError("give message ids or filters, not both")
    if not ids and not any(filters.values()):
        raise click.UsageError(f"give the ids to {verb}, or filters (with --yes)")
    flt = options.to_filter(**filters)
    with options.database(database_url) as engine:
        with engine.connect() as conn:
            found, left_out = select_for_change(
                conn, ids, flt, allowed, verb, needs_body=action is OperatorAction.REQUEUE
            )
            chosen = sorted(set(found))
        if left_out:
            click.echo(
                f"{len(left_out)} matching message(s) left out: prune dropped their bodies "
                "(--keep-bodies), so there is nothing to send",
                err=True,
            )
        bodiless = {"left_out_bodiless_ids": left_out} if left_out else {}
        if not ids and not yes:
            raise click.UsageError(f"{len(chosen)} messages match; add --yes to {verb} them all")
        try:
            done = in_batches(
                engine,
                chosen,
                reason,
                Change(actor=actor, verb=verb, done_as=done_as, action=action, allowed=allowed),
                by_id=bool(ids),
                apply=apply,
            )
        except Interrupted as stopped:
            if as_json:  # a script learns exactly which ids are done and which to give again
                click.echo(
                    to_json(
                        {
                            "command": verb,
                            "interrupted": stopped.why,
                            "matched": len(chosen),
                            done_as: len(stopped.done),
                            f"{done_as}_ids": stopped.done,
                            "unchanged_ids": stopped.unchanged,
                            **bodiless,
                        }
                    )
                )
            raise
    left = sorted(set(chosen) - set(done))
    if as_json:
        click.echo(
            to_json(
                {
                    "command": verb,
                    "matched": len(chosen),
                    done_as: len(done),
                    "moved_meanwhile": len(left),
                    f"{done_as}_ids": done,
                    "moved_meanwhile_ids": left,
                    **bodiless,
                }
            )
        )
        return
    tail = f" ({len(left)} moved meanwhile and were left alone)" if left else ""
    click.echo(f"{done_as} {len(done)} message(s){tail}")


_as_json = click.option(
    "--json", "as_json", is_flag=True, help="Machine-readable result (counts and ids)."
)


@click.command()
@database_url
@click.argument("ids", nargs=-1, type=int)
@options.filters
@click.option("--reason", help="Why: recorded with the message's attempts.")
@click.option("--yes", is_flag=True, help="Confirm a bulk requeue (filters instead of ids).")
@options.actor
@_as_json
def requeue(
    database_url: str, ids: tuple[int, ...], reason: str | None, yes: bool, actor: str,
    as_json: bool, **filters: Any,
) -> None:  # fmt: skip
    """Send unknown_outcome or failed messages again: back to pending, due now, with a fresh
    attempt budget.

    For unknown_outcome, first check with SES (CloudWatch, event destinations, the provider
    ids in `outbox-relay show ID`) that the first send did not arrive: requeue sends again.
    Changes 500 messages per transaction; a progress bar shows on a terminal.
    """
    _change(
        database_url, ids, filters, yes, reason, as_json, actor,
        verb="requeue",
        done_as=AttemptOutcome.REQUEUED,
        action=OperatorAction.REQUEUE,
        allowed=store.REQUEUEABLE,
        apply=store.requeue_many,
    )  # fmt: skip


@click.command()
@database_url
@click.argument("ids", nargs=-1, type=int)
@options.filters
@click.option("--reason", help="Why: recorded with the message's attempts.")
@click.option("--yes", is_flag=True, help="Confirm a bulk cancel (filters instead of ids).")
@options.actor
@_as_json
def cancel(
    database_url: str, ids: tuple[int, ...], reason: str | None, yes: bool, actor: str,
    as_json: bool, **filters: Any,
) -> None:  # fmt: skip
    """Cancel pending or retrying messages so they are never sent (a message being sent right
    now cannot be cancelled). Changes 500 messages per transaction; a progress bar shows on a
    terminal."""
    _change(
        database_url, ids, filters, yes, reason, as_json, actor,
        verb="cancel",
        done_as=AttemptOutcome.CANCELLED,
        action=OperatorAction.CANCEL,
        allowed=store.CANCELLABLE,
        apply=store.cancel_many,
    )  # fmt: skip


# Where resolve --delivered takes a row from. Not processing (a relay holds it and will say
# itself), not sent (nothing to close), not cancelled (the outbox never sent it).
_RESOLVABLE = (
    Status.UNKNOWN_OUTCOME.value,
    Status.FAILED.value,
    Status.EXPIRED.value,
    Status.PENDING.value,
    Status.RETRYING.value,
)
_WHY_NOT_RESOLVED = {
    Status.PROCESSING.value: "it is processing: a relay holds it and is sending it now; wait "
    "until it leaves processing (`outbox-relay show {id}`), then resolve it if it needs it",
    Status.SENT.value: "it is already sent",
    Status.CANCELLED.value: "it was cancelled: the outbox never sent it, so it cannot have "
    "been delivered by it",
}
_PROVIDER_ID_LENGTH: int = cast(sa.String, messages.c.provider_message_id.type).length or 0


def check_provider_id(value: str | None) -> str | None:
    """An SES message id an operator gives: 1 to the column's length, printable."""
    if value is not None and not (1 <= len(value) <= _PROVIDER_ID_LENGTH and value.isprintable()):
        raise click.BadParameter(f"must be 1 to {_PROVIDER_ID_LENGTH} printable characters")
    return value


@click.command()
@database_url
@click.argument("message_id", type=int)
@click.option("--delivered", is_flag=True, help="It reached its recipient: mark it sent.")
@click.option("--not-delivered", is_flag=True, help="It did not: requeue it (as `requeue` does).")
@click.option(
    "--provider-message-id",
    callback=lambda _ctx, _param, value: check_provider_id(value),
    help="With --delivered: the SES message id that proves it (kept on the row).",
)
@click.option("--reason", help="Why: recorded with the message's attempts and in the log.")
@options.actor
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result.")
def resolve(
    database_url: str, message_id: int, delivered: bool, not_delivered: bool,
    provider_message_id: str | None, reason: str | None, actor: str, as_json: bool,
) -> None:  # fmt: skip
    """Close a message whose fate an operator has established.

    --delivered: it reached its recipient (SES's event history, CloudWatch, the recipient
    says so). From unknown_outcome, failed, expired, pending or retrying it becomes sent, now,
    with --provider-message-id if given; it is never sent again.

    --not-delivered: it did not. From unknown_outcome or failed it goes back to pending, due
    now, exactly as `requeue` does: the relay sends it again.

    Both are recorded as an attempt row and in the operators' log, in one transaction with
    the change.
    """
    if delivered == not_delivered:
        raise click.UsageError("give exactly one of --delivered or --not-delivered")
    if not_delivered and provider_message_id is not None:
        raise click.UsageError("--provider-message-id goes with --delivered only")
    with options.database(database_url) as engine:
        result = resolve_one(
            engine,
            message_id,
            delivered=delivered,
            provider_message_id=provider_message_id,
            reason=reason,
            actor=actor,
        )
    if as_json:
        click.echo(to_json({"command": "resolve", "message_id": message_id, **result}))
        return
    how = "delivered: sent" if delivered else "not delivered: requeued"
    click.echo(f"resolved message {message_id} as {how} (was {result['previous_status']})")


def resolve_one(
    engine: sa.Engine,
    message_id: int,
    *,
    delivered: bool,
    provider_message_id: str | None,
    reason: str | None,
    actor: str,
    unchanged_since: datetime | None = None,
    only: Collection[str] | None = None,
) -> dict[str, Any]:
    """Resolve one message (the command's and the console's): in one transaction, its row
    locked and changed, its attempt row and its log row; refused
    (:class:`click.ClickException`) with nothing changed when its status does not allow it,
    or (``unchanged_since``: what the console showed) when it changed since, or (``only``:
    the statuses a bulk resolve chose from) when it is in another status now. ``only`` is
    read under the row's lock: an ``updated_at`` is the clock of a change's start, so a
    change that began before the console looked and committed after passes
    ``unchanged_since``, but not ``only``."""
    with engine.begin() as conn:
        now = read_database_time(conn)
        previous = ops.lock_for_change(conn, [message_id], None, unchanged_since).get(message_id)
        if previous is None and unchanged_since is not None:
            raise click.ClickException(
                f"message {message_id} changed since you looked at it, or is gone: nothing "
                "changed; look at it again"
            )
        if previous is not None and only is not None and previous not in only:
            raise click.ClickException(
                f"message {message_id} is {previous} now, no longer {' or '.join(only)}: "
                "nothing changed; look at it again"
            )
        if previous is None:
            raise click.ClickException(f"no message with id {message_id}")
        if delivered:
            return _resolve_delivered(
                conn, message_id, previous, now, provider_message_id, reason, actor
            )
        return _resolve_not_delivered(conn, message_id, previous, now, reason, actor)


def _resolve_delivered(
    conn: sa.Connection,
    message_id: int,
    previous: str,
    now: datetime,
    provider_message_id: str | None,
    reason: str | None,
    actor: str,
) -> dict[str, Any]:
    if previous not in _RESOLVABLE:
        why = _WHY_NOT_RESOLVED.get(previous, f"it is {previous}").format(id=message_id)
        raise click.ClickException(f"cannot resolve message {message_id} as delivered: {why}")
    earlier_id = ops.provider_id_of(conn, message_id)
    if not ops.resolve_delivered(
        conn,
        message_id=message_id,
        expected=previous,
        now=now,
        provider_message_id=provider_message_id,
    ):
        raise click.ClickException(
            f"message {message_id} moved on from {previous} meanwhile (a relay or the event "
            "intake took it); nothing changed: `outbox-relay show` it"
        )
    store.record_attempts(
        conn,
        [
            operator_attempt(
                message_id,
                now,
                operator_id(actor),
                AttemptOutcome.RESOLVED,
                reason,
                provider_message_id=provider_message_id,
            )
        ],
    )
    facts: dict[str, Any] = {"previous_status": previous}
    if provider_message_id is not None:
        facts["provider_message_id"] = provider_message_id
        if earlier_id not in (None, provider_message_id):
            facts["previous_provider_message_id"] = earlier_id
    ops.log_actions(
        conn,
        [
            ops.LoggedAction(
                at=now,
                actor=actor,
                action=OperatorAction.RESOLVE_DELIVERED,
                message_id=message_id,
                reason=reason,
                detail=detail(**facts),
            )
        ],
    )
    return {
        "resolution": "delivered",
        "status": Status.SENT.value,
        "sent_at": now,
        "provider_message_id": provider_message_id or earlier_id,
        "actor": actor,
        **facts,
    }


def _resolve_not_delivered(
    conn: sa.Connection,
    message_id: int,
    previous: str,
    now: datetime,
    reason: str | None,
    actor: str,
) -> dict[str, Any]:
    if previous not in store.REQUEUEABLE:
        raise click.ClickException(
            f"cannot resolve message {message_id} as not delivered: it is {previous}; only "
            f"{' or '.join(store.REQUEUEABLE)} messages are requeued"
        )
    if dropped := store.bodies_dropped(conn, [message_id]):
        raise click.ClickException(
            f"cannot resolve message {message_id} as not delivered: prune dropped its body at "
            f"{text(dropped[message_id])} (--keep-bodies), so it cannot be sent again; enqueue "
            "the email anew (a new idempotency key) and resolve this one --delivered or leave it"
        )
    if not store.requeue(conn, message_id=message_id, now=now):
        raise click.ClickException(
            f"message {message_id} moved on from {previous} meanwhile; nothing changed"
        )
    store.record_attempts(
        conn,
        [operator_attempt(message_id, now, operator_id(actor), AttemptOutcome.REQUEUED, reason)],
    )
    ops.log_actions(
        conn,
        [
            ops.LoggedAction(
                at=now,
                actor=actor,
                action=OperatorAction.RESOLVE_NOT_DELIVERED,
                message_id=message_id,
                reason=reason,
                detail=detail(previous_status=previous),
            )
        ],
    )
    return {
        "resolution": "not_delivered",
        "status": Status.PENDING.value,
        "previous_status": previous,
        "actor": actor,
    }
