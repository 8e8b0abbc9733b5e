"""The commands that read: ``status`` (what the outbox holds), ``list`` (messages, filtered and
paged) and ``show`` (one message, its attempts, events, operators' log rows and, asked for,
its body)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
import sqlalchemy as sa

from outbox.message import Email
from outbox.schema import Status
from relay import store
from relay.admin import options
from relay.admin.output import escaped, table, text, to_json
from relay.cli_options import database_url
from relay.store import operator as ops

__all__ = ["list_", "show", "status"]

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
    report["delivery_summary"] = sorted(
        ops.read_delivery_summary(conn), key=lambda r: r["category"]
    )
    report["event_intake"] = ops.read_event_intake(conn)
    return report


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
    with options.database(database_url) as engine, engine.connect() as conn:
        report = _report(conn)
    if as_json:
        click.echo(to_json(report))
        return
    summary = report["status_summary"]
    click.echo("Messages by status and category")
    click.echo(
        table(summary, ["category", "status", "message_count", "oldest_created_at"])
        if summary
        else "  (none)"
    )
    click.echo("\nDue now (lag = age of the oldest due message)")
    lag = report["lag"]
    click.echo(
        table(lag, ["category", "due_count", "oldest_due_at", "lag_seconds"])
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
            table(report["failures"], ["category", "error_code", "message_count", "newest_at"])
        )
    click.echo("\nRelays")
    relays = report["relay_health"]
    click.echo(
        table(relays, ["relay_id", "state", "host", "pid", "heartbeat_age_seconds"])
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
        click.echo(table(shown, columns))
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
        f"{text(intake['newest_received_at'])} ({intake['newest_age_seconds']:.1f} s ago)"
    )


@click.command(name="list")
@database_url
@options.filters
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@click.option("--after-id", type=int, help="Page on: show ids after this one.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_(database_url: str, limit: int, after_id: int | None, as_json: bool, **f: Any) -> None:
    """List messages, oldest id first, with filters and paging."""
    flt = options.to_filter(**f)
    with options.database(database_url) as engine, engine.connect() as conn:
        rows = [
            dict(r._mapping) for r in store.list_messages(conn, flt, limit=limit, after_id=after_id)
        ]
    if as_json:
        click.echo(to_json(rows))
        return
    if not rows:
        click.echo("no messages match")
        return
    click.echo(
        table(
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
    with options.database(database_url) as engine, engine.connect() as conn:
        row, history = store.get_message(conn, message_id)
        seen = ops.events_of(conn, message_id) if row is not None else []
        done = ops.actions_on(conn, message_id) if row is not None else []
    if row is None:
        raise click.ClickException(f"no message with id {message_id}")
    message = dict(row._mapping)
    payload = message.pop("payload") or {}
    dropped = message["body_dropped_at"]
    # a dropped body's attachments are unknown, not none (body_dropped_at says so)
    message["attachments"] = (
        None if dropped else [a.get("filename") for a in payload.get("attachments", [])]
    )
    message["template"] = payload.get("template")
    attempts = [dict(a._mapping) for a in history]
    content = None if body is None else _body(payload, raw=body == "raw")
    if content is not None and dropped:
        content = {"error": f"prune dropped it at {text(dropped)} (--keep-bodies)"}
    elif body is not None:  # bodies are personal data: say on stderr that one is shown
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
        click.echo(to_json(report))
        return
    if message["status"] == Status.SENT.value and message["delivery_status"] is None:
        message["delivery_status"] = "(no provider event recorded)"
    width = max(len(k) for k in message)
    for name, value in message.items():
        if value not in (None, [], ""):
            click.echo(f"{name.ljust(width)}  {text(value)}")
    click.echo(f"\nattempts ({len(attempts)})")
    if attempts:
        click.echo(
            table(
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
            table(
                seen,
                ["event_type", "event_at", "received_at", "detail", "recipients", "effect"],
            )
        )
    click.echo(f"\noperator actions ({len(done)})")
    if done:
        click.echo(table(done, ["at", "actor", "action", "reason", "detail"]))
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
    has the html); control characters escaped, as in :func:`text`, but for line ends."""
    if "error" in content:
        click.echo(f"\nbody: {content['error']}")
        return
    if "raw" in content:
        click.echo("\nbody (MIME)")
        click.echo(escaped(content["raw"], keep="\n\t"))
        return
    click.echo("\nbody")
    width = max(len(name) for name in content["headers"])
    for name, value in content["headers"].items():
        click.echo(f"{name.ljust(width)}  {text(value)}")
    if content["template"] is not None:
        click.echo(f"\ntemplate  {text(content['template'])}")
        click.echo(f"data      {text(content['template_data'])}")
    for part in ("text", "html"):
        value = content[part]
        if value is None:
            continue
        size = len(value.encode("utf-8", "surrogatepass"))
        if part == "text":
            shown = escaped(value, keep="\n\t").removesuffix("\n")  # echo ends the last line
            click.echo(f"\ntext ({size:,} bytes)\n{shown}")
        else:
            click.echo(f"\nhtml ({size:,} bytes; --json or --body raw shows it)")
    if content["attachments"]:
        click.echo(f"\nattachments ({len(content['attachments'])})")
        columns = ["filename", "content_type", "disposition", "content_id", "size"]
        click.echo(table(content["attachments"], columns))
