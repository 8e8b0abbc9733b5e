"""Preflight: the checks of ``outbox-relay doctor`` and the test message of ``outbox-relay
send-test``.

Each check reads and never writes: the database (reachable, migrated to head, the role's
grants), then the sender (SES: region, account, each sending identity, the configuration set
and the way its events reach the intake's queue; SMTP: one session opened and closed). What a
check cannot see (an emulator that does not answer a call, a role's grants the server does not
show) is a ``warn`` that says "could not check", never an ``ok``. The AWS clients are built
by the command line and passed in (:class:`Clients`).
"""

from __future__ import annotations

import email.utils
import enum
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox.category import Category
from outbox.exceptions import ConfigurationError, InvalidEmail
from outbox.message import Email
from outbox.migrations import current_heads
from outbox.schema import DeliveryStatus, Status
from outbox.session import Outbox
from relay import store
from relay.clock import read_database_time
from relay.db import masked_url

__all__ = [
    "RELAY_GRANTS",
    "TEST_CATEGORY",
    "Check",
    "Clients",
    "Level",
    "Outcome",
    "check_database",
    "check_grants",
    "check_queue",
    "check_ses",
    "check_smtp",
    "diagnose",
    "enqueue_test",
    "identities_in_use",
    "render",
    "watch",
]

TEST_CATEGORY = "outbox-test"
_LIVE = timedelta(seconds=60)  # a relay or intake that beat this recently is running
_SENDERS_READ = 1000  # the newest messages whose From addresses doctor checks
_QUOTA_NEAR = 0.8  # share of Max24HourSend past which the quota is a warning

# What the relay's statements need, as examples/deploy/grants-*.sql grant it: (privilege,
# table, columns or None for the whole table). The intake's needs apply with a queue only.
_MESSAGE_COLUMNS = (
    "status",
    "claim_token",
    "claimed_by",
    "claimed_at",
    "lease_expires_at",
    "send_started_at",
    "attempt_count",
    "next_attempt_at",
    "last_attempt_at",
    "last_error_code",
    "last_error_message",
    "sent_at",
    "provider_message_id",
    "delivery_status",
    "delivery_status_at",
    "updated_at",
)
_RUN_GRANTS: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    *(
        ("SELECT", table, None)
        for table in (
            "outbox_messages",
            "outbox_attempts",
            "outbox_relays",
            "outbox_send_budget",
            "outbox_send_budget_lock",
            "outbox_suppressions",
            "outbox_lag",
            "outbox_delivery_summary",
        )
    ),
    ("UPDATE", "outbox_messages", _MESSAGE_COLUMNS),
    *(
        ("INSERT", table, None)
        for table in (
            "outbox_attempts",
            "outbox_relays",
            "outbox_send_budget",
            "outbox_send_budget_lock",
        )
    ),
    ("UPDATE", "outbox_relays", ("host", "pid", "started_at", "heartbeat_at", "state")),
    ("UPDATE", "outbox_send_budget_lock", ("id",)),
    ("DELETE", "outbox_send_budget", None),
)
_INTAKE_GRANTS: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("SELECT", "outbox_events", None),
    ("SELECT", "outbox_intakes", None),
    ("SELECT", "outbox_event_intake", None),
    ("INSERT", "outbox_events", None),
    ("INSERT", "outbox_suppressions", None),
    ("INSERT", "outbox_intakes", None),
    ("UPDATE", "outbox_events", ("effect",)),
    (
        "UPDATE",
        "outbox_intakes",
        ("queue_url", "visibility_timeout", "started_at", "heartbeat_at", "caught_up_at"),
    ),
)
RELAY_GRANTS = (*_RUN_GRANTS, *_INTAKE_GRANTS)


class Level(enum.Enum):
    """How a check came out."""

    OK = "ok"  # nothing to do
    WARN = "warn"  # mail flows, but something is worth a look, or could not be checked
    FAIL = "fail"  # mail will not flow (or not as configured) until this is fixed


@dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    """One line of ``doctor``: what was checked, how it came out, what was found, the fix."""

    check: str
    status: Level
    found: str
    fix: str | None = None

    def line(self) -> str:
        fix = f"; {self.fix}" if self.fix else ""
        return f"{self.status.value:<4}  {self.check}: {self.found}{fix}"

    def as_dict(self) -> dict[str, str | None]:
        return {
            "check": self.check,
            "status": self.status.value,
            "found": self.found,
            "fix": self.fix,
        }


def render(checks: Sequence[Check], *, as_json: bool) -> str:
    """The report: one line a check, or a JSON list of ``{check, status, found, fix}``."""
    if as_json:
        return json.dumps([c.as_dict() for c in checks], indent=2)
    return "\n".join(c.line() for c in checks)


def _worst(levels: Iterable[Level]) -> Level:
    found = set(levels)
    return Level.FAIL if Level.FAIL in found else Level.WARN if Level.WARN in found else Level.OK


def _first_line(error: BaseException) -> str:
    orig = getattr(error, "orig", None) or error
    return (str(orig).strip().splitlines() or [type(orig).__name__])[0].strip()


# -- the database --------------------------------------------------------------------------


def check_database(engine: sa.Engine) -> tuple[Check, bool]:
    """Reachable, the outbox tables there, the migrations at head; and whether the schema is
    usable for the checks that read it."""
    where = masked_url(engine.url)
    migrate = f"run `outbox-relay migrate --database-url ...` (as the schema's owner) on {where}"
    try:
        with engine.connect() as conn:
            missing = store.missing_tables(conn)
    except sa.exc.DBAPIError as exc:
        found = f"cannot connect to {where}: {_first_line(exc)}"
        return Check(
            check="database",
            status=Level.FAIL,
            found=found,
            fix="check --database-url, that the server runs and accepts this login",
        ), False
    if missing:
        what = (
            "no outbox schema"
            if set(missing) == set(store.OUTBOX_TABLES)
            else f"the outbox tables {', '.join(missing)} missing"
        )
        return Check(
            check="database", status=Level.FAIL, found=f"{where}: {what}", fix=migrate
        ), False
    try:
        applied, heads = current_heads(engine)
    except sa.exc.DBAPIError as exc:  # the relay's role need not read the version table
        return Check(
            check="database",
            status=Level.WARN,
            found=f"{where}, outbox tables present; could not check the revision: "
            f"{_first_line(exc)}",
            fix="run doctor as the schema's owner to check the migrations",
        ), True
    at = ", ".join(sorted(applied)) or "no recorded revision"
    if applied == heads:
        return Check(
            check="database", status=Level.OK, found=f"{where}, schema at {at} (head)"
        ), True
    if applied - heads and not heads - applied:
        return Check(
            check="database",
            status=Level.WARN,
            found=f"{where}: schema at {at}, newer than this release's {', '.join(sorted(heads))}",
            fix="run the relay release that migrated it",
        ), True
    return Check(
        check="database",
        status=Level.FAIL,
        found=f"{where}: schema at {at}, not at head {', '.join(sorted(heads))}",
        fix=migrate,
    ), True


def check_grants(engine: sa.Engine, *, intake: bool) -> Check:
    """The privileges the relay's statements need (with ``intake``, the event intake's too),
    read from the server's catalog without writing anything."""
    needs = RELAY_GRANTS if intake else _RUN_GRANTS
    dialect = engine.dialect.name
    if dialect == "sqlite":
        return Check(check="grants", status=Level.OK, found="n/a: SQLite has no roles")
    try:
        with engine.connect() as conn:
            if dialect == "postgresql":
                missing, hidden = _missing_postgresql(conn, needs), ""
            elif dialect in ("mysql", "mariadb"):
                missing, hidden = _missing_mysql(conn, needs)
            else:
                return Check(
                    check="grants",
                    status=Level.WARN,
                    found=f"could not check: no privilege query for {dialect}",
                )
    except sa.exc.DBAPIError as exc:
        return Check(
            check="grants", status=Level.WARN, found=f"could not check: {_first_line(exc)}"
        )
    script = f"examples/deploy/grants-{'postgresql' if dialect == 'postgresql' else 'mariadb'}.sql"
    if not missing:
        return Check(check="grants", status=Level.OK, found="every privilege the relay needs")
    found = f"the role lacks {'; '.join(missing)}"
    if hidden:  # a role's grants that information_schema does not show may cover them
        return Check(
            check="grants",
            status=Level.WARN,
            found=f"{found} (could not check the grants of the enabled roles {hidden})",
            fix=f"grant them as {script} does, or check SHOW GRANTS",
        )
    return Check(check="grants", status=Level.FAIL, found=found, fix=f"grant them as {script} does")


def _needed(
    needs: Iterable[tuple[str, str, tuple[str, ...] | None]],
) -> Iterable[tuple[str, str, str | None]]:
    for privilege, table, columns in needs:
        for column in columns or (None,):
            yield privilege, table, column


def _describe(missing: Iterable[tuple[str, str, str | None]]) -> list[str]:
    """``UPDATE (a, b) ON t``, ``SELECT ON u``: the missing privileges, grouped."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for privilege, table, column in missing:
        grouped.setdefault((privilege, table), [])
        if column is not None:
            grouped[(privilege, table)].append(column)
    return [
        f"{p} ({', '.join(cols)}) ON {t}" if cols else f"{p} ON {t}"
        for (p, t), cols in grouped.items()
    ]


def _missing_postgresql(
    conn: sa.Connection, needs: Iterable[tuple[str, str, tuple[str, ...] | None]]
) -> list[str]:
    """has_table_privilege / has_column_privilege of the current role (its roles' included),
    the tables found along its search_path as the relay's statements find them."""
    wanted = list(_needed(needs))
    parts, params = [], {}
    for n, (privilege, table, column) in enumerate(wanted):
        params[f"t{n}"], params[f"p{n}"] = table, privilege
        if column is None:
            parts.append(f"has_table_privilege(:t{n}, :p{n})")
        else:
            params[f"c{n}"] = column
            parts.append(f"has_column_privilege(:t{n}, :c{n}, :p{n})")
    held = conn.execute(sa.text(f"SELECT {', '.join(parts)}"), params).one()
    return _describe(w for w, ok in zip(wanted, held, strict=True) if not ok)


def _missing_mysql(
    conn: sa.Connection, needs: Iterable[tuple[str, str, tuple[str, ...] | None]]
) -> tuple[list[str], str]:
    """The current account's privileges from information_schema (global, this schema, each
    table, each column), and the enabled roles, whose grants it does not show."""
    grantee = sa.text(
        "SELECT CONCAT('''', SUBSTRING_INDEX(CURRENT_USER(), '@', 1), '''@''', "
        "SUBSTRING_INDEX(CURRENT_USER(), '@', -1), ''''), DATABASE()"
    )
    who, schema = conn.execute(grantee).one()
    where = {"who": who, "schema": schema}
    held: set[tuple[str, str | None, str | None]] = set()
    for (privilege,) in conn.execute(
        sa.text(
            "SELECT privilege_type FROM information_schema.user_privileges WHERE grantee = :who"
        ),
        where,
    ):
        held.add((privilege, None, None))
    for (privilege,) in conn.execute(
        sa.text(
            "SELECT privilege_type FROM information_schema.schema_privileges "
            "WHERE grantee = :who AND table_schema = :schema"
        ),
        where,
    ):
        held.add((privilege, None, None))
    for privilege, table in conn.execute(
        sa.text(
            "SELECT privilege_type, table_name FROM information_schema.table_privileges "
            "WHERE grantee = :who AND table_schema = :schema"
        ),
        where,
    ):
        held.add((privilege, table, None))
    for privilege, table, column in conn.execute(
        sa.text(
            "SELECT privilege_type, table_name, column_name "
            "FROM information_schema.column_privileges "
            "WHERE grantee = :who AND table_schema = :schema"
        ),
        where,
    ):
        held.add((privilege, table, column))
    enabled = sa.text("SELECT role_name FROM information_schema.enabled_roles")
    roles = ", ".join(r for r in conn.execute(enabled).scalars() if r)  # NULL: no role

    def has(privilege: str, table: str, column: str | None) -> bool:
        return bool(
            {(privilege, None, None), (privilege, table, None), (privilege, table, column)} & held
        )

    return _describe(w for w in _needed(needs) if not has(*w)), roles


def identities_in_use(engine: sa.Engine) -> tuple[list[str], list[str]]:
    """The From addresses and configuration sets named by the newest messages, each once,
    in the order first seen."""
    with engine.connect() as conn:
        payloads = store.recent_payloads(conn, limit=_SENDERS_READ)
    senders: dict[str, None] = {}
    sets: dict[str, None] = {}
    for payload in payloads:
        if not isinstance(payload, dict):
            continue
        address = email.utils.parseaddr(str(payload.get("sender") or ""))[1].lower()
        if "@" in address:
            senders[address] = None
        if payload.get("configuration_set"):
            sets[str(payload["configuration_set"])] = None
    return list(senders), list(sets)


# -- SES -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Clients:
    """The AWS clients the checks use, built by the command line."""

    ses: Callable[[], Any]  # the relay's own SES v2 client; may raise ConfigurationError
    aws: Callable[[str, str], Any]  # (service, region): SES v1, SNS, of boto3's same chain
    sqs: Callable[[str], Any]  # the intake's SQS client for a queue URL


def _error(exc: Exception) -> tuple[str, str]:
    """(code, message) of a botocore ``ClientError``, else the exception's name and text.
    A code of digits only is an HTTP status without an AWS error code: the endpoint does not
    know the call (an emulator)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error", {})
        return str(err.get("Code", "")), str(err.get("Message", "")).splitlines()[0][:200]
    return type(exc).__name__, _first_line(exc)


_CREDENTIALS = frozenset(
    {
        "UnrecognizedClientException",
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "ExpiredTokenException",
        "IncompleteSignature",
    }
)
_DENIED = frozenset({"AccessDenied", "AccessDeniedException"})
_NOT_FOUND = frozenset({"NotFoundException", "ConfigurationSetDoesNotExist", "NotFound"})


def _unchecked(name: str, call: str, exc: Exception, *, region: str) -> Check:
    """A call that failed for a reason that says nothing of the setting it was to check."""
    code, text = _error(exc)
    if code in _CREDENTIALS:
        return Check(
            check=name,
            status=Level.FAIL,
            found=f"SES in {region} refused the credentials ({code}: {text})",
            fix="give the relay valid AWS credentials (environment, profile or role)",
        )
    if code in _DENIED:
        return Check(
            check=name,
            status=Level.WARN,
            found=f"could not check: the credentials may not call {call} ({code})",
            fix=f"allow ses:{call} to check it (the relay itself needs only ses:SendEmail)",
        )
    if code.isdigit():
        return Check(
            check=name,
            status=Level.WARN,
            found=f"could not check: the endpoint does not answer {call} (HTTP {code}: an "
            "emulator?)",
        )
    return Check(check=name, status=Level.WARN, found=f"could not check: {call}: {code}: {text}")


def _region_source(region: str) -> str:
    """Where boto3's chain found ``region``, as ``relay.senders.ses.build_client`` reads it."""
    if os.environ.get("AWS_DEFAULT_REGION") == region:
        return "AWS_DEFAULT_REGION"
    if os.environ.get("AWS_REGION") == region:
        return "AWS_REGION"
    return "the AWS profile"


def check_ses(
    clients: Clients,
    *,
    identities: Sequence[str],
    configuration_set: str | None,
    queue_url: str | None,
    topic_arn: str | None,
) -> list[Check]:
    """Region and credentials, the account, each identity, the configuration set and its
    event destination, the events queue."""
    try:
        ses = clients.ses()
    except ConfigurationError as exc:
        return [
            Check(
                check="ses region",
                status=Level.FAIL,
                found=str(exc),
                fix="set AWS_REGION (and AWS_DEFAULT_REGION) to the region your identities are "
                "verified in, and give the relay credentials",
            )
        ]
    region = str(ses.meta.region_name)
    checks = [_region_check(region, str(ses.meta.endpoint_url))]
    checks.append(_account_check(ses, region))
    if not identities:
        checks.append(
            Check(
                check="ses identity",
                status=Level.WARN,
                found="no message in the outbox and no --from: no sending identity to check",
                fix="pass --from ADDRESS (the From address the app sends with)",
            )
        )
    checks += [_identity_check(ses, address, region) for address in identities]
    queue = check_queue(clients, queue_url) if queue_url else None
    checks += _events_checks(clients, ses, region, configuration_set, queue, topic_arn)
    if queue is not None:
        checks.append(queue[0])
    return checks


def _region_check(region: str, endpoint: str) -> Check:
    source = _region_source(region)
    found = f"{region} (from {source}), endpoint {endpoint}"
    other = os.environ.get("AWS_REGION")
    if other and other != region:
        return Check(
            check="ses region",
            status=Level.WARN,
            found=f"{found}; AWS_REGION says {other}",
            fix="boto3 reads AWS_DEFAULT_REGION first: set both to the same region",
        )
    return Check(check="ses region", status=Level.OK, found=found)


def _account_check(ses: Any, region: str) -> Check:
    name = "ses account"
    try:
        account = ses.get_account()
    except Exception as exc:
        return _unchecked(name, "GetAccount", exc, region=region)
    levels, found, fixes = [], [], []
    if account.get("SendingEnabled") is False:
        levels.append(Level.FAIL)
        found.append("sending disabled for the account")
        fixes.append("re-enable it: aws sesv2 put-account-sending-attributes --sending-enabled")
    enforcement = account.get("EnforcementStatus")
    if enforcement == "SHUTDOWN":
        levels.append(Level.FAIL)
        found.append("the account is shut down by SES")
        fixes.append("contact AWS support")
    elif enforcement == "PROBATION":
        levels.append(Level.WARN)
        found.append("the account is on probation (bounce or complaint rate)")
        fixes.append("lower the bounce and complaint rates (outbox-relay status shows them)")
    if account.get("ProductionAccessEnabled") is False:
        levels.append(Level.WARN)
        found.append("in the sandbox: mail only to verified addresses")
        fixes.append(f"request production access for SES in {region}")
    else:
        found.append("production access")
    quota = account.get("SendQuota") or {}
    most, sent = quota.get("Max24HourSend"), quota.get("SentLast24Hours")
    if most is not None and sent is not None:
        found.append(f"{sent:g} of {most:g} sent in 24 h, {quota.get('MaxSendRate', 0):g}/s")
        if most > 0 and sent >= _QUOTA_NEAR * most:
            levels.append(Level.WARN)
            fixes.append("ask AWS for a larger sending quota before mail waits for it")
    return Check(
        check=name, status=_worst(levels), found=", ".join(found), fix="; ".join(fixes) or None
    )


def _identity(ses: Any, identity: str) -> dict[str, Any] | None:
    """GetEmailIdentity of ``identity``, None if SES has no such identity (in this region)."""
    try:
        answer: dict[str, Any] = ses.get_email_identity(EmailIdentity=identity)
    except Exception as exc:
        if _error(exc)[0] in _NOT_FOUND:
            return None
        raise
    return answer


def _verified(found: dict[str, Any]) -> bool:
    # VerificationStatus SUCCESS means the same; an emulator (moto) fills only that one
    return (
        bool(found.get("VerifiedForSendingStatus")) or found.get("VerificationStatus") == "SUCCESS"
    )


def _identity_check(ses: Any, address: str, region: str) -> Check:
    """The address may send if it, or its domain, is a verified identity in ``region``; then
    DKIM (of the identity that covers it) and a custom MAIL FROM domain's state."""
    name = f"ses identity {address}"
    domain = address.rpartition("@")[2]
    try:
        by_address = _identity(ses, address)
        by_domain = _identity(ses, domain)
    except Exception as exc:
        return _unchecked(name, "GetEmailIdentity", exc, region=region)
    covering = next(
        (found for found in (by_domain, by_address) if found is not None and _verified(found)),
        None,
    )
    if covering is None:
        pending = [f for f in (by_address, by_domain) if f is not None]
        state = (
            f"verification {pending[0].get('VerificationStatus', 'PENDING')}"
            if pending
            else "neither it nor its domain is an identity"
        )
        return Check(
            check=name,
            status=Level.FAIL,
            found=f"not verified for sending in {region} ({state}; region from "
            f"{_region_source(region)})",
            fix=f"verify {domain} (or the address) in SES {region}: aws sesv2 "
            f"create-email-identity --email-identity {domain} --region {region}; or set "
            "AWS_REGION and AWS_DEFAULT_REGION to the region where it is verified",
        )
    which = domain if covering is by_domain else address
    levels, found, fixes = [Level.OK], [f"verified in {region} (as {which})"], []
    dkim = (covering.get("DkimAttributes") or {}).get("Status")
    if dkim == "SUCCESS":
        found.append("DKIM SUCCESS")
    else:
        levels.append(Level.WARN)
        found.append(f"DKIM {dkim or 'not set up'}")
        fixes.append(f"set up Easy DKIM for {domain} and publish its CNAME records")
    mail_from = covering.get("MailFromAttributes") or {}
    status = mail_from.get("MailFromDomainStatus")
    if mail_from.get("MailFromDomain") and status != "SUCCESS":
        rejects = mail_from.get("BehaviorOnMxFailure") == "REJECT_MESSAGE"
        levels.append(Level.FAIL if rejects else Level.WARN)
        found.append(
            f"MAIL FROM {mail_from['MailFromDomain']} {status}"
            + (": SES rejects mail until it verifies" if rejects else "")
        )
        fixes.append(f"publish the MX and SPF records of {mail_from['MailFromDomain']}")
    elif mail_from.get("MailFromDomain"):
        found.append(f"MAIL FROM {mail_from['MailFromDomain']} SUCCESS")
    return Check(
        check=name, status=_worst(levels), found=", ".join(found), fix="; ".join(fixes) or None
    )


def check_queue(clients: Clients, queue_url: str) -> tuple[Check, str | None]:
    """The events queue answers ``GetQueueAttributes``; its ARN, for the subscription."""
    name = "events queue"
    try:
        attributes = clients.sqs(queue_url).get_queue_attributes(
            QueueUrl=queue_url, AttributeNames=["QueueArn", "RedrivePolicy"]
        )["Attributes"]
    except Exception as exc:
        code, text = _error(exc)
        return Check(
            check=name,
            status=Level.FAIL,
            found=f"{queue_url}: {code}: {text}",
            fix="check --events-queue-url, the queue's region and sqs:GetQueueAttributes",
        ), None
    arn = attributes.get("QueueArn")
    if not attributes.get("RedrivePolicy"):
        return Check(
            check=name,
            status=Level.WARN,
            found=f"{queue_url} reachable, no dead-letter queue",
            fix="give it a redrive policy: what is not an SES event stays on it until then",
        ), arn
    return Check(check=name, status=Level.OK, found=f"{queue_url} reachable"), arn


def _destinations(
    clients: Clients, ses: Any, region: str, name: str
) -> tuple[list[dict[str, Any]], str]:
    """The configuration set's event destinations in SES v2's form, and a note. An endpoint
    that does not answer the v2 call (moto) is asked SES v1's DescribeConfigurationSet, which
    reads the same configuration set; v1 knows only SNS and CloudWatch destinations."""
    try:
        found: list[dict[str, Any]] = ses.get_configuration_set_event_destinations(
            ConfigurationSetName=name
        )["EventDestinations"]
        return found, ""
    except Exception as exc:
        if not _error(exc)[0].isdigit():
            raise
    answer = clients.aws("ses", region).describe_configuration_set(
        ConfigurationSetName=name, ConfigurationSetAttributeNames=["eventDestinations"]
    )
    converted = [
        {
            "Name": d.get("Name"),
            "Enabled": d.get("Enabled", False),
            "MatchingEventTypes": [t.upper() for t in d.get("MatchingEventTypes", [])],
            **(
                {"SnsDestination": {"TopicArn": d["SNSDestination"]["TopicARN"]}}
                if d.get("SNSDestination")
                else {}
            ),
        }
        for d in answer.get("EventDestinations", [])
    ]
    return converted, " (read through SES v1: the endpoint does not answer the v2 call)"


_WANTED_EVENTS = ("DELIVERY", "BOUNCE", "COMPLAINT")


def _events_checks(
    clients: Clients,
    ses: Any,
    region: str,
    configuration_set: str | None,
    queue: tuple[Check, str | None] | None,
    topic_arn: str | None,
) -> list[Check]:
    if configuration_set is None:
        if queue is None:
            return []
        return [
            Check(
                check="ses configuration set",
                status=Level.WARN,
                found="no --ses-configuration-set: events reach the queue only for mail whose "
                "identity has a default configuration set, or that names one",
                fix="pass --ses-configuration-set NAME (the set whose destination feeds the queue)",
            )
        ]
    name = f"ses configuration set {configuration_set}"
    try:
        found = ses.get_configuration_set(ConfigurationSetName=configuration_set)
    except Exception as exc:
        if _error(exc)[0] not in _NOT_FOUND:
            return [_unchecked(name, "GetConfigurationSet", exc, region=region)]
        return [
            Check(
                check=name,
                status=Level.FAIL,
                found=f"does not exist in {region}: SES refuses every message sent with it",
                fix=f"create it (aws sesv2 create-configuration-set --configuration-set-name "
                f"{configuration_set} --region {region}) or fix --ses-configuration-set",
            )
        ]
    checks = []
    if (found.get("SendingOptions") or {}).get("SendingEnabled") is False:
        checks.append(
            Check(
                check=name,
                status=Level.FAIL,
                found=f"exists in {region}, sending disabled: its messages are refused",
                fix="aws sesv2 put-configuration-set-sending-options --configuration-set-name "
                f"{configuration_set} --sending-enabled",
            )
        )
    else:
        checks.append(Check(check=name, status=Level.OK, found=f"exists in {region}"))
    checks.append(_destination_check(clients, ses, region, configuration_set, queue, topic_arn))
    return checks


def _destination_check(
    clients: Clients,
    ses: Any,
    region: str,
    configuration_set: str,
    queue: tuple[Check, str | None] | None,
    topic_arn: str | None,
) -> Check:
    """An enabled destination of the set that reaches the queue: an SNS topic with an SQS
    subscription of the queue's ARN; an EventBridge bus is a warning (its rules are not
    followed)."""
    name = "ses event destination"
    try:
        destinations, note = _destinations(clients, ses, region, configuration_set)
    except Exception as exc:
        return _unchecked(name, "GetConfigurationSetEventDestinations", exc, region=region)
    enabled = [d for d in destinations if d.get("Enabled")]
    add = (
        f"add an SNS event destination to {configuration_set} (events DELIVERY, BOUNCE, "
        "COMPLAINT, ...) whose topic the events queue subscribes to"
    )
    if not enabled:
        return Check(
            check=name,
            status=Level.FAIL if queue is not None else Level.WARN,
            found=f"{configuration_set} has no enabled event destination{note}: the relay never "
            "hears of deliveries, bounces or complaints",
            fix=add,
        )
    if queue is None:
        return Check(
            check=name,
            status=Level.WARN,
            found=f"{configuration_set} publishes events{note}, but no --events-queue-url: the "
            "relay takes none of them",
            fix="pass --events-queue-url (run) or run `outbox-relay events`",
        )
    queue_arn = queue[1]
    if queue_arn is None:
        return Check(
            check=name,
            status=Level.WARN,
            found=f"could not check: the events queue's ARN is unknown{note}",
            fix="fix the events queue line first",
        )
    seen: list[str] = []
    for destination in enabled:
        types = set(destination.get("MatchingEventTypes") or [])
        lacking = [t for t in _WANTED_EVENTS if t not in types]
        topic = (destination.get("SnsDestination") or {}).get("TopicArn")
        bus = (destination.get("EventBridgeDestination") or {}).get("EventBusArn")
        if topic:
            unreached = _subscribed(clients, topic, queue_arn)
            if unreached is not None:
                seen.append(f"{destination.get('Name')} -> {topic}: {unreached}")
                continue
            if topic_arn is not None and topic != topic_arn:
                return Check(
                    check=name,
                    status=Level.FAIL,
                    found=f"{destination.get('Name')} publishes to {topic}, but "
                    f"--events-topic-arn is {topic_arn}: every event would be foreign",
                    fix=f"set --events-topic-arn {topic} (or unset it)",
                )
            return Check(
                check=name,
                status=Level.WARN if lacking else Level.OK,
                found=f"{destination.get('Name')} -> {topic} -> {queue_arn}{note}"
                + (f", without event types {', '.join(lacking)}" if lacking else ""),
                fix=f"add {', '.join(lacking)} to its event types" if lacking else None,
            )
        if bus:
            return Check(
                check=name,
                status=Level.WARN,
                found=f"{destination.get('Name')} -> EventBridge {bus}: could not check that a "
                "rule on it targets the queue (rules are not followed)",
                fix=f"make sure a rule on {bus} matching source aws.ses targets {queue_arn}",
            )
        seen.append(f"{destination.get('Name')} (neither SNS nor EventBridge)")
    return Check(
        check=name,
        status=Level.FAIL,
        found=f"no destination of {configuration_set} reaches {queue_arn}{note}: "
        + "; ".join(seen),
        fix="subscribe the queue to the destination's topic (aws sns subscribe --protocol sqs "
        f"--notification-endpoint {queue_arn} --topic-arn TOPIC) and allow the topic in the "
        "queue's policy, or " + add,
    )


def _subscribed(clients: Clients, topic: str, queue_arn: str) -> str | None:
    """None if ``topic`` has a confirmed SQS subscription of ``queue_arn``, else why not."""
    region = topic.split(":")[3] if topic.count(":") >= 5 else ""
    try:
        sns = clients.aws("sns", region)
        pages = sns.get_paginator("list_subscriptions_by_topic").paginate(TopicArn=topic)
        subscriptions = [s for page in pages for s in page.get("Subscriptions", [])]
    except Exception as exc:
        code, text = _error(exc)
        return f"could not list its subscriptions: {code}: {text}"
    mine = [
        s for s in subscriptions if s.get("Protocol") == "sqs" and s.get("Endpoint") == queue_arn
    ]
    if not mine:
        return "the queue is not subscribed to it"
    if all(s.get("SubscriptionArn") == "PendingConfirmation" for s in mine):
        return "the queue's subscription is pending confirmation"
    return None


# -- SMTP ----------------------------------------------------------------------------------


def check_smtp(probe: Callable[[], str], where: str) -> Check:
    """One session opened as a send opens it, then closed; nothing is sent."""
    name = "smtp server"
    try:
        done = probe()
    except ConfigurationError as exc:
        return Check(check=name, status=Level.FAIL, found=str(exc), fix="fix the --smtp-* flags")
    except Exception as exc:
        return Check(
            check=name,
            status=Level.FAIL,
            found=f"{where}: {type(exc).__name__}: {_first_line(exc)}",
            fix="check --smtp-host, --smtp-port, --smtp-security and the login",
        )
    return Check(check=name, status=Level.OK, found=f"{where}: {done}")


def diagnose(
    engine: sa.Engine,
    *,
    sender: str,
    clients: Callable[[], Clients],
    smtp: tuple[Callable[[], str], str] | None,
    identities: Sequence[str],
    configuration_set: str | None,
    queue_url: str | None,
    topic_arn: str | None,
) -> list[Check]:
    """Every check, in order: the database, its grants, then the sender's (``identities``:
    the From addresses given, to which those of the newest messages are added)."""
    database, usable = check_database(engine)
    checks = [database]
    wanted = dict.fromkeys(a.lower() for a in identities)
    if usable:
        checks.append(check_grants(engine, intake=queue_url is not None))
        wanted.update(dict.fromkeys(identities_in_use(engine)[0]))
    if sender == "smtp" and smtp is not None:
        checks.append(check_smtp(*smtp))
    elif sender != "ses":
        checks.append(
            Check(
                check="sender",
                status=Level.WARN,
                found=f"could not check: doctor checks ses and smtp, not {sender}",
            )
        )
    if sender != "ses" and queue_url is None:
        return checks
    try:
        built = clients()
    except ConfigurationError as exc:
        return [*checks, Check(check="aws", status=Level.FAIL, found=str(exc), fix=exc.reason)]
    if sender == "ses":
        return checks + check_ses(
            built,
            identities=list(wanted),
            configuration_set=configuration_set,
            queue_url=queue_url,
            topic_arn=topic_arn,
        )
    assert queue_url is not None
    return [*checks, check_queue(built, queue_url)[0]]


# -- send-test -----------------------------------------------------------------------------


def enqueue_test(engine: sa.Engine, *, to: str, sender: str) -> tuple[int, str]:
    """Enqueue one test message as an app does (``Outbox.enqueue`` in a transaction, which
    also wakes a relay on PostgreSQL); (its id, its key). A bad address is a
    :class:`ConfigurationError` naming ``--to`` or ``--from``."""
    key = f"{TEST_CATEGORY}:{uuid.uuid4()}"
    outbox = Outbox(categories=[Category(name=TEST_CATEGORY, max_attempts=3)])
    try:
        message = Email(
            sender=sender,
            to=[to],
            subject=f"outbox-relay send-test {key}",
            text="A test message from outbox-relay send-test. Nothing to do.",
        )
    except InvalidEmail as exc:
        raise ConfigurationError(
            "--from" if exc.field == "sender" else "--to", exc.reason
        ) from None
    with Session(engine) as session, session.begin():
        result = outbox.enqueue(session, message, key=key, category=TEST_CATEGORY)
    return result.id, key


_GIVEN_UP = frozenset(
    {
        Status.FAILED.value,
        Status.UNKNOWN_OUTCOME.value,
        Status.CANCELLED.value,
        Status.EXPIRED.value,
    }
)
_BAD_DELIVERY = frozenset(
    {
        DeliveryStatus.REJECTED.value,
        DeliveryStatus.SUPPRESSED.value,
        DeliveryStatus.BOUNCED.value,
        DeliveryStatus.COMPLAINED.value,
    }
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """Where a test message stopped: ``ok`` and the last state seen (status, delivery)."""

    ok: bool
    state: str
    why: str


def watch(
    engine: sa.Engine,
    message_id: int,
    *,
    wait: float,
    echo: Callable[[str], None],
    poll: float = 0.25,
) -> Outcome:
    """Follow the message until it is sent (and, while an event intake runs, until its
    Delivery event), fails, or ``wait`` seconds pass; each change of state is echoed."""
    deadline = time.monotonic() + wait
    with engine.connect() as conn:
        relays, intakes = store.live_heartbeats(conn, since=read_database_time(conn) - _LIVE)
    if not relays:
        echo(
            f"message {message_id}: no relay has a heartbeat in the last {_LIVE.seconds} s: "
            "waiting anyway (start `outbox-relay run`)"
        )
    seen = None
    while True:
        with engine.connect() as conn:
            row, _ = store.get_message(conn, message_id)
        if row is None:
            return Outcome(ok=False, state="gone", why="the message is gone (pruned?)")
        state = (
            row.status if row.delivery_status is None else f"{row.status}, {row.delivery_status}"
        )
        if state != seen:
            seen = state
            extra = f" (provider id {row.provider_message_id})" if row.provider_message_id else ""
            error = (
                f": {row.last_error_code} {row.last_error_message or ''}".rstrip()
                if row.last_error_code
                else ""
            )
            echo(f"message {message_id}: {state}{extra}{error}")
        if row.status in _GIVEN_UP or row.delivery_status in _BAD_DELIVERY:
            return Outcome(
                ok=False, state=state, why=f"it ended {state}; see `outbox-relay show {message_id}`"
            )
        if row.delivery_status == DeliveryStatus.DELIVERED.value:
            return Outcome(ok=True, state=state, why="delivered")
        if row.status == Status.SENT.value and not intakes:
            return Outcome(
                ok=True, state=state, why="sent; no event intake runs, so delivery is not confirmed"
            )
        if time.monotonic() >= deadline:
            waiting = (
                "its Delivery event (check doctor's event destination line)"
                if row.status == Status.SENT.value
                else "a relay to send it" + ("" if relays else " (none is running)")
            )
            return Outcome(
                ok=False, state=state, why=f"timed out after {wait:g} s waiting for {waiting}"
            )
        time.sleep(poll)
