"""Operator commands of ``outbox-relay``: status, list, show, requeue, cancel, resolve,
prune and suppressions.

Each command checks everything it was given before it changes anything: a bad id, status or
filter stops it with a message and no change. Bulk changes (filters instead of ids) need
``--yes``. Requeue, cancel and resolve record the operator's reason as an attempt row. Every
change an operator makes (requeue, cancel, resolve, suppressions, prune) is also written to
the operators' log, ``outbox_operator_actions``, in the transaction of the change itself: a
change that rolls back leaves no log row, and a log row that cannot be written rolls its
change back.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import click
import sqlalchemy as sa

from outbox.exceptions import InvalidEmail
from outbox.message import Email, validate_address
from outbox.schema import (
    TERMINAL,
    AttemptOutcome,
    DeliveryStatus,
    OperatorAction,
    RelayState,
    Status,
    SuppressionReason,
    UTCDateTime,
    attempts,
    events,
    messages,
    operator_actions,
    relays,
    suppressions,
    utcnow,
)
from relay import store
from relay.cli_options import database_url, first_line, open_database, option
from relay.clock import read_database_time
from relay.formats import plain, utc_iso
from relay.recipients import address_key

__all__ = [
    "CHANGE_BATCH",
    "COMMANDS",
    "cancel",
    "list_",
    "parse_duration",
    "prune",
    "requeue",
    "resolve",
    "show",
    "status",
    "suppressions_",
    "suppressions_add",
    "suppressions_import",
    "suppressions_list",
    "suppressions_remove",
]

_DURATION_PARTS = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_STATUSES = [s.value for s in Status]
_LONGEST = timedelta(weeks=5217)  # about 100 years: longer than any message, and a valid date


def parse_duration(text: str) -> timedelta:
    """``90s``, ``15m``, ``12h``, ``30d``, ``2w`` or combinations such as ``1d12h``."""
    cleaned = text.strip().lower()
    parts = _DURATION_PARTS.findall(cleaned)
    if not parts or _DURATION_PARTS.sub("", cleaned).strip():
        raise ValueError(f"{text!r} is not a duration such as 90s, 15m, 12h, 30d or 2w")
    seconds = sum(float(n) * _UNITS[unit] for n, unit in parts)
    if seconds > _LONGEST.total_seconds():  # 'now' minus it must still be a date
        raise ValueError(f"{text!r} is too long a duration: at most 100 years (5217w)")
    return timedelta(seconds=seconds)


class _Duration(click.ParamType[timedelta]):
    name = "DURATION"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> timedelta:
        if isinstance(value, timedelta):
            return value
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


_DURATION = _Duration()


def _filters(function: Callable[..., Any]) -> Callable[..., Any]:
    for decorator in reversed(
        [
            click.option(
                "--status",
                "statuses",
                multiple=True,
                type=click.Choice(_STATUSES),
                help="Only messages in this status (repeatable).",
            ),
            click.option(
                "--category", "categories", multiple=True, help="Only this category (repeatable)."
            ),
            click.option("--key", help="Idempotency key; a trailing * matches a prefix."),
            click.option(
                "--older-than", type=_DURATION, help="Created longer ago than this (e.g. 2h)."
            ),
            click.option("--newer-than", type=_DURATION, help="Created within this (e.g. 30m)."),
        ]
    ):
        function = decorator(function)
    return function


def _filter(
    ids: Sequence[int] = (),
    statuses: Sequence[str] = (),
    categories: Sequence[str] = (),
    key: str | None = None,
    older_than: timedelta | None = None,
    newer_than: timedelta | None = None,
) -> store.Filter:
    now = utcnow()
    if key is not None and not key.strip("*"):
        raise click.BadParameter("must not be empty", param_hint="'--key'")
    return store.Filter(
        ids=tuple(ids),
        statuses=tuple(statuses),
        categories=tuple(categories),
        key=key,
        created_before=None if older_than is None else now - older_than,
        created_after=None if newer_than is None else now - newer_than,
    )


def _text(value: Any) -> str:
    """One value as the text output shows it: a timestamp in UTC to the second with ``Z``
    (``2026-12-01T12:00:00Z``, as in the logs and ``--json``), a number as itself, None as
    nothing, a list joined with ``, ``; control characters (a driver's multi-line error)
    escaped so a value keeps to its line."""
    if isinstance(value, datetime):
        return utc_iso(value, "seconds")
    value = plain(value)
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ", ".join(_text(item) for item in value)
    text = json.dumps(value) if isinstance(value, dict) else str(value)
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """Rows as aligned columns; ages (floats) to a tenth of a second, long text cut at 48."""

    def cell(value: Any) -> str:
        number = plain(value) if isinstance(value, float | Decimal) else None
        if isinstance(number, float):
            return f"{number:.1f}"
        text = _text(value)
        return text if len(text) <= 48 else text[:45] + "..."

    cells = [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


@contextlib.contextmanager
def _database(url: str) -> Iterator[sa.Engine]:
    """The engine for one command, connected and its schema checked (a start-up problem is
    one line, exit code 2); a database error later ends the command with one line."""
    engine = open_database(url)
    try:
        yield engine
    except sa.exc.DBAPIError as exc:
        raise click.ClickException(f"database error: {first_line(exc)}") from None
    finally:
        engine.dispose()


def _json(value: Any) -> str:
    """``value`` as the commands' ``--json`` prints it: indented, keys sorted, made plain by
    :func:`relay.formats.plain` (timestamps ISO 8601 in UTC with ``Z``, numbers as numbers,
    None as null)."""
    return json.dumps(plain(value), indent=2, sort_keys=True)


def _os_user() -> str:
    """The operator's name when ``--actor`` is not given: the OS user, as ``getpass`` finds
    it (``LOGNAME``, ``USER``, ..., then the password database); ``unknown`` in a container
    that has none."""
    try:
        return getpass.getuser() or "unknown"
    except (KeyError, OSError):
        return "unknown"


_ACTOR_LENGTH = 128  # "operator:" + it fits outbox_attempts.relay_id (255)


def _check_actor(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
    if value is None:
        return _os_user()
    if not 1 <= len(value) <= _ACTOR_LENGTH or not value.isprintable() or value != value.strip():
        raise click.BadParameter(
            f"must be 1 to {_ACTOR_LENGTH} printable characters without surrounding spaces"
        )
    return value


_actor = option(
    "--actor",
    callback=_check_actor,
    show_default=False,
    help="Who is acting, as the operators' log records it (default: the OS user).",
)


def _operator(actor: str) -> str:
    """The ``relay_id`` of an operator's attempt rows."""
    return f"operator:{actor}"


def _detail(**fields: Any) -> str:
    """The ``detail`` of a log row: its facts as compact JSON, keys sorted."""
    return json.dumps(plain(fields), sort_keys=True, separators=(",", ":"))


def _action(
    at: datetime,
    actor: str,
    action: OperatorAction,
    *,
    message_id: int | None = None,
    address: str | None = None,
    reason: str | None = None,
    detail: str | None = None,
) -> dict[str, Any]:
    return {
        "at": at,
        "actor": actor,
        "action": action.value,
        "message_id": message_id,
        "address": address,
        "reason": reason,
        "detail": detail,
    }


def _log(conn: sa.Connection, rows: Sequence[dict[str, Any]]) -> None:
    """log_actions -- Append rows to the operators' log, in the caller's transaction (one
    executemany for a batch)."""
    if rows:
        conn.execute(sa.insert(operator_actions), list(rows))


def _lock_statuses(
    conn: sa.Connection, ids: Sequence[int], allowed: Sequence[str] | None = None
) -> dict[int, str]:
    """lock_for_change -- The status of each of ``ids`` (only those in ``allowed``, when
    given), the rows locked ``FOR UPDATE`` on PostgreSQL and MariaDB until the transaction
    ends: the status logged as a change's ``from`` is the one the change replaced. A relay's
    claim skips the locked rows (``SKIP LOCKED``); this waits for a claim that holds one."""
    stmt = sa.select(messages.c.id, messages.c.status).where(messages.c.id.in_(ids))
    if allowed is not None:
        stmt = stmt.where(messages.c.status.in_(allowed))
    return {row.id: row.status for row in conn.execute(stmt.with_for_update())}


# -- read -----------------------------------------------------------------------------------

_LIFE_ORDER = {s.value: n for n, s in enumerate(Status)}  # the state machine's order
_REPORT_ORDER: dict[str, Callable[[dict[str, Any]], tuple[Any, ...]]] = {
    "status_summary": lambda r: (r["category"], _LIFE_ORDER.get(r["status"], 99), r["status"]),
    "lag": lambda r: (r["category"],),
    "failures": lambda r: (r["category"], r["error_code"] is None, r["error_code"] or ""),
    "relay_health": lambda r: (r["relay_id"],),
}


def _report(conn: sa.Connection) -> dict[str, Any]:
    """What ``status`` shows, each view's rows in a stable order: by category, then status in
    the order of a message's life (pending, retrying, processing, sent, failed,
    unknown_outcome, cancelled, expired), or error code (none last); relays by id."""
    report: dict[str, Any] = {
        view: sorted(store.read_view(conn, f"outbox_{view}"), key=order)
        for view, order in _REPORT_ORDER.items()
    }
    report["unknown_outcomes"] = store.count_messages(
        conn, store.Filter(statuses=(Status.UNKNOWN_OUTCOME.value,))
    )
    report["delivery_summary"] = sorted(_delivery_summary(conn), key=lambda r: r["category"])
    report["event_intake"] = _event_intake(conn)
    return report


_COUNT, _SECONDS, _TIME = sa.Integer(), sa.Float(), UTCDateTime()
_DELIVERY_COUNTS = ("sent", *(s.value for s in DeliveryStatus), "no_event")


def _delivery_summary(conn: sa.Connection) -> list[dict[str, Any]]:
    """read_delivery_summary -- ``outbox_delivery_summary``, typed alike on every backend
    (counts as ints, rates as floats)."""
    types: dict[str, Any] = {f"{c}_count": _COUNT for c in _DELIVERY_COUNTS}
    stmt = sa.text("SELECT * FROM outbox_delivery_summary").columns(
        **types, bounce_rate=_SECONDS, complaint_rate=_SECONDS
    )
    return [dict(r._mapping) for r in conn.execute(stmt)]


def _event_intake(conn: sa.Connection) -> dict[str, Any]:
    """read_event_intake -- ``outbox_event_intake``'s one row, typed alike on every backend;
    the counts 0, not NULL, when no event came in 24 hours."""
    stmt = sa.text("SELECT * FROM outbox_event_intake").columns(
        events_24h=_COUNT,
        unmatched_24h=_COUNT,
        malformed_24h=_COUNT,
        newest_received_at=_TIME,
        newest_age_seconds=_SECONDS,
        newest_event_at=_TIME,
    )
    intake = dict(conn.execute(stmt).one()._mapping)
    for name in ("events_24h", "unmatched_24h", "malformed_24h"):
        intake[name] = intake[name] or 0
    return intake


# SES reviews an account at these rates (its documentation): status says when a category nears
_BOUNCE_REVIEW, _COMPLAINT_REVIEW = 0.05, 0.001


def _rate(value: float | None) -> str:
    return "" if value is None else f"{value * 100:.2f}%"


@click.command()
@database_url
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(database_url: str, as_json: bool) -> None:
    """What the outbox holds: counts per status and category, lag, failures, relays, what the
    provider's events say of the last 24 hours, and whether they are still coming in."""
    with _database(database_url) as engine, engine.connect() as conn:
        report = _report(conn)
    if as_json:
        click.echo(_json(report))
        return
    summary = report["status_summary"]
    click.echo("Messages by status and category")
    click.echo(
        _table(summary, ["category", "status", "message_count", "oldest_created_at"])
        if summary
        else "  (none)"
    )
    click.echo("\nDue now (lag = age of the oldest due message)")
    lag = report["lag"]
    click.echo(
        _table(lag, ["category", "due_count", "oldest_due_at", "lag_seconds"])
        if lag
        else "  nothing due"
    )
    click.echo(
        f"\nunknown_outcome: {report['unknown_outcomes']} (outbox-relay list --status "
        "unknown_outcome; check with SES, then outbox-relay resolve ID --delivered or "
        "--not-delivered)"
    )
    _echo_delivery(report["delivery_summary"], report["event_intake"])
    if report["failures"]:
        click.echo("\nFailures by error code")
        click.echo(
            _table(report["failures"], ["category", "error_code", "message_count", "newest_at"])
        )
    click.echo("\nRelays")
    relays = report["relay_health"]
    click.echo(
        _table(relays, ["relay_id", "state", "host", "pid", "heartbeat_age_seconds"])
        if relays
        else "  none registered"
    )


def _echo_delivery(summary: list[dict[str, Any]], intake: dict[str, Any]) -> None:
    click.echo("\nDelivery of the last 24 hours by category (from provider events)")
    if summary:
        shown = [
            {
                **row,
                "bounce_rate": _rate(row["bounce_rate"]),
                "complaint_rate": _rate(row["complaint_rate"]),
            }
            for row in summary
        ]
        columns = ["category", "sent_count", "delivered_count", "bounced_count"]
        columns += ["complained_count", "suppressed_count", "no_event_count"]
        columns += ["bounce_rate", "complaint_rate"]
        click.echo(_table(shown, columns))
        for row in summary:
            if (row["bounce_rate"] or 0) >= _BOUNCE_REVIEW / 2:
                click.echo(f"  {row['category']}: bounce rate near SES's 5% review level")
            if (row["complaint_rate"] or 0) >= _COMPLAINT_REVIEW / 2:
                click.echo(f"  {row['category']}: complaint rate near SES's 0.1% review level")
    else:
        click.echo("  nothing sent")
    click.echo("\nEvent intake")
    if intake["newest_received_at"] is None:
        click.echo("  no event ever received (no intake running, or no event destination)")
        return
    click.echo(
        f"  {intake['events_24h']} event(s) in 24 h, {intake['unmatched_24h']} unmatched, "
        f"{intake['malformed_24h']} malformed; newest received "
        f"{_text(intake['newest_received_at'])} ({intake['newest_age_seconds']:.1f} s ago)"
    )


@click.command(name="list")
@database_url
@_filters
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@click.option("--after-id", type=int, help="Page on: show ids after this one.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_(database_url: str, limit: int, after_id: int | None, as_json: bool, **f: Any) -> None:
    """List messages, oldest id first, with filters and paging."""
    flt = _filter(**f)
    with _database(database_url) as engine, engine.connect() as conn:
        rows = [
            dict(r._mapping) for r in store.list_messages(conn, flt, limit=limit, after_id=after_id)
        ]
    if as_json:
        click.echo(_json(rows))
        return
    if not rows:
        click.echo("no messages match")
        return
    click.echo(
        _table(
            rows,
            [
                "id",
                "status",
                "category",
                "idempotency_key",
                "recipients",
                "subject",
                "attempt_count",
                "next_attempt_at",
                "last_error_code",
            ],
        )
    )
    if len(rows) == limit:
        click.echo(f"... more: --after-id {rows[-1]['id']}")


@click.command()
@database_url
@click.argument("message_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--body",
    type=click.Choice(["text", "raw"]),
    is_flag=False,
    flag_value="text",
    default=None,
    help="Also show the email, which holds personal data (a note on stderr says so): its "
    "headers and text, its html and attachments listed with their sizes; `--body raw`: the "
    "whole MIME message.",
)
def show(database_url: str, message_id: int, as_json: bool, body: str | None) -> None:
    """One message, every attempt made for it, the provider events matched to it and what
    operators did to it (its body only with --body)."""
    with _database(database_url) as engine, engine.connect() as conn:
        row, history = store.get_message(conn, message_id)
        seen = _events_of(conn, message_id) if row is not None else []
        done = _actions_on(conn, message_id) if row is not None else []
    if row is None:
        raise click.ClickException(f"no message with id {message_id}")
    message = dict(row._mapping)
    payload = message.pop("payload") or {}
    message["attachments"] = [a.get("filename") for a in payload.get("attachments", [])]
    message["template"] = payload.get("template")
    attempts = [dict(a._mapping) for a in history]
    content = None if body is None else _body(payload, raw=body == "raw")
    if body is not None:  # bodies are personal data: say on stderr that one is shown
        click.echo(f"Note: showing the body of message {message_id} (personal data)", err=True)
    if as_json:
        report: dict[str, Any] = {
            "message": message,
            "attempts": attempts,
            "events": seen,
            "operator_actions": done,
        }
        if content is not None:
            report["body"] = content
        click.echo(_json(report))
        return
    if message["status"] == Status.SENT.value and message["delivery_status"] is None:
        message["delivery_status"] = "(no provider event recorded)"
    width = max(len(k) for k in message)
    for name, value in message.items():
        if value not in (None, [], ""):
            click.echo(f"{name.ljust(width)}  {_text(value)}")
    click.echo(f"\nattempts ({len(attempts)})")
    if attempts:
        click.echo(
            _table(
                attempts,
                [
                    "id",
                    "outcome",
                    "relay_id",
                    "started_at",
                    "finished_at",
                    "error_code",
                    "provider_message_id",
                    "error_message",
                ],
            )
        )
    click.echo(f"\nevents ({len(seen)})")
    if seen:
        click.echo(
            _table(
                seen,
                ["event_type", "event_at", "received_at", "detail", "recipients", "effect"],
            )
        )
    click.echo(f"\noperator actions ({len(done)})")
    if done:
        click.echo(_table(done, ["at", "actor", "action", "reason", "detail"]))
    if content is not None:
        _echo_body(content)


def _body(payload: Any, *, raw: bool) -> dict[str, Any]:
    """What ``show --body`` shows of a stored email: its headers (``Bcc`` too), text, html,
    attachments (their sizes, not their content) and template; with ``raw`` the whole MIME
    message as the library renders it (a sender adds ``Date``, ``Message-ID`` and the outbox
    id header when it sends). A payload that is no email, or a template email asked for raw,
    gives ``{"error": ...}``."""
    try:
        email = Email.from_payload(payload)
    except Exception as exc:  # any row the relay fails as invalid_payload
        return {"error": f"the payload is not a valid email ({exc})"}
    if raw:
        if email.template is not None:
            return {
                "error": "a template email is rendered by SES: no MIME to show (--body "
                "shows its template data)"
            }
        mime = email.to_mime()
        return {"raw": mime.as_string(policy=mime.policy.clone(linesep="\n"))}
    headers = {"From": email.sender}
    for name, addresses in (
        ("To", email.to),
        ("Cc", email.cc),
        ("Bcc", email.bcc),
        ("Reply-To", email.reply_to),
    ):
        if addresses:
            headers[name] = ", ".join(addresses)
    if email.subject is not None:
        headers["Subject"] = email.subject
    headers.update(email.headers)
    return {
        "headers": headers,
        "text": email.text,
        "html": email.html,
        "attachments": [
            {
                "filename": a.filename,
                "content_type": a.content_type,
                "disposition": a.disposition,
                "content_id": a.content_id,
                "size": len(a.content),
            }
            for a in email.attachments
        ],
        "template": email.template,
        "template_data": None if email.template_data is None else dict(email.template_data),
    }


def _echo_body(content: dict[str, Any]) -> None:
    """The text output of ``show --body``: the html and attachments by size only (``--json``
    has the html); control characters escaped, as in :func:`_text`, but for line ends."""

    def shown(text: str) -> str:
        return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)

    if "error" in content:
        click.echo(f"\nbody: {content['error']}")
        return
    if "raw" in content:
        click.echo("\nbody (MIME)")
        click.echo(shown(content["raw"]))
        return
    click.echo("\nbody")
    width = max(len(name) for name in content["headers"])
    for name, value in content["headers"].items():
        click.echo(f"{name.ljust(width)}  {_text(value)}")
    if content["template"] is not None:
        click.echo(f"\ntemplate  {_text(content['template'])}")
        click.echo(f"data      {_text(content['template_data'])}")
    for part in ("text", "html"):
        value = content[part]
        if value is None:
            continue
        size = len(value.encode("utf-8", "surrogatepass"))
        if part == "text":
            text = shown(value).removesuffix("\n")  # echo ends the last line
            click.echo(f"\ntext ({size:,} bytes)\n{text}")
        else:
            click.echo(f"\nhtml ({size:,} bytes; --json or --body raw shows it)")
    if content["attachments"]:
        click.echo(f"\nattachments ({len(content['attachments'])})")
        columns = ["filename", "content_type", "disposition", "content_id", "size"]
        click.echo(_table(content["attachments"], columns))


def _events_of(conn: sa.Connection, message_id: int) -> list[dict[str, Any]]:
    """events_of -- The provider events matched to a message, in the order they came."""
    stmt = (
        sa.select(
            events.c.event_type,
            events.c.event_at,
            events.c.received_at,
            events.c.detail,
            events.c.recipients,
            events.c.effect,
            events.c.provider_message_id,
            events.c.source,
        )
        .where(events.c.message_id == message_id)
        .order_by(events.c.id)
    )
    return [dict(r._mapping) for r in conn.execute(stmt)]


def _actions_on(conn: sa.Connection, message_id: int) -> list[dict[str, Any]]:
    """actions_on -- The operators' log rows of a message, oldest first."""
    stmt = (
        sa.select(
            operator_actions.c.at,
            operator_actions.c.actor,
            operator_actions.c.action,
            operator_actions.c.reason,
            operator_actions.c.detail,
        )
        .where(operator_actions.c.message_id == message_id)
        .order_by(operator_actions.c.id)
    )
    return [dict(r._mapping) for r in conn.execute(stmt)]


# -- change ---------------------------------------------------------------------------------


def _some(items: Iterable[str], shown: int = 10) -> str:
    """The first ``shown`` items and how many more: a refusal of 70,000 ids stays one line."""
    listed = list(items)
    more = f" and {len(listed) - shown} more" if len(listed) > shown else ""
    return ", ".join(listed[:shown]) + more


def _select(
    conn: sa.Connection, ids: Sequence[int], flt: store.Filter, allowed: Iterable[str], verb: str
) -> list[int]:
    """The ids a command will change; refuses, changing nothing, if any given id is unknown or
    in a status the command cannot change."""
    allowed = tuple(allowed)
    if ids:
        found = store.statuses_of(conn, ids)
        missing = [i for i in ids if i not in found]
        if missing:
            raise click.ClickException(f"no message with id {_some(map(str, missing))}")
        wrong = [f"{i} ({found[i]})" for i in ids if found[i] not in allowed]
        if wrong:
            raise click.ClickException(
                f"cannot {verb} {_some(wrong)}: only {' or '.join(allowed)} messages"
            )
        return list(ids)
    statuses = flt.statuses or allowed
    bad = [s for s in statuses if s not in allowed]
    if bad:
        raise click.BadParameter(
            f"cannot {verb} {', '.join(bad)} messages", param_hint="'--status'"
        )
    return store.message_ids(conn, store.Filter(**{**_fields(flt), "statuses": tuple(statuses)}))


def _fields(flt: store.Filter) -> dict[str, Any]:
    return {name: getattr(flt, name) for name in store.Filter.__dataclass_fields__}


CHANGE_BATCH = 500  # rows per transaction of requeue and cancel: short locks, few round trips


def _show_progress() -> bool:
    """A progress bar only on a terminal: pipes, logs and ``--json`` readers get the result."""
    return sys.stderr.isatty()


@contextlib.contextmanager
def _progress(total: int, label: str) -> Iterator[Callable[[int], None]]:
    """``advance(n)`` for a bulk change: a bar on stderr when it is a terminal, else nothing."""
    if not _show_progress() or total == 0:
        yield lambda n: None
        return
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        yield bar.update


class _Interrupted(click.ClickException):
    """A bulk change stopped part way (Ctrl-C or a database error): what was done, what not."""

    def __init__(
        self, message: str, done: Sequence[int] = (), unchanged: Sequence[int] = (), count: int = 0
    ) -> None:
        super().__init__(message)
        self.done, self.unchanged, self.count = list(done), list(unchanged), count

    @property
    def why(self) -> str:
        """``interrupted`` or ``database error``: the ``interrupted`` field of ``--json``."""
        return self.message.split(":", 1)[0]


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
    flt = _filter(**filters)
    with _database(database_url) as engine:
        with engine.connect() as conn:
            chosen = sorted(set(_select(conn, ids, flt, allowed, verb)))
        if not ids and not yes:
            raise click.UsageError(f"{len(chosen)} messages match; add --yes to {verb} them all")
        try:
            done = _in_batches(
                engine,
                chosen,
                reason,
                _Change(actor=actor, verb=verb, done_as=done_as, action=action, allowed=allowed),
                by_id=bool(ids),
                apply=apply,
            )
        except _Interrupted as stopped:
            if as_json:  # a script learns exactly which ids are done and which to give again
                click.echo(
                    _json(
                        {
                            "command": verb,
                            "interrupted": stopped.why,
                            "matched": len(chosen),
                            done_as: len(stopped.done),
                            f"{done_as}_ids": stopped.done,
                            "unchanged_ids": stopped.unchanged,
                        }
                    )
                )
            raise
    left = sorted(set(chosen) - set(done))
    if as_json:
        click.echo(
            _json(
                {
                    "command": verb,
                    "matched": len(chosen),
                    done_as: len(done),
                    "moved_meanwhile": len(left),
                    f"{done_as}_ids": done,
                    "moved_meanwhile_ids": left,
                }
            )
        )
        return
    tail = f" ({len(left)} moved meanwhile and were left alone)" if left else ""
    click.echo(f"{done_as} {len(done)} message(s){tail}")


@dataclass(frozen=True, kw_only=True, slots=True)
class _Change:
    """What a bulk change does and how it is recorded."""

    actor: str
    verb: str  # the command: requeue, cancel
    done_as: AttemptOutcome  # the attempt rows' outcome, and the past tense of the output
    action: OperatorAction  # the log rows' action
    allowed: Sequence[str]  # the statuses it changes


def _in_batches(
    engine: sa.Engine,
    chosen: Sequence[int],
    reason: str | None,
    change: _Change,
    *,
    by_id: bool,
    apply: Callable[..., list[int]],
) -> list[int]:
    """The ids changed, batch by batch in id order. Stopped part way, it says how far it got:
    the batches before are committed, the rest unchanged, so running it again finishes it --
    with the same filters, or with the given ids not yet reached (the same ids again would be
    refused: the ones done are no longer in a status the command changes)."""
    done: list[int] = []
    reached = 0  # how many of ``chosen`` the committed batches covered
    committing: list[int] = []  # the changes of a batch whose COMMIT is under way
    verb, done_as, actor = change.verb, change.done_as, change.actor
    operator = _operator(actor)
    try:
        with _progress(len(chosen), f"{verb} {len(chosen)} message(s)") as advance:
            for start in range(0, len(chosen), CHANGE_BATCH):
                batch = chosen[start : start + CHANGE_BATCH]
                with engine.begin() as conn:
                    now = read_database_time(conn)  # requeued rows are due by the relays' clock
                    before = _lock_statuses(conn, batch, change.allowed)
                    changed = apply(conn, ids=sorted(before), now=now)
                    store.record_attempts(
                        conn,
                        (_operator_attempt(i, now, operator, done_as, reason) for i in changed),
                    )
                    _log(
                        conn,
                        [
                            _action(
                                now,
                                actor,
                                change.action,
                                message_id=i,
                                reason=reason,
                                detail=_detail(previous_status=before[i]),
                            )
                            for i in changed
                        ],
                    )
                    committing, since, upto_batch = changed, now, start + len(batch)
                committing = []
                done += changed
                reached = start + len(batch)
                advance(len(batch))
    except (KeyboardInterrupt, sa.exc.DBAPIError) as exc:
        why = _why_stopped(exc)
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
        raise _Interrupted(
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


def _why_stopped(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return f"database error: {first_line(exc)}"


def _operator_attempt(
    message_id: int,
    now: datetime,
    operator: str,
    done_as: AttemptOutcome,
    reason: str | None,
) -> store.AttemptRecord:
    return store.AttemptRecord(
        message_id=message_id,
        claim_token=None,
        relay_id=operator,
        started_at=None,
        finished_at=now,
        outcome=done_as,
        error_message=reason,
    )


_as_json = click.option(
    "--json", "as_json", is_flag=True, help="Machine-readable result (counts and ids)."
)
_REQUEUEABLE = (Status.UNKNOWN_OUTCOME.value, Status.FAILED.value)


@click.command()
@database_url
@click.argument("ids", nargs=-1, type=int)
@_filters
@click.option("--reason", help="Why: recorded with the message's attempts.")
@click.option("--yes", is_flag=True, help="Confirm a bulk requeue (filters instead of ids).")
@_actor
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
        allowed=_REQUEUEABLE,
        apply=store.requeue_many,
    )  # fmt: skip


@click.command()
@database_url
@click.argument("ids", nargs=-1, type=int)
@_filters
@click.option("--reason", help="Why: recorded with the message's attempts.")
@click.option("--yes", is_flag=True, help="Confirm a bulk cancel (filters instead of ids).")
@_actor
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
        allowed=(Status.PENDING.value, Status.RETRYING.value),
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
_PROVIDER_ID_LENGTH = 255  # outbox_messages.provider_message_id


def _check_provider_id(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not (1 <= len(value) <= _PROVIDER_ID_LENGTH and value.isprintable()):
        raise click.BadParameter(f"must be 1 to {_PROVIDER_ID_LENGTH} printable characters")
    return value


def _mark_resolved(
    conn: sa.Connection,
    *,
    message_id: int,
    expected: str,
    now: datetime,
    provider_message_id: str | None,
) -> bool:
    """resolve_delivered -- A row an operator knows reached its recipient -> sent, by the
    database's clock, its claim fields cleared; the provider id replaced only when given.
    Conditional on the status the operator saw, so a relay or the event intake moving the
    row first makes this change nothing (no lost update)."""
    values: dict[str, Any] = {
        "status": Status.SENT.value,
        "sent_at": now,
        "claim_token": None,
        "lease_expires_at": None,
        "updated_at": now,
    }
    if provider_message_id is not None:
        values["provider_message_id"] = provider_message_id
    result = conn.execute(
        sa.update(messages)
        .where(messages.c.id == message_id, messages.c.status == expected)
        .values(**values)
    )
    return result.rowcount == 1


def _provider_id_of(conn: sa.Connection, message_id: int) -> str | None:
    stmt = sa.select(messages.c.provider_message_id).where(messages.c.id == message_id)
    return conn.execute(stmt).scalar_one_or_none()


@click.command()
@database_url
@click.argument("message_id", type=int)
@click.option("--delivered", is_flag=True, help="It reached its recipient: mark it sent.")
@click.option("--not-delivered", is_flag=True, help="It did not: requeue it (as `requeue` does).")
@click.option(
    "--provider-message-id",
    callback=_check_provider_id,
    help="With --delivered: the SES message id that proves it (kept on the row).",
)
@click.option("--reason", help="Why: recorded with the message's attempts and in the log.")
@_actor
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
    with _database(database_url) as engine, engine.begin() as conn:
        now = read_database_time(conn)
        previous = _lock_statuses(conn, [message_id]).get(message_id)
        if previous is None:
            raise click.ClickException(f"no message with id {message_id}")
        if delivered:
            result = _resolve_delivered(
                conn, message_id, previous, now, provider_message_id, reason, actor
            )
        else:
            result = _resolve_not_delivered(conn, message_id, previous, now, reason, actor)
    if as_json:
        click.echo(_json({"command": "resolve", "message_id": message_id, **result}))
        return
    how = "delivered: sent" if delivered else "not delivered: requeued"
    click.echo(f"resolved message {message_id} as {how} (was {previous})")


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
    earlier_id = _provider_id_of(conn, message_id)
    if not _mark_resolved(
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
            store.AttemptRecord(
                message_id=message_id,
                claim_token=None,
                relay_id=_operator(actor),
                started_at=None,
                finished_at=now,
                outcome=AttemptOutcome.RESOLVED,
                error_message=reason,
                provider_message_id=provider_message_id,
            )
        ],
    )
    facts: dict[str, Any] = {"previous_status": previous}
    if provider_message_id is not None:
        facts["provider_message_id"] = provider_message_id
        if earlier_id not in (None, provider_message_id):
            facts["previous_provider_message_id"] = earlier_id
    _log(
        conn,
        [
            _action(
                now,
                actor,
                OperatorAction.RESOLVE_DELIVERED,
                message_id=message_id,
                reason=reason,
                detail=_detail(**facts),
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
    if previous not in _REQUEUEABLE:
        raise click.ClickException(
            f"cannot resolve message {message_id} as not delivered: it is {previous}; only "
            f"{' or '.join(_REQUEUEABLE)} messages are requeued"
        )
    if store.requeue_many(conn, ids=[message_id], now=now) != [message_id]:
        raise click.ClickException(
            f"message {message_id} moved on from {previous} meanwhile; nothing changed"
        )
    store.record_attempts(
        conn,
        [_operator_attempt(message_id, now, _operator(actor), AttemptOutcome.REQUEUED, reason)],
    )
    _log(
        conn,
        [
            _action(
                now,
                actor,
                OperatorAction.RESOLVE_NOT_DELIVERED,
                message_id=message_id,
                reason=reason,
                detail=_detail(previous_status=previous),
            )
        ],
    )
    return {
        "resolution": "not_delivered",
        "status": Status.PENDING.value,
        "previous_status": previous,
        "actor": actor,
    }


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


def _prunable(cutoff: datetime, statuses: Sequence[str]) -> store.Filter:
    return store.Filter(statuses=tuple(statuses), created_before=cutoff, changed_before=cutoff)


def _count_prunable_events(
    conn: sa.Connection, cutoff: datetime, statuses: Sequence[str], unmatched_before: datetime
) -> int:
    """count_prunable_events -- The events a prune with these cutoffs would delete: those of
    the messages it deletes, and those matched to no message received before
    ``unmatched_before``."""
    of_old = sa.select(messages.c.id).where(*_prunable_where(cutoff, statuses))
    stmt = sa.select(sa.func.count()).where(
        sa.or_(
            events.c.message_id.in_(of_old),
            sa.and_(events.c.message_id.is_(None), events.c.received_at < unmatched_before),
        )
    )
    return int(conn.execute(stmt).scalar_one())


def _prunable_where(cutoff: datetime, statuses: Sequence[str]) -> list[sa.ColumnElement[bool]]:
    """The messages a prune deletes (as :func:`_prunable` for ``store.count_messages``)."""
    return [
        messages.c.status.in_(statuses),
        messages.c.created_at < cutoff,
        messages.c.updated_at < cutoff,
    ]


def _prune_messages(
    conn: sa.Connection, *, before: datetime, limit: int, statuses: Sequence[str]
) -> tuple[int, int]:
    """prune_messages -- Delete up to ``limit`` messages in ``statuses`` created and last
    changed before ``before``, with their attempts and events; (messages, events) deleted.
    Rows another transaction holds are skipped (``SKIP LOCKED``), and the delete re-checks
    the status, so a row that moved meanwhile stays."""
    ids = list(
        conn.execute(
            sa.select(messages.c.id)
            .where(*_prunable_where(before, statuses))
            .order_by(messages.c.id)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).scalars()
    )
    if not ids:
        return 0, 0
    conn.execute(sa.delete(attempts).where(attempts.c.message_id.in_(ids)))
    gone = conn.execute(sa.delete(events).where(events.c.message_id.in_(ids))).rowcount
    result = conn.execute(
        sa.delete(messages).where(messages.c.id.in_(ids), messages.c.status.in_(statuses))
    )
    return int(result.rowcount), int(gone)


def _prune_stopped_relays(conn: sa.Connection, *, before: datetime) -> int:
    """prune_stopped_relays -- Delete the rows of relays that stopped cleanly before
    ``before``: every rollout adds one per pod, and a stopped relay's id is free anyway. A
    relay that died without stopping keeps its row (its id is taken over when reused)."""
    return int(conn.execute(sa.delete(relays).where(_stopped_before(before))).rowcount)


def _count_stopped_relays(conn: sa.Connection, *, before: datetime) -> int:
    count = sa.select(sa.func.count()).select_from(relays).where(_stopped_before(before))
    return int(conn.execute(count).scalar_one())


def _stopped_before(before: datetime) -> sa.ColumnElement[bool]:
    """Relays that stopped cleanly, last heard of before ``before``."""
    return sa.and_(relays.c.state == RelayState.STOPPED.value, relays.c.heartbeat_at < before)


def _prune_unmatched_events(conn: sa.Connection, *, before: datetime, limit: int) -> int:
    """prune_unmatched_events -- Delete up to ``limit`` events matched to no message (another
    deployment's, foreign, malformed, or for a row already pruned) received before
    ``before``. They change nothing and dedupe nothing of ours (a redelivered one is only
    recorded again), so they need not wait for the dedup window: whoever can write to the
    events queue must not fill the table for a month."""
    ids = list(
        conn.execute(
            sa.select(events.c.id)
            .where(events.c.message_id.is_(None), events.c.received_at < before)
            .order_by(events.c.id)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).scalars()
    )
    if not ids:
        return 0
    return int(conn.execute(sa.delete(events).where(events.c.id.in_(ids))).rowcount)


def _log_prune(conn: sa.Connection, log_id: int | None, row: dict[str, Any]) -> int:
    """log_prune -- The prune's one log row: inserted with its first transaction, its counts
    brought up to date in each later one, so the row always says what the committed batches
    deleted."""
    if log_id is None:
        inserted = conn.execute(sa.insert(operator_actions).values(**row)).inserted_primary_key
        assert inserted is not None
        return int(inserted[0])
    conn.execute(
        sa.update(operator_actions)
        .where(operator_actions.c.id == log_id)
        .values(detail=row["detail"])
    )
    return log_id


@click.command()
@database_url
@option(
    "--older-than",
    type=_DURATION,
    required=True,
    show_default=False,
    help="Delete finished messages created and last changed longer ago than this.",
)
@option(
    "--dedup-window",
    type=_DURATION,
    default="30d",
    help="Never delete messages younger than this: a pruned key can be enqueued again.",
)
@option(
    "--unmatched-events-older-than",
    type=_DURATION,
    default="3d",
    help="Delete events matched to no message (unmatched, foreign, malformed) received longer "
    "ago than this, whatever --older-than and --dedup-window say.",
)
@option(
    "--stopped-relays-older-than",
    type=_DURATION,
    default="7d",
    help="Delete the outbox_relays rows of relays that stopped cleanly longer ago than this.",
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
@_actor
@click.option(
    "--json", "as_json", is_flag=True, help="Machine-readable result (counts, cutoff, clamping)."
)
def prune(
    database_url: str, older_than: timedelta, dedup_window: timedelta,
    unmatched_events_older_than: timedelta, stopped_relays_older_than: timedelta,
    batch_size: int, include_unknown_outcome: bool, dry_run: bool, actor: str, as_json: bool,
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
    """
    clamped = older_than < dedup_window
    statuses = _prunable_statuses(include_unknown_outcome)
    with _database(database_url) as engine:
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
            stopped_relays = _count_stopped_relays(conn, before=relays_cutoff) if dry_run else 0
            matched = (
                store.count_messages(conn, _prunable(cutoff, statuses))
                if dry_run or _show_progress()
                else None
            )
            matched_events = (
                _count_prunable_events(conn, cutoff, statuses, unmatched_cutoff) if dry_run else 0
            )
        facts = {
            "cutoff": cutoff,
            "older_than_seconds": older_than.total_seconds(),
            "dedup_window_seconds": dedup_window.total_seconds(),
            "unmatched_events_cutoff": unmatched_cutoff,
            "unmatched_events_older_than_seconds": unmatched_events_older_than.total_seconds(),
            "stopped_relays_older_than_seconds": stopped_relays_older_than.total_seconds(),
            "include_unknown_outcome": include_unknown_outcome,
        }
        interrupted: _Interrupted | None = None
        pruned = _Pruned()
        try:
            if not dry_run:
                _prune_batches(
                    engine, pruned, cutoff, batch_size, matched or 0,
                    statuses=statuses, unmatched_before=unmatched_cutoff,
                    relays_before=relays_cutoff,
                    log=_action(now, actor, OperatorAction.PRUNE), facts=facts,
                )  # fmt: skip
        except _Interrupted as stopped:  # --json still says how many went, then the line
            interrupted = stopped
    if as_json:
        counts = (
            {
                "would_delete": matched,
                "would_delete_events": matched_events,
                "would_delete_relays": stopped_relays,
            }
            if dry_run
            else {
                "deleted": pruned.messages,
                "deleted_events": pruned.events,
                "deleted_relays": pruned.relays,
            }
        )
        stop = {"interrupted": interrupted.why} if interrupted else {}
        click.echo(
            _json(
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
            f"would delete {matched} message(s) created before {_text(cutoff)}, and "
            f"{matched_events} event(s), and {stopped_relays} stopped relay row(s)"
        )
    else:
        click.echo(
            f"deleted {pruned.messages} message(s) created before {_text(cutoff)}, and "
            f"{pruned.events} event(s), and {pruned.relays} stopped relay row(s)"
        )


@dataclass(kw_only=True, slots=True)
class _Pruned:
    """What a prune's committed batches deleted so far."""

    messages: int = 0
    events: int = 0
    relays: int = 0


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
    log: dict[str, Any],
    facts: dict[str, Any],
) -> None:
    """Delete messages batch by batch until a batch comes back short, then the unmatched
    events received before ``unmatched_before``; each batch commits on its own with the
    prune's log row brought up to date.
    Stopped part way, it says how many were deleted (running it again goes on)."""
    log_id: int | None = None
    messages_done = False
    try:
        with _progress(expected, f"prune {expected} message(s)") as advance:
            while True:
                with engine.begin() as conn:
                    if log_id is None:  # the first batch: the stopped relays' rows, few
                        pruned.relays = _prune_stopped_relays(conn, before=relays_before)
                    if not messages_done:
                        count, gone = _prune_messages(
                            conn, before=cutoff, limit=batch_size, statuses=statuses
                        )
                    else:
                        count, gone = (
                            0,
                            _prune_unmatched_events(
                                conn, before=unmatched_before, limit=batch_size
                            ),
                        )
                    detail = _detail(
                        **facts,
                        deleted=pruned.messages + count,
                        deleted_events=pruned.events + gone,
                        deleted_relays=pruned.relays,
                    )
                    log_id = _log_prune(conn, log_id, {**log, "detail": detail})
                pruned.messages += count
                pruned.events += gone
                advance(count)
                if messages_done and gone < batch_size:
                    return
                if not messages_done and count < batch_size:
                    messages_done = True
    except (KeyboardInterrupt, sa.exc.DBAPIError) as exc:
        why = _why_stopped(exc)
        raise _Interrupted(
            f"{why}: deleted {pruned.messages} message(s) before it stopped; run the command "
            "again to delete the rest",
            count=pruned.messages,
        ) from None


# -- suppressions ---------------------------------------------------------------------------

_DETAIL_LENGTH = 255  # outbox_suppressions.detail
_SES_PAGE = 1000  # the most ListSuppressedDestinations returns a page


def _suppressed_address(text: str) -> str:
    """An address as ``outbox_suppressions`` keys it: its addr-spec in the canonical form
    :func:`outbox.message.validate_address` gives (a display name dropped), lower-cased, as
    the relay compares recipients before a send."""
    canonical = validate_address(text, "address")
    return address_key(canonical)


def _addresses(values: Iterable[str]) -> list[str]:
    """The given addresses, checked and keyed, in order, each once; any that is not an email
    address stops the command before anything changes, naming it."""
    keyed: list[str] = []
    bad: list[str] = []
    for value in values:
        try:
            address = _suppressed_address(value)
        except InvalidEmail:
            bad.append(repr(value))
            continue
        if address not in keyed:
            keyed.append(address)
    if bad:
        raise click.BadParameter(f"not an email address: {_some(bad)}", param_hint="'ADDRESS'")
    return keyed


def _suppressed(conn: sa.Connection, addresses: Sequence[str]) -> dict[str, Any]:
    """suppressed_rows -- The suppression rows of those of ``addresses`` that have one,
    locked ``FOR UPDATE`` (PostgreSQL, MariaDB) until the transaction ends."""
    found: dict[str, Any] = {}
    for start in range(0, len(addresses), CHANGE_BATCH):
        chunk = addresses[start : start + CHANGE_BATCH]
        stmt = sa.select(suppressions).where(suppressions.c.address.in_(chunk))
        found.update((r.address, r) for r in conn.execute(stmt.with_for_update()))
    return found


def _suppress(
    conn: sa.Connection,
    rows: Sequence[tuple[str, SuppressionReason, str | None]],
    *,
    now: datetime,
    actor: str,
    reason: str | None,
) -> None:
    """suppress -- Insert suppression rows (address, reason, detail) and their log rows."""
    if not rows:
        return
    conn.execute(
        sa.insert(suppressions),
        [
            {"address": a, "reason": r.value, "detail": d, "created_at": now, "actor": actor}
            for a, r, d in rows
        ],
    )
    _log(
        conn,
        [
            _action(
                now,
                actor,
                OperatorAction.SUPPRESS,
                address=a,
                reason=reason,
                detail=_detail(suppression_reason=r.value, suppression_detail=d),
            )
            for a, r, d in rows
        ],
    )


@click.group(name="suppressions")
def suppressions_() -> None:
    """The addresses the relay never mails (outbox_suppressions): list, add, remove, and
    import the SES account suppression list.

    Permanent bounces and complaints add addresses by themselves (through the event intake);
    these commands are for what an operator knows. Every add and remove is written to the
    operators' log.
    """


@suppressions_.command(name="list")
@database_url
@click.option(
    "--reason",
    "reasons",
    multiple=True,
    type=click.Choice([r.value for r in SuppressionReason]),
    help="Only suppressions for this reason (repeatable).",
)
@click.option("--limit", type=click.IntRange(1, 100_000), default=100, show_default=True)
@click.option("--after", "after", help="Page on: show addresses after this one.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def suppressions_list(
    database_url: str, reasons: tuple[str, ...], limit: int, after: str | None, as_json: bool
) -> None:
    """List suppressed addresses, in address order."""
    stmt = sa.select(suppressions).order_by(suppressions.c.address).limit(limit)
    if reasons:
        stmt = stmt.where(suppressions.c.reason.in_(reasons))
    if after is not None:
        stmt = stmt.where(suppressions.c.address > after)
    with _database(database_url) as engine, engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(stmt)]
    if as_json:
        click.echo(_json(rows))
        return
    if not rows:
        click.echo("no suppressed addresses match")
        return
    click.echo(_table(rows, ["address", "reason", "detail", "created_at", "actor", "event_id"]))
    if len(rows) == limit:
        click.echo(f"... more: --after {rows[-1]['address']}")


@suppressions_.command(name="add")
@database_url
@click.argument("addresses", metavar="ADDRESS...", nargs=-1, required=True)
@click.option(
    "--reason", required=True, help="Why (kept as the suppression's detail and in the log)."
)
@_actor
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result.")
def suppressions_add(
    database_url: str, addresses: tuple[str, ...], reason: str, actor: str, as_json: bool
) -> None:
    """Never mail these addresses again (reason manual). Addresses already suppressed are left
    as they are and named; all or nothing for the rest."""
    if not 1 <= len(reason) <= _DETAIL_LENGTH:
        raise click.BadParameter(
            f"must be 1 to {_DETAIL_LENGTH} characters", param_hint="'--reason'"
        )
    keyed = _addresses(addresses)
    with _database(database_url) as engine, engine.begin() as conn:
        now = read_database_time(conn)
        already = _suppressed(conn, keyed)
        added = [a for a in keyed if a not in already]
        _suppress(
            conn,
            [(a, SuppressionReason.MANUAL, reason) for a in added],
            now=now,
            actor=actor,
            reason=reason,
        )
    kept = {a: already[a].reason for a in keyed if a in already}
    if as_json:
        click.echo(_json({"command": "suppressions add", "added": added, "already": kept}))
        return
    click.echo(f"suppressed {len(added)} address(es)")
    if kept:
        click.echo(f"already suppressed: {_some(f'{a} ({r})' for a, r in kept.items())}")


@suppressions_.command(name="remove")
@database_url
@click.argument("addresses", metavar="ADDRESS...", nargs=-1, required=True)
@click.option("--reason", help="Why: recorded in the log.")
@_actor
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result.")
def suppressions_remove(
    database_url: str, addresses: tuple[str, ...], reason: str | None, actor: str, as_json: bool
) -> None:
    """Mail these addresses again. Refuses, changing nothing, if any is not suppressed (a
    mistyped address would otherwise pass unnoticed). The relay will send to them: remove an
    address SES also suppresses from the SES account list too, or SES drops the mail."""
    keyed = _addresses(addresses)
    with _database(database_url) as engine, engine.begin() as conn:
        now = read_database_time(conn)
        found = _suppressed(conn, keyed)
        missing = [a for a in keyed if a not in found]
        if missing:
            raise click.ClickException(f"not suppressed: {_some(missing)}; nothing removed")
        conn.execute(sa.delete(suppressions).where(suppressions.c.address.in_(keyed)))
        _log(
            conn,
            [
                _action(
                    now,
                    actor,
                    OperatorAction.UNSUPPRESS,
                    address=a,
                    reason=reason,
                    detail=_detail(
                        suppression_reason=found[a].reason,
                        suppression_detail=found[a].detail,
                        suppressed_at=found[a].created_at,
                        suppressed_by=found[a].actor,
                    ),
                )
                for a in keyed
            ],
        )
    if as_json:
        click.echo(_json({"command": "suppressions remove", "removed": keyed}))
        return
    click.echo(f"removed {len(keyed)} address(es) from the suppressions")


def _ses_suppressed() -> list[tuple[str, str]]:
    """Every (address, SES reason) of the SES account suppression list, page by page, through
    an SES v2 client from boto3's standard chain (region, credentials,
    ``AWS_ENDPOINT_URL_SESV2``), ``AWS_REGION`` read as the relay reads it. boto3 is imported
    here: it is the ``ses`` extra, and the other commands run without it."""
    try:
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        raise click.ClickException(
            "importing from SES needs boto3: pip install 'sqlalchemy-outbox[ses]'"
        ) from None
    session = boto3.session.Session()
    if not session.region_name and os.environ.get("AWS_REGION"):
        session = boto3.session.Session(region_name=os.environ["AWS_REGION"])
    if not session.region_name:
        raise click.ClickException("no AWS region configured (AWS_REGION or AWS_DEFAULT_REGION)")
    try:
        return _pages(session.client("sesv2"))
    except (BotoCoreError, ClientError) as exc:
        raise click.ClickException(f"SES: {first_line(exc)}") from None


def _pages(client: Any) -> list[tuple[str, str]]:
    listed: list[tuple[str, str]] = []
    token: str | None = None
    while True:
        page = client.list_suppressed_destinations(
            PageSize=_SES_PAGE, **({"NextToken": token} if token else {})
        )
        listed += [
            (item["EmailAddress"], item.get("Reason", ""))
            for item in page.get("SuppressedDestinationSummaries", [])
        ]
        token = page.get("NextToken")
        if not token:
            return listed


@suppressions_.command(name="import")
@database_url
@_actor
@click.option("--dry-run", is_flag=True, help="Count what would be added; add nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result.")
def suppressions_import(database_url: str, actor: str, dry_run: bool, as_json: bool) -> None:
    """Add the SES account suppression list (ListSuppressedDestinations) to the suppressions
    (reason ses, detail BOUNCE or COMPLAINT): only addresses not suppressed already. Uses
    boto3's configuration (AWS_REGION, credentials, AWS_ENDPOINT_URL_SESV2); needs the IAM
    action ses:ListSuppressedDestinations. Writes CHANGE_BATCH addresses per transaction, so
    an interrupted import goes on when run again."""
    with _database(database_url) as engine:
        listed = _ses_suppressed()
        wanted: dict[str, str] = {}
        refused: list[str] = []
        for address, why in listed:
            try:
                wanted.setdefault(_suppressed_address(address), why)
            except InvalidEmail:
                refused.append(repr(address))
        keyed = list(wanted)
        added: list[str] = []
        for start in range(0, len(keyed), CHANGE_BATCH):
            added += _import_batch(
                engine, keyed[start : start + CHANGE_BATCH], wanted, actor, dry_run
            )
    if refused:
        click.echo(f"skipped, not email addresses: {_some(refused)}", err=True)
    key = "would_add" if dry_run else "added"
    if as_json:
        click.echo(
            _json(
                {
                    "command": "suppressions import",
                    "dry_run": dry_run,
                    "listed": len(listed),
                    key: len(added),
                    f"{key}_addresses": added,
                    "already": len(keyed) - len(added),
                    "skipped": len(refused),
                }
            )
        )
        return
    verb = "would add" if dry_run else "added"
    click.echo(
        f"SES lists {len(listed)} address(es): {verb} {len(added)}, "
        f"{len(keyed) - len(added)} already suppressed"
    )


def _import_batch(
    engine: sa.Engine, batch: Sequence[str], why: dict[str, str], actor: str, dry_run: bool
) -> list[str]:
    """One transaction of an import: the batch's addresses not yet suppressed, added. An
    address the event intake suppressed meanwhile (a duplicate key) makes it try once more."""
    for attempt in range(2):
        try:
            with engine.begin() as conn:
                now = read_database_time(conn)
                present = _suppressed(conn, batch)
                new = [a for a in batch if a not in present]
                if not dry_run:
                    _suppress(
                        conn,
                        [(a, SuppressionReason.SES, why[a][:_DETAIL_LENGTH] or None) for a in new],
                        now=now,
                        actor=actor,
                        reason="imported from the SES account suppression list",
                    )
                return new
        except sa.exc.IntegrityError:
            if attempt:
                raise
    raise AssertionError("unreachable")


COMMANDS = (status, list_, show, requeue, cancel, resolve, prune, suppressions_)
