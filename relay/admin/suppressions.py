"""The ``suppressions`` commands: ``list``, ``add``, ``remove``, and ``import`` of the SES
account suppression list. Every add and remove is written to the operators' log in the
transaction of the change. ``add_manual``, ``remove`` and ``import_from_ses`` are the
commands' work without their output: the console runs them too."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

import click
import sqlalchemy as sa

from outbox.exceptions import InvalidEmail
from outbox.message import validate_address
from outbox.schema import OperatorAction, SuppressionReason, suppressions
from relay.admin import options
from relay.admin.batches import CHANGE_BATCH
from relay.admin.output import detail, some, table, to_json
from relay.cli_options import database_url, first_line
from relay.clock import read_database_time
from relay.recipients import address_key
from relay.store import operator as ops

__all__ = [
    "Imported",
    "SesBounds",
    "add_manual",
    "import_from_ses",
    "remove",
    "suppressions_",
    "suppressions_add",
    "suppressions_import",
    "suppressions_list",
    "suppressions_remove",
]

_DETAIL_LENGTH: int = cast(sa.String, suppressions.c.detail.type).length or 0
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
    keyed: dict[str, None] = {}  # ordered, and each seen in constant time
    bad: list[str] = []
    for value in values:
        try:
            address = _suppressed_address(value)
        except InvalidEmail:
            bad.append(repr(value))
            continue
        keyed.setdefault(address)
    if bad:
        raise click.BadParameter(f"not an email address: {some(bad)}", param_hint="'ADDRESS'")
    return list(keyed)


def _suppress(
    conn: sa.Connection,
    rows: Sequence[tuple[str, SuppressionReason, str | None]],
    *,
    now: datetime,
    actor: str,
    reason: str | None,
) -> None:
    """Suppression rows (address, reason, detail) and their log rows."""
    if not rows:
        return
    ops.add_suppressions(conn, rows, now=now, actor=actor)
    ops.log_actions(
        conn,
        [
            ops.LoggedAction(
                at=now,
                actor=actor,
                action=OperatorAction.SUPPRESS,
                address=a,
                reason=reason,
                detail=detail(suppression_reason=r.value, suppression_detail=d),
            )
            for a, r, d in rows
        ],
    )


def add_manual(
    engine: sa.Engine, addresses: Iterable[str], *, reason: str, actor: str
) -> tuple[list[str], dict[str, str]]:
    """Suppress ``addresses`` (reason manual) with their log rows, in one transaction (the
    command's and the console's): (the addresses added, those already suppressed with their
    reason). Refuses (:class:`click.ClickException`), changing nothing, an address that is
    not one or a reason of the wrong length."""
    if not 1 <= len(reason) <= _DETAIL_LENGTH:
        raise click.BadParameter(
            f"must be 1 to {_DETAIL_LENGTH} characters", param_hint="'--reason'"
        )
    keyed = _addresses(addresses)
    with engine.begin() as conn:
        now = read_database_time(conn)
        already = ops.suppressed_rows(conn, keyed)
        added = [a for a in keyed if a not in already]
        _suppress(
            conn,
            [(a, SuppressionReason.MANUAL, reason) for a in added],
            now=now,
            actor=actor,
            reason=reason,
        )
    return added, {a: already[a].reason for a in keyed if a in already}


def remove(
    engine: sa.Engine, addresses: Iterable[str], *, reason: str | None, actor: str
) -> list[str]:
    """Remove the suppressions of ``addresses`` with their log rows, in one transaction:
    the addresses removed. Refuses, changing nothing, if any is not suppressed."""
    keyed = _addresses(addresses)
    with engine.begin() as conn:
        now = read_database_time(conn)
        found = ops.suppressed_rows(conn, keyed)
        missing = [a for a in keyed if a not in found]
        if missing:
            raise click.ClickException(f"not suppressed: {some(missing)}; nothing removed")
        ops.remove_suppressions(conn, keyed)
        ops.log_actions(
            conn,
            [
                ops.LoggedAction(
                    at=now,
                    actor=actor,
                    action=OperatorAction.UNSUPPRESS,
                    address=a,
                    reason=reason,
                    detail=detail(
                        suppression_reason=found[a].reason,
                        suppression_detail=found[a].detail,
                        suppressed_at=found[a].created_at,
                        suppressed_by=found[a].actor,
                    ),
                )
                for a in keyed
            ],
        )
    return keyed


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
    with options.database(database_url) as engine, engine.connect() as conn:
        rows = ops.list_suppressions(conn, reasons=reasons, limit=limit, after=after)
    if as_json:
        click.echo(to_json(rows))
        return
    if not rows:
        click.echo("no suppressed addresses match")
        return
    click.echo(table(rows, ["address", "reason", "detail", "created_at", "actor", "event_id"]))
    if len(rows) == limit:
        click.echo(f"... more: --after {rows[-1]['address']}")


@suppressions_.command(name="add")
@database_url
@click.argument("addresses", metavar="ADDRESS...", nargs=-1, required=True)
@click.option(
    "--reason", required=True, help="Why (kept as the suppression's detail and in the log)."
)
@options.actor
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result.")
def suppressions_add(
    database_url: str, addresses: tuple[str, ...], reason: str, actor: str, as_json: bool
) -> None:
    """Never mail these addresses again (reason manual). Addresses already suppressed are left
    as they are and named; all or nothing for the rest."""
    with options.database(database_url) as engine:
        added, kept = add_manual(engine, addresses, reason=reason, actor=actor)
    if as_json:
        click.echo(to_json({"command": "suppressions add", "added": added, "already": kept}))
        return
    click.echo(f"suppressed {len(added)} address(es)")
    if kept:
        click.echo(f"already suppressed: {some(f'{a} ({r})' for a, r in kept.items())}")


@suppressions_.command(name="remove")
@database_url
@click.argument("addresses", metavar="ADDRESS...", nargs=-1, required=True)
@click.option("--reason", help="Why: recorded in the log.")
@options.actor
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result.")
def suppressions_remove(
    database_url: str, addresses: tuple[str, ...], reason: str | None, actor: str, as_json: bool
) -> None:
    """Mail these addresses again. Refuses, changing nothing, if any is not suppressed (a
    mistyped address would otherwise pass unnoticed). The relay will send to them: remove an
    address SES also suppresses from the SES account list too, or SES drops the mail."""
    with options.database(database_url) as engine:
        keyed = remove(engine, addresses, reason=reason, actor=actor)
    if as_json:
        click.echo(to_json({"command": "suppressions remove", "removed": keyed}))
        return
    click.echo(f"removed {len(keyed)} address(es) from the suppressions")


@dataclass(frozen=True, slots=True)
class SesBounds:
    """How long an import waits on SES: each request's connect and read timeouts (seconds),
    its attempts in all (botocore's standard retry mode: a throttled page backs off and is
    asked again), and ``total``, the seconds the whole listing may take (checked before
    each page; None: no limit)."""

    connect: float
    read: float
    attempts: int
    total: float | None = None


@dataclass(frozen=True, slots=True)
class Imported:
    """What an import of the SES account suppression list did, or would do (``dry_run``)."""

    dry_run: bool
    listed: int  # the entries SES listed
    added: tuple[str, ...]  # the addresses added (a dry run: that would be), keyed
    already: int  # listed addresses suppressed already: left as they are
    skipped: tuple[str, ...]  # listed entries that are not email addresses, quoted

    @property
    def summary(self) -> str:
        """The command's line: ``SES lists N address(es): added M, K already suppressed``."""
        verb = "would add" if self.dry_run else "added"
        return (
            f"SES lists {self.listed} address(es): {verb} {len(self.added)}, "
            f"{self.already} already suppressed"
        )


def import_from_ses(
    engine: sa.Engine, *, actor: str, dry_run: bool, bounds: SesBounds | None = None
) -> Imported:
    """Add the SES account suppression list to the suppressions (reason ses, detail BOUNCE or
    COMPLAINT), only the addresses not suppressed already, ``CHANGE_BATCH`` per transaction
    with their log rows under ``actor``; ``dry_run`` counts and adds nothing. The command's
    and the console's. ``bounds``: how long to wait on SES (None: botocore's defaults).
    Refuses (:class:`click.ClickException`, one line), adding nothing, when boto3, a region
    or credentials are missing or SES cannot be read."""
    listed = _ses_suppressed(bounds)
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
        added += _import_batch(engine, keyed[start : start + CHANGE_BATCH], wanted, actor, dry_run)
    return Imported(
        dry_run=dry_run,
        listed=len(listed),
        added=tuple(added),
        already=len(keyed) - len(added),
        skipped=tuple(refused),
    )


def _ses_suppressed(bounds: SesBounds | None) -> list[tuple[str, str]]:
    """Every (address, SES reason) of the SES account suppression list, page by page, through
    an SES v2 client from boto3's standard chain (region, credentials,
    ``AWS_ENDPOINT_URL_SESV2``), ``AWS_REGION`` read as the relay reads it. boto3 is imported
    here: it is the ``ses`` extra, and the other commands run without it."""
    try:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
    except ImportError:
        raise click.ClickException(
            "importing from SES needs boto3: pip install 'sqlalchemy-outbox[ses]'"
        ) from None
    session = boto3.session.Session()
    if not session.region_name and os.environ.get("AWS_REGION"):
        session = boto3.session.Session(region_name=os.environ["AWS_REGION"])
    if not session.region_name:
        raise click.ClickException("no AWS region configured (AWS_REGION or AWS_DEFAULT_REGION)")
    config = None
    if bounds is not None:
        config = Config(
            connect_timeout=bounds.connect,
            read_timeout=bounds.read,
            retries={"total_max_attempts": bounds.attempts, "mode": "standard"},
        )
    try:
        return _pages(session.client("sesv2", config=config), bounds)
    except NoCredentialsError:
        raise click.ClickException(
            "no AWS credentials found (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or a role)"
        ) from None
    except (BotoCoreError, ClientError) as exc:
        raise click.ClickException(f"SES: {first_line(exc)}") from None


def _pages(client: Any, bounds: SesBounds | None = None) -> list[tuple[str, str]]:
    listed: list[tuple[str, str]] = []
    token: str | None = None
    total = bounds.total if bounds is not None else None
    until = None if total is None else time.monotonic() + total
    while True:
        if token and until is not None and time.monotonic() > until:
            # a page at a time keeps the wait bounded; a list this long is the command's job
            raise click.ClickException(
                f"SES: the list took over {total:g} s to read ({len(listed)} address(es) so "
                "far): import it with outbox-relay suppressions import"
            )
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
@options.actor
@click.option("--dry-run", is_flag=True, help="Count what would be added; add nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable result.")
def suppressions_import(database_url: str, actor: str, dry_run: bool, as_json: bool) -> None:
    """Add the SES account suppression list (ListSuppressedDestinations) to the suppressions
    (reason ses, detail BOUNCE or COMPLAINT): only addresses not suppressed already. Uses
    boto3's configuration (AWS_REGION, credentials, AWS_ENDPOINT_URL_SESV2); needs the IAM
    action ses:ListSuppressedDestinations. Writes CHANGE_BATCH addresses per transaction, so
    an interrupted import goes on when run again."""
    with options.database(database_url) as engine:
        done = import_from_ses(engine, actor=actor, dry_run=dry_run)
    if done.skipped:
        click.echo(f"skipped, not email addresses: {some(done.skipped)}", err=True)
    key = "would_add" if dry_run else "added"
    if as_json:
        click.echo(
            to_json(
                {
                    "command": "suppressions import",
                    "dry_run": dry_run,
                    "listed": done.listed,
                    key: len(done.added),
                    f"{key}_addresses": list(done.added),
                    "already": done.already,
                    "skipped": len(done.skipped),
                }
            )
        )
        return
    click.echo(done.summary)


def _import_batch(
    engine: sa.Engine, batch: Sequence[str], why: dict[str, str], actor: str, dry_run: bool
) -> list[str]:
    """One transaction of an import: the batch's addresses not yet suppressed, added. An
    address suppressed meanwhile by the event intake or an operator (a duplicate key) makes
    it try once more."""
    for attempt in range(2):
        try:
            with engine.begin() as conn:
                now = read_database_time(conn)
                present = ops.suppressed_rows(conn, batch)
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
