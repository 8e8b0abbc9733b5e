"""The ``outbox-relay`` command line. Every option can also be set from an ``OUTBOX_*``
environment variable (shown in ``--help``)."""

from __future__ import annotations

import faulthandler
import importlib
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar, cast

import click
import sqlalchemy as sa
from alembic.util import CommandError

from outbox import migrations
from outbox.exceptions import ConfigurationError
from relay import admin, logs
from relay import doctor as preflight
from relay.cli_options import (
    StartupError,
    check_connection,
    check_file_exists,
    database_url,
    first_line,
    open_database,
    open_engine,
    option,
    safe_url,
    warn_secret_flag,
)
from relay.config import EVENTS_WAIT_RANGE, IntakeConfig, RelayConfig
from relay.db import READ_TIMEOUT
from relay.http import Server, start_http_server
from relay.intake import Intake, check_topic_arn
from relay.metrics import IntakeMetrics, RelayMetrics
from relay.senders import Sender, as_sender
from relay.senders.console import ConsoleSender
from relay.senders.file import FileSender
from relay.senders.smtp import DEFAULT_SECURITY, SECURITY_MODES, SmtpSender, SmtpSettings
from relay.wakeup import Listener
from relay.worker import Relay

_F = TypeVar("_F", bound=Callable[..., Any])

__all__ = [
    "alembic_revision",
    "build_sender",
    "doctor",
    "events",
    "main",
    "migrate",
    "run",
    "send_test",
]


class _Commands(click.Group):
    """The command group, and the one place where what escapes a command becomes one line:
    a bad setting (:class:`ConfigurationError`) exits 2 naming it, a database error exits 1;
    neither prints a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ConfigurationError as exc:
            raise StartupError(str(exc)) from None
        except sa.exc.DBAPIError as exc:
            raise click.ClickException(f"database error: {first_line(exc)}") from None


@click.group(
    cls=_Commands,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(package_name="sqlalchemy-outbox")
def main() -> None:
    """Deliver the outbox, and operate it."""
    _dump_stacks_on_sigusr1()


def _dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 PID`` prints every thread's stack to the process's stderr: what a relay
    that will not drain is waiting on, without stopping it. Not where stderr is no file (a
    command invoked in-process, as tests do)."""
    stderr = sys.__stderr__
    if stderr is None:
        return
    try:
        faulthandler.register(signal.SIGUSR1, file=stderr, all_threads=True)
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        return


for _command in admin.COMMANDS:
    main.add_command(_command)


@main.command()
@database_url
@click.option(
    "--revision",
    envvar="OUTBOX_REVISION",
    show_envvar=True,
    default="heads",
    show_default=True,
    help="Target revision; 'heads' applies everything shipped with this version.",
)
def migrate(database_url: str, revision: str) -> None:
    """Create or upgrade the outbox tables and views (standalone alembic environment).

    Revisions are recorded in outbox_alembic_version. Apps that run the outbox migrations
    through their own alembic (version_locations) do not need this command.
    """
    engine = open_engine(database_url)
    where = safe_url(engine)
    try:
        check_connection(engine)
        migrations.upgrade(engine, revision)
        applied, heads = migrations.current_heads(engine)
    except CommandError as exc:
        raise StartupError(
            f"--revision {revision!r}: {first_line(exc)}; use 'heads' (the default) or one of "
            f"{', '.join(_revisions())}"
        ) from None
    except sa.exc.DBAPIError as exc:
        raise click.ClickException(f"cannot migrate {where}: {first_line(exc)}") from None
    finally:
        engine.dispose()
    state = "up to date" if applied == heads else f"at {', '.join(sorted(applied)) or 'base'}"
    click.echo(f"outbox schema {state} on {where} (revision {', '.join(sorted(applied))})")


@main.command(name="alembic-revision")
@click.option(
    "--config",
    "-c",
    "config_file",
    default="alembic.ini",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="Your app's alembic.ini.",
)
@click.option(
    "--message", "-m", default="outbox schema", show_default=True, help="The revision's message."
)
def alembic_revision(config_file: str, message: str) -> None:
    """Carry the outbox schema on your app's own alembic branch: write a revision on your head
    that applies the outbox revisions your history does not hold yet (run it again after
    upgrading sqlalchemy-outbox). `alembic upgrade head` and `downgrade -1` then work as
    before; put outbox.migrations.include_object in your env.py."""
    from alembic.config import Config

    if not Path(config_file).is_file():
        raise StartupError(f"--config: {config_file}: no such file (your app's alembic.ini)")
    try:
        written = migrations.write_app_revision(Config(config_file), message)
    except CommandError as exc:
        raise click.ClickException(first_line(exc)) from None
    if written is None:
        click.echo("your alembic history carries every outbox revision of this release")
        return
    carried = ", ".join(written.module.outbox_revisions)
    click.echo(f"wrote {written.path} (revision {written.revision}: {carried})")


def _revisions() -> list[str]:
    """The revision ids shipped with this release, oldest first."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(migrations.alembic_config())
    return [rev.revision for rev in reversed(list(script.walk_revisions()))]


class _Rate(click.ParamType[Any]):
    name = "RATE|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value is None or value == "auto" or isinstance(value, float):
            return value
        try:
            return float(value)
        except ValueError:
            self.fail(f"{value!r} is neither a number nor 'auto'", param, ctx)


_RATE = _Rate()
_WAIT_ENV = "OUTBOX_EVENTS_WAIT_SECONDS"  # --wait-seconds of events, --events-wait-seconds of run
_INTAKE_JOIN_SECONDS = 15.0  # past its long poll, how long a stopping intake may take


def build_sender(spec: str, config: RelayConfig, options: dict[str, Any]) -> Sender:
    """``ses``, ``smtp``, ``console``, ``file`` (with ``--mail-dir``), or
    ``package.module:factory`` for a sender of your own (called with no arguments; configure
    it from the environment). What the factory returns
    needs only ``send``: the members it lacks get :class:`~relay.senders.BaseSender`'s
    defaults (:func:`~relay.senders.as_sender`)."""
    if spec == "console":
        return ConsoleSender()
    if spec == "file":
        if not options.get("mail_dir"):
            raise ConfigurationError(
                "--mail-dir",
                "is required with --sender file (or OUTBOX_MAIL_DIR): the folder each message "
                "is written to as an .eml file",
            )
        return FileSender(options["mail_dir"])  # a folder it cannot write: names --mail-dir
    if spec == "ses":
        try:
            from relay.senders.ses import SesSender, build_client
        except ImportError as exc:
            raise ConfigurationError(
                "--sender", f"ses needs boto3 ({exc}): pip install 'sqlalchemy-outbox[ses]'"
            ) from None
        client = build_client(send_timeout=config.send_timeout, concurrency=config.concurrency)
        return SesSender(client, configuration_set=options.get("ses_configuration_set"))
    if spec == "smtp":
        return _smtp_sender(config, options)
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(
            "--sender", f"{spec!r}: expected ses, smtp, console, file or package.module:factory"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError("--sender", f"{spec!r} cannot be loaded: {exc}") from None
    try:
        built = factory()
    except ConfigurationError:
        raise
    except Exception as exc:
        raise ConfigurationError(
            "--sender", f"{spec!r} could not build a sender: {type(exc).__name__}: {exc}"
        ) from None
    try:
        return as_sender(built)
    except TypeError as exc:
        raise ConfigurationError(
            "--sender",
            f"{spec!r} returned {exc}: subclass relay.senders.BaseSender and write send()",
        ) from None


def _smtp_sender(config: RelayConfig, options: dict[str, Any]) -> Sender:
    """``--sender smtp``: the ``--smtp-*`` flags as :class:`SmtpSettings`; the timeout of each
    connect and read is ``--send-timeout`` unless ``--smtp-timeout`` is shorter."""
    timeout = options.get("smtp_timeout")
    if timeout is not None and timeout > config.send_timeout:
        raise ConfigurationError(
            "--smtp-timeout",
            f"must be at most --send-timeout ({config.send_timeout:g}s): past it the relay "
            "has given up on the send",
        )
    settings = SmtpSettings(
        host=options.get("smtp_host") or "",
        port=options.get("smtp_port"),
        security=options.get("smtp_security") or DEFAULT_SECURITY,
        username=options.get("smtp_username"),
        password=options.get("smtp_password"),
        allow_cleartext_login=bool(options.get("smtp_allow_cleartext_login")),
        timeout=config.send_timeout if timeout is None else timeout,
    )
    return SmtpSender(settings)


def _smtp_options(timeout_help: str) -> Callable[[_F], _F]:
    """The ``--smtp-*`` options, as ``run`` and ``doctor`` both take them."""

    def apply(command: _F) -> _F:
        for decorate in reversed(
            [
                option("--smtp-host", default=None, help="SMTP server, with --sender smtp."),
                option(
                    "--smtp-port",
                    type=int,
                    default=None,
                    help="SMTP port [default: 465 for ssl, else 587].",
                ),
                option(
                    "--smtp-security",
                    type=click.Choice(SECURITY_MODES, case_sensitive=False),
                    default=DEFAULT_SECURITY,
                    help="How the SMTP connection is encrypted.",
                ),
                option(
                    "--smtp-username", default=None, help="SMTP user, if the server needs AUTH."
                ),
                option(
                    "--smtp-password",
                    default=None,
                    show_default=False,
                    callback=warn_secret_flag,
                    help="SMTP password (better as OUTBOX_SMTP_PASSWORD: a flag shows in the "
                    "process list).",
                ),
                option(
                    "--smtp-allow-cleartext-login",
                    is_flag=True,
                    default=False,
                    help="Allow the SMTP login over --smtp-security none (a server on a trusted "
                    "network).",
                ),
                option("--smtp-timeout", type=float, default=None, help=timeout_help),
            ]
        ):
            command = decorate(command)
        return command

    return apply


@main.command()
@database_url
@option(
    "--sender",
    default=None,
    show_default=False,
    help="Required: ses, smtp, package.module:factory, console (prints a masked line per "
    "message) or file (writes each message to --mail-dir); console and file deliver nothing: "
    "for local work only.",
)
@option(
    "--mail-dir",
    default=None,
    help="With --sender file: the folder each message is written to as an .eml file "
    "(created if missing).",
)
@option(
    "--ses-configuration-set",
    default=None,
    help="SES configuration set for mail that names none (events, dedicated IPs).",
)
@_smtp_options(
    "Seconds each SMTP connect and read may take; at most --send-timeout [default: --send-timeout]."
)
@option("--concurrency", type=int, default=8, help="Sends in flight at once (threads).")
@option("--batch-size", type=int, default=50, help="Most messages claimed per statement.")
@option("--lease-seconds", type=float, default=120.0, help="How long a claim is held.")
@option(
    "--send-timeout",
    type=float,
    default=20.0,
    help="Longest a whole provider call may take; past it its lease is no longer renewed.",
)
@option("--poll-interval", type=float, default=1.0, help="Seconds between polls when idle.")
@option(
    "--max-send-rate",
    type=_RATE,
    default=None,
    help="Recipients per second for all relays together (one budget in the database), "
    "over any one-second window; 'auto' reads the SES account's MaxSendRate (default: no limit).",
)
@option(
    "--drain-seconds",
    type=float,
    default=45.0,
    help="On SIGTERM, how long sends in flight get to finish.",
)
@option(
    "--pause-seconds",
    type=float,
    default=60.0,
    help="While sending is paused (the account, a configuration set or an identity), "
    "probe with one of its messages this often.",
)
@option("--exit-when-idle", is_flag=True, help="Drain what is due, then exit 0.")
@option(
    "--relay-id",
    default=None,
    help="Name in outbox_relays and logs; a live relay's id is refused [default: host-pid-xxxx].",
)
@option(
    "--log-level",
    default="INFO",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@option("--log-format", default="text", type=click.Choice(["text", "json"]), help="Log lines.")
@option(
    "--log-recipients",
    is_flag=True,
    help="Show recipient addresses in logs (masked by default).",
)
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
@option(
    "--events-queue-url",
    default=None,
    show_default=False,
    help="Also take SES events from this SQS queue, in a thread of this process (see "
    "`outbox-relay events`); default: no event intake.",
)
@option(
    "--events-wait-seconds",
    env=_WAIT_ENV,
    type=click.IntRange(*EVENTS_WAIT_RANGE),
    default=20,
    help="Seconds each SQS receive waits for events (long poll), with --events-queue-url.",
)
@option(
    "--events-topic-arn",
    default=None,
    show_default=False,
    help="With --events-queue-url, apply only events from this SNS topic (EventBridge: from "
    "its account); others are recorded as foreign and change nothing. Default: every event is "
    "applied, whatever its topic.",
)
def run(**options: Any) -> None:
    """Deliver committed outbox messages until stopped (SIGTERM/SIGINT drain it).

    A second signal exits at once; leases of sends then in flight expire normally.
    """
    logs.configure(
        options.pop("log_level"), options.pop("log_format"), options.pop("log_recipients")
    )
    http_port, http_host = options.pop("http_port"), options.pop("http_host")
    if options["relay_id"] is None:
        options.pop("relay_id")
    queue_url, wait_seconds = options.pop("events_queue_url"), options.pop("events_wait_seconds")
    topic_arn = options.pop("events_topic_arn")
    if topic_arn is not None:
        check_topic_arn(topic_arn)  # before anything opens: one line, exit 2
    intake_config = (
        None
        if queue_url is None
        else IntakeConfig(
            queue_url=queue_url, wait_seconds=wait_seconds, wait_option="--events-wait-seconds"
        )
    )
    sender_options = {
        name: options.pop(name)
        for name in list(options)
        if name.startswith(("ses_", "smtp_", "mail_"))
    }
    config = RelayConfig(**options)  # a ConfigurationError is one line (see _Commands)
    if not config.sender:  # no default: a relay that delivers nothing must be asked for
        raise ConfigurationError(
            "--sender",
            "is required (or OUTBOX_SENDER): ses, smtp, package.module:factory, or console, "
            "which delivers nothing",
        )
    sender = build_sender(config.sender, config, sender_options)
    engine = open_engine(config.database_url, read_timeout=READ_TIMEOUT)
    relay = Relay(engine=engine, sender=sender, config=config)
    intake = (
        None
        if intake_config is None
        else _open_intake(intake_config, engine, intake_id=relay.relay_id, topic_arn=topic_arn)
    )
    listener = Listener.for_engine(engine, relay.wake)
    server = None
    if http_port is not None:
        server = _serve(relay, RelayMetrics(relay, intake=intake), http_port, http_host)
    intake_thread = None if intake is None else _start_intake(intake)
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
        relay.run()  # no outbox tables: a ConfigurationError, one line (see _Commands)
    finally:
        if intake is not None and intake_thread is not None:
            _stop_intake(intake, intake_thread)
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


def _serve(relay: Relay, metrics: Any, port: int, host: str, **kw: Any) -> Server:
    try:
        return start_http_server(relay, metrics, port, host, **kw)
    except OSError as exc:
        raise StartupError(f"--http-port: cannot listen on {port}: {exc}") from None


def _open_intake(
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


def _start_intake(intake: Intake) -> threading.Thread:
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


def _stop_intake(intake: Intake, thread: threading.Thread) -> None:
    """Stop the intake after its batch in hand (a long poll ends within its wait)."""
    intake.request_stop()
    thread.join(intake.wait_seconds + _INTAKE_JOIN_SECONDS)
    if thread.is_alive():
        logging.getLogger("relay.intake").warning(
            "the event intake did not stop in time; its messages in hand will be received "
            "again after their visibility timeout",
            extra={"action": "intake_stop_timeout"},
        )


@main.command()
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
    env=_WAIT_ENV,
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
        intake = _open_intake(
            config,
            engine,
            exit_when_idle=options["exit_when_idle"],
            topic_arn=options["events_topic_arn"],
        )
        server = None
        if options["http_port"] is not None:
            # the HTTP app reads a relay's loop_at, waiting_at, state, paused and engine,
            # which the intake has under the same names
            server = _serve(
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


# -- preflight: doctor and send-test (the checks are relay/doctor.py's) ----------------------


def _aws_clients() -> preflight.Clients:
    """The clients doctor checks with: the relay's own SES client (its region chain), the
    intake's SQS client, and SES v1 and SNS clients of boto3's same chain."""
    try:
        import boto3
        from botocore.config import Config

        from relay.intake import build_client as sqs_client
        from relay.senders.ses import build_client as ses_client
    except ImportError as exc:
        raise ConfigurationError(
            "--sender", f"checking SES needs boto3 ({exc}): pip install 'sqlalchemy-outbox[ses]'"
        ) from None
    config = Config(retries={"total_max_attempts": 2, "mode": "standard"}, read_timeout=10.0)

    def aws(service: str, region: str) -> Any:
        session = boto3.session.Session(region_name=region or None)
        return cast(Any, session).client(service, config=config)

    return preflight.Clients(
        ses=lambda: ses_client(send_timeout=10.0, concurrency=1),
        aws=aws,
        sqs=lambda url: sqs_client(url, wait_seconds=1),
    )


def _smtp_probe(options: dict[str, Any]) -> tuple[Any, str]:
    """Opening one SMTP session with the --smtp-* flags, and where it goes."""

    def probe() -> str:
        settings = SmtpSettings(
            host=options.get("smtp_host") or "",
            port=options.get("smtp_port"),
            security=options.get("smtp_security") or DEFAULT_SECURITY,
            username=options.get("smtp_username"),
            password=options.get("smtp_password"),
            allow_cleartext_login=bool(options.get("smtp_allow_cleartext_login")),
            timeout=options.get("smtp_timeout") or 10.0,
        )
        return SmtpSender(settings).probe()

    return probe, f"{options.get('smtp_host')}:{options.get('smtp_port') or 'default port'}"


@main.command()
@database_url
@option(
    "--sender",
    default="ses",
    help="The sender to check, as `run` takes it: ses or smtp (another is a warn: not checked).",
)
@option(
    "--ses-configuration-set",
    default=None,
    help="SES configuration set the relay sends with: it must exist and publish to the queue.",
)
@_smtp_options("Seconds the SMTP connect and each read may take [default: 10].")
@option(
    "--events-queue-url",
    default=None,
    show_default=False,
    help="The SQS queue the event intake reads: it must answer and be fed by the configuration "
    "set's event destination.",
)
@option(
    "--events-topic-arn",
    default=None,
    show_default=False,
    help="The SNS topic the intake accepts events from: the event destination's topic must be it.",
)
@click.option(
    "--from",
    "from_addresses",
    multiple=True,
    help="A From address to check (repeatable), besides those of the newest 1000 messages.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def doctor(**options: Any) -> None:
    """Check what the relay needs, without sending or writing anything: the database (schema,
    grants), then SES (region, account, identities, configuration set, event destination,
    queue) or the SMTP server. One line a check: ok, warn or fail, what was found, what to do.
    Exit code 1 if any check fails."""
    topic_arn = options["events_topic_arn"]
    if topic_arn is not None:
        check_topic_arn(topic_arn)
    engine = open_engine(options["database_url"])
    try:
        check_file_exists(engine)  # a mistyped SQLite path is not created empty
        checks = preflight.diagnose(
            engine,
            sender=options["sender"],
            clients=_aws_clients,
            smtp=_smtp_probe(options),
            identities=options["from_addresses"],
            configuration_set=options["ses_configuration_set"],
            queue_url=options["events_queue_url"],
            topic_arn=topic_arn,
        )
    finally:
        engine.dispose()
    click.echo(preflight.render(checks, as_json=options["as_json"]))
    if any(check.status is preflight.Level.FAIL for check in checks):
        sys.exit(1)


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise click.BadParameter(f"{value}: a number of seconds (nan would wait for ever)")
    return value


@main.command(name="send-test")
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
