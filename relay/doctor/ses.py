"""SES's checks (:func:`check_ses`): the region and where it came from, the account, each
sending identity; then the configuration set, its event destination and the events queue
(:mod:`relay.doctor.destination`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from outbox.exceptions import ConfigurationError
from relay.doctor.aws import NOT_FOUND, Clients, aws_error, unchecked
from relay.doctor.destination import check_queue, events_checks
from relay.doctor.report import Check, Level, worst

__all__ = ["check_ses"]

_QUOTA_NEAR = 0.8  # share of Max24HourSend past which the quota is a warning


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
    checks += events_checks(clients, ses, region, configuration_set, queue, topic_arn)
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
        return unchecked(name, "GetAccount", exc, region=region)
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
        check=name, status=worst(levels), found=", ".join(found), fix="; ".join(fixes) or None
    )


def _identity(ses: Any, identity: str) -> dict[str, Any] | None:
    """GetEmailIdentity of ``identity``, None if SES has no such identity (in this region)."""
    try:
        answer: dict[str, Any] = ses.get_email_identity(EmailIdentity=identity)
    except Exception as exc:
        if aws_error(exc)[0] in NOT_FOUND:
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
        return unchecked(name, "GetEmailIdentity", exc, region=region)
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
        check=name, status=worst(levels), found=", ".join(found), fix="; ".join(fixes) or None
    )
