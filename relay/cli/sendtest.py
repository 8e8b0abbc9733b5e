"""``outbox-relay send-test``: one test message enqueued and followed until it is sent or
delivered (:mod:`relay.doctor.sendtest`'s)."""

from __future__ import annotations

import math

import click

from relay import doctor as preflight
from relay.cli_options import StartupError, database_url, open_database

__all__ = ["send_test"]


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise click.BadParameter(f"{value}: a number of seconds (nan would wait for ever)")
    return value


@click.command(name="send-test")
@database_url
@click.option("--to", required=True, help="Where the test message goes.")
@click.option(
    "--from",
    "sender",
    default=None,
    help="Its From address [default: the From of the newest message in the outbox].",
)
@click.option(
    "--wait",
    type=click.FloatRange(min=0, max=86400),
    callback=lambda _ctx, _param, value: _finite(value),  # nan passes FloatRange
    default=60.0,
    show_default=True,
    help="Seconds to wait for it to be sent (and delivered, while an event intake runs).",
)
def send_test(database_url: str, to: str, sender: str | None, wait: float) -> None:
    """Enqueue one test message (category outbox-test) and follow it: sent by a running
    relay, then, while an event intake runs, delivered. Exit code 0 once delivered (sent
    when no intake runs), 1 when it failed or the wait ran out."""
    engine = open_database(database_url)
    try:
        if sender is None:
            found = preflight.identities_in_use(engine)[0]
            if not found:
                raise StartupError(
                    "--from: no message in the outbox to take a From address from: pass --from"
                )
            sender = found[0]
        message_id, key = preflight.enqueue_test(engine, to=to, sender=sender)
        click.echo(f"message {message_id}: enqueued (key {key}) from {sender} to {to}")
        outcome = preflight.watch(engine, message_id, wait=wait, echo=click.echo)
    finally:
        engine.dispose()
    if not outcome.ok:
        queued = (
            f"; it stays queued (a relay started later sends it: outbox-relay cancel "
            f"{message_id} to drop it)"
            if outcome.state in ("pending", "retrying", "processing")
            else ""
        )
        raise click.ClickException(f"message {message_id}: {outcome.why}{queued}")
    click.echo(f"message {message_id}: {outcome.why}")
