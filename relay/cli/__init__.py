"""The ``outbox-relay`` command line. Every option can also be set from an ``OUTBOX_*``
environment variable (shown in ``--help``).

This module is the group (:func:`main`) and what picks a concrete sender: ``run``
(:func:`build_sender`) and ``doctor`` (the clients and the SMTP session :mod:`relay.doctor`
checks with). The other commands: :mod:`relay.cli.migrations` (``migrate``,
``alembic-revision``), :mod:`relay.cli.process` (``events``, and ``run``'s process once its
sender is built), :mod:`relay.cli.sendtest` (``send-test``) and :mod:`relay.admin` (the
operator commands).
"""

from __future__ import annotations

import faulthandler
import importlib
import signal
import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast

import click
import sqlalchemy as sa

from outbox.exceptions import ConfigurationError
from relay import admin, logs
from relay import doctor as preflight
from relay.cli.console import ui, ui_user
from relay.cli.migrations import alembic_revision, migrate
from relay.cli.process import WAIT_ENV, events, run_relay
from relay.cli.sendtest import send_test
from relay.cli_options import (
    StartupError,
    check_file_exists,
    database_url,
    first_line,
    open_engine,
    option,
    warn_secret_flag,
)
from relay.config import EVENTS_WAIT_RANGE, IntakeConfig, RelayConfig
from relay.db import READ_TIMEOUT
from relay.intake import check_topic_arn
from relay.senders import Sender, as_sender
from relay.senders.console import ConsoleSender
from relay.senders.file import FileSender
from relay.senders.smtp import DEFAULT_SECURITY, SECURITY_MODES, SmtpSender, SmtpSettings

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
    "ui",
    "ui_user",
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


for _command in (*admin.COMMANDS, migrate, alembic_revision, events, send_test, ui, ui_user):
    main.add_command(_command)


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
    "--key-limit",
    "key_limits",
    multiple=True,
    show_default=False,
    help="PATTERN=RATE/s, PATTERN=inflight:N or both, comma-separated: each fairness key the "
    "pattern matches (fnmatch) gets at most RATE recipients per second and N sends at once, "
    "for all relays together; repeatable, the first match wins (the variable: space-separated).",
)
@option(
    "--identity-limit",
    "identity_limits",
    multiple=True,
    show_default=False,
    help="As --key-limit, for the From address or domain the pattern matches "
    "('example.com=10/s': all of that domain's mail together).",
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
    env=WAIT_ENV,
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
    run_relay(
        config,
        sender,
        engine,
        intake_config=intake_config,
        topic_arn=topic_arn,
        http_port=http_port,
        http_host=http_host,
    )


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
