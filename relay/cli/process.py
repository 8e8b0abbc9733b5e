"""The commands that run until stopped: ``run``'s process once its sender and engine are built
(:func:`run_relay`: the relay, its listener, the event intake's thread, the HTTP server, the
signal handlers, the stop) and ``events`` (the intake alone); the intake they open, start and
stop, and the HTTP server they serve."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, cast

import click
import sqlalchemy as sa

from outbox.exceptions import ConfigurationError
from relay import logs
from relay.cli_options import StartupError, database_url, open_database, option
from relay.config import EVENTS_WAIT_RANGE, IntakeConfig, RelayConfig
from relay.db import READ_TIMEOUT
from relay.http import Server, start_http_server
from relay.intake import Intake, check_topic_arn
from relay.metrics import IntakeMetrics, RelayMetrics
from relay.senders import Sender
from relay.wakeup import Listener
from relay.worker import Relay

__all__ = ["WAIT_ENV", "events", "open_intake", "run_relay", "serve", "start_intake", "stop_intake"]

WAIT_ENV = "OUTBOX_EVENTS_WAIT_SECONDS"  # --wait-seconds of events, --events-wait-seconds of run
_INTAKE_JOIN_SECONDS = 15.0  # past its long poll, how long a stopping intake may take


def run_relay(
    config: RelayConfig,
    sender: Sender,
    engine: sa.Engine,
    *,
    intake_config: IntakeConfig | None,
    topic_arn: str | None,
    http_port: int | None,
    http_host: str,
) -> None:
    """``run`` once its sender and engine are built: the relay, the event intake (its thread),
    the listener, the HTTP server and the signal handlers, until stopped; then the stop."""
    relay = Relay(engine=engine, sender=sender, config=config)
    intake = (
        None
        if intake_config is None
        else open_intake(intake_config, engine, intake_id=relay.relay_id, topic_arn=topic_arn)
    )
    listener = Listener.for_engine(engine, relay.wake)
    server = None
    if http_port is not None:
        server = serve(relay, RelayMetrics(relay, intake=intake), http_port, http_host)
    intake_thread = None if intake is None else start_intake(intake)
    signals_seen = 0

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen > 1:
            logging.getLogger("relay").warning(
                "second signal: exiting now", extra={"action": "killed"}
            )
            os._exit(1)
        relay.request_stop()
        if intake is not None:
            intake.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if listener is not None:
        listener.start()
    try:
        relay.run()  # no outbox tables: a ConfigurationError, one line (see relay.cli._Commands)
    finally:
        if intake is not None and intake_thread is not None:
            stop_intake(intake, intake_thread)
        if server is not None:
            server.stop()
        if listener is not None:
            listener.stop()
        if not relay.in_flight:
            try:
                sender.close()
            except Exception as exc:  # every send is saved by now: a failing close changes nothing
                logging.getLogger("relay").error(
                    "the sender failed to close: %r", exc, extra={"action": "sender_error"}
                )
        engine.dispose()
    if relay.in_flight:  # drain deadline passed: do not wait on the sends' threads
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0)


def serve(relay: Relay, metrics: Any, port: int, host: str, **kw: Any) -> Server:
    try:
        return start_http_server(relay, metrics, port, host, **kw)
    except OSError as exc:
        raise StartupError(f"--http-port: cannot listen on {port}: {exc}") from None


def open_intake(
    config: IntakeConfig,
    engine: sa.Engine,
    *,
    exit_when_idle: bool = False,
    intake_id: str | None = None,
    topic_arn: str | None = None,
) -> Intake:
    """The intake of ``config`` on ``engine``, its queue checked: a queue that does not exist
    or cannot be read is a :class:`ConfigurationError` naming its URL; an SQS endpoint that
    does not answer yet is a warning (the loop reads the queue again before its first
    receive)."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError

        from relay.intake import build_client
    except ImportError as exc:
        raise ConfigurationError(
            "--events-queue-url",
            f"the event intake needs boto3 ({exc}): pip install 'sqlalchemy-outbox[ses]'",
        ) from None
    client = build_client(config.queue_url, wait_seconds=config.wait_seconds)
    intake = Intake(
        engine=engine,
        client=client,
        queue_url=config.queue_url,
        wait_seconds=config.wait_seconds,
        exit_when_idle=exit_when_idle,
        intake_id=intake_id,  # in a relay, its relay id: one name in outbox_relays and intakes
        topic_arn=topic_arn,
    )
    try:
        intake.check_queue()
    except (BotoCoreError, ClientError) as exc:
        logging.getLogger("relay.intake").warning(
            "cannot read the events queue %s yet: %s",
            config.queue_url,
            exc,
            extra={"action": "intake_sqs_error"},
        )
    return intake


def start_intake(intake: Intake) -> threading.Thread:
    def run_intake() -> None:
        try:
            intake.run()
        except Exception:  # a bug: the relay goes on sending, the log says the intake is gone
            logging.getLogger("relay.intake").exception(
                "the event intake stopped on an error", extra={"action": "intake_crashed"}
            )

    thread = threading.Thread(target=run_intake, name="outbox-intake", daemon=True)
    thread.start()
    return thread


def stop_intake(intake: Intake, thread: threading.Thread) -> None:
    """Stop the intake after its batch in hand (a long poll ends within its wait)."""
    intake.request_stop()
    thread.join(intake.wait_seconds + _INTAKE_JOIN_SECONDS)
    if thread.is_alive():
        logging.getLogger("relay.intake").warning(
            "the event intake did not stop in time; its messages in hand will be received "
            "again after their visibility timeout",
            extra={"action": "intake_stop_timeout"},
        )


@click.command()
@database_url
@option(
    "--events-queue-url",
    required=True,
    show_default=False,
    help="The SQS queue SES events arrive in (configuration set -> SNS -> SQS, or "
    "EventBridge -> SQS), with a dead-letter queue for what is not an SES event.",
)
@option(
    "--wait-seconds",
    env=WAIT_ENV,
    type=click.IntRange(*EVENTS_WAIT_RANGE),
    default=20,
    help="Seconds each receive waits for events (SQS long poll).",
)
@option(
    "--events-topic-arn",
    default=None,
    show_default=False,
    help="Apply only events from this SNS topic (EventBridge: from its account); others are "
    "recorded as foreign and change nothing. Default: every event is applied, whatever its "
    "topic.",
)
@option("--exit-when-idle", is_flag=True, help="Exit 0 once a receive finds the queue empty.")
@option(
    "--log-level",
    default="INFO",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@option("--log-format", default="text", type=click.Choice(["text", "json"]), help="Log lines.")
@option(
    "--http-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve /healthz, /readyz and /metrics on this port (default: off).",
)
@option(
    "--http-host",
    default="127.0.0.1",
    help="Address the HTTP endpoint listens on; 0.0.0.0 for probes from outside the host or "
    "container.",
)
def events(**options: Any) -> None:
    """Take SES events from an SQS queue and apply them to the outbox until stopped
    (SIGTERM/SIGINT: after the batch in hand). Any number of replicas may share a queue.

    A message is deleted from the queue only once its effect committed; one that is not an
    SES event is recorded and left there, so the queue's redrive policy moves it to its
    dead-letter queue.
    """
    logs.configure(options["log_level"], options["log_format"], False)
    if options["events_topic_arn"] is not None:
        check_topic_arn(options["events_topic_arn"])
    config = IntakeConfig(
        queue_url=options["events_queue_url"], wait_seconds=options["wait_seconds"]
    )
    engine = open_database(options["database_url"], read_timeout=READ_TIMEOUT)
    try:
        intake = open_intake(
            config,
            engine,
            exit_when_idle=options["exit_when_idle"],
            topic_arn=options["events_topic_arn"],
        )
        server = None
        if options["http_port"] is not None:
            # the HTTP app reads a relay's loop_at, waiting_at, state, paused and engine,
            # which the intake has under the same names
            server = serve(
                cast(Relay, intake),
                IntakeMetrics(intake),
                options["http_port"],
                options["http_host"],
                stall_seconds=max(60.0, 3.0 * config.wait_seconds),
            )
        seen = 0

        def on_signal(signum: int, frame: FrameType | None) -> None:
            nonlocal seen
            seen += 1
            if seen > 1:
                os._exit(1)
            intake.request_stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        try:
            intake.run()
        finally:
            if server is not None:
                server.stop()
    finally:
        engine.dispose()
