"""Delivery through Amazon SES v2 ``SendEmail``.

SES has no idempotency token, so the one thing this sender must get right is telling "SES did
not take it" (safe to retry) from "SES may have taken it" (ambiguous). The rule, in
:func:`classify`:

* SES **answered** with an error: it did not accept the message. Throttling and 5xx are
  transient, account-level stops (paused, suspended, bad credentials, daily quota) pause the
  relay without using attempts, configuration errors and rejections are permanent. An error
  code this table does not know is transient if its HTTP status is 429 or 5xx, else permanent.
* **No answer** came: if the connection was never made, the request never left (transient);
  if it was made and then timed out or closed, SES may have accepted it (ambiguous).

botocore's own retries are off (``total_max_attempts=1``): it would otherwise retry read
timeouts, which is exactly how a duplicate email is born.
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any

import boto3
import botocore.exceptions as bex
from botocore.config import Config

from outbox.exceptions import ConfigurationError
from relay.senders import (
    Accepted,
    Ambiguous,
    Disabled,
    Outcome,
    OutgoingMessage,
    Permanent,
    Transient,
)

if TYPE_CHECKING:
    from mypy_boto3_sesv2 import SESV2Client
else:
    SESV2Client = Any

__all__ = [
    "SesSender",
    "build_client",
    "build_request",
    "classify",
]

log = logging.getLogger("relay")


THROTTLING = frozenset(
    {"TooManyRequestsException", "Throttling", "ThrottlingException", "ThrottledException"}
)
PAUSED = frozenset(
    {
        "AccountSendingPausedException",
        "SendingPausedException",
        "ConfigurationSetSendingPausedException",
        "AccountSuspendedException",
    }
)
CREDENTIALS = frozenset(
    {
        "UnrecognizedClientException",
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "ExpiredTokenException",
        "AccessDeniedException",
        "AccessDenied",
    }
)
REJECTED = frozenset(
    {"MessageRejected", "BadRequestException", "InvalidParameterValue", "ValidationError"}
)
MISCONFIGURED = frozenset(
    {
        "MailFromDomainNotVerifiedException",
        "MailFromDomainNotVerified",
        "NotFoundException",
        "ConfigurationSetDoesNotExist",
        "ConfigurationSetDoesNotExistException",
    }
)
DAILY_QUOTA = "daily message quota exceeded"


def classify(exc: BaseException) -> Outcome:
    """What an exception from ``sesv2.send_email`` means for the message. Pure."""
    if isinstance(exc, bex.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code") or "Unknown")
        text = str(error.get("Message") or "")
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if DAILY_QUOTA in text.lower():
            return Disabled(code="DailyQuotaExceeded", message=text, pause=True)
        if code in THROTTLING or status == 429:
            return Transient(code=code, message=text, throttled=True)
        if code in PAUSED or code in CREDENTIALS:
            return Disabled(code=code, message=text, pause=True)
        if code in MISCONFIGURED:
            return Permanent(code=code, message=text, config_error=True)
        if code in REJECTED:
            return Permanent(code=code, message=text)
        if status >= 500:
            return Transient(code=code, message=text)
        return Permanent(code=code, message=text)
    if isinstance(exc, bex.NoCredentialsError | bex.PartialCredentialsError):
        return Disabled(code=type(exc).__name__, message=str(exc), pause=True)
    if isinstance(exc, bex.ParamValidationError):
        return Permanent(code="InvalidRequest", message=str(exc))
    # Never connected: the request cannot have reached SES.
    if isinstance(
        exc,
        bex.ConnectTimeoutError
        | bex.EndpointConnectionError
        | bex.ProxyConnectionError
        | bex.SSLError,
    ):
        return Transient(code=type(exc).__name__, message=str(exc))
    # Connected, then no (complete) answer: SES may have accepted it.
    return Ambiguous(code=type(exc).__name__, message=str(exc))


def build_request(
    message: OutgoingMessage, *, configuration_set: str | None = None
) -> dict[str, Any]:
    """The ``SendEmail`` arguments for ``message``, tagged with the outbox id and category so
    SES events (bounces, complaints, deliveries) map back to rows."""
    email = message.email
    destination = {
        key: list(values)
        for key, values in (
            ("ToAddresses", email.to),
            ("CcAddresses", email.cc),
            ("BccAddresses", email.bcc),
        )
        if values
    }
    request: dict[str, Any] = {
        "FromEmailAddress": email.sender,
        "Destination": destination,
        "EmailTags": [
            *({"Name": k, "Value": v} for k, v in email.tags.items()),
            {"Name": "outbox_message_id", "Value": str(message.id)},
            {"Name": "outbox_category", "Value": message.category},
        ],
    }
    if email.reply_to:
        request["ReplyToAddresses"] = list(email.reply_to)
    config_set = email.configuration_set or configuration_set
    if config_set:
        request["ConfigurationSetName"] = config_set
    extras: dict[str, Any] = {}
    if email.headers:
        extras["Headers"] = [{"Name": k, "Value": v} for k, v in email.headers.items()]
    if email.attachments:
        extras["Attachments"] = [
            {
                "FileName": a.filename,
                "RawContent": a.content,
                "ContentType": a.content_type,
                "ContentDisposition": a.disposition.upper(),
                "ContentTransferEncoding": "BASE64",
                **({"ContentId": a.content_id} if a.content_id else {}),
            }
            for a in email.attachments
        ]
    if email.template is not None:
        request["Content"] = {
            "Template": {
                "TemplateName": email.template,
                "TemplateData": json.dumps(dict(email.template_data or {})),
                **extras,
            }
        }
        return request
    body = {}
    if email.text is not None:
        body["Text"] = {"Data": email.text, "Charset": "UTF-8"}
    if email.html is not None:
        body["Html"] = {"Data": email.html, "Charset": "UTF-8"}
    request["Content"] = {
        "Simple": {
            "Subject": {"Data": email.subject or "", "Charset": "UTF-8"},
            "Body": body,
            **extras,
        }
    }
    return request


def build_client(
    *,
    send_timeout: float,
    concurrency: int,
    connect_timeout: float = 5.0,
    region: str | None = None,
) -> SESV2Client:
    """The one SES v2 client of a relay, from boto3's standard configuration chain (region,
    credentials, ``AWS_ENDPOINT_URL_SESV2``), with botocore's retries off, explicit timeouts
    and a connection pool as large as the relay's concurrency. Refuses to build without a
    region or credentials."""
    session = boto3.session.Session(region_name=region)
    if not session.region_name and os.environ.get("AWS_REGION"):
        # boto3 reads AWS_DEFAULT_REGION only; AWS_REGION is what every other SDK, ECS and
        # Lambda use
        session = boto3.session.Session(region_name=os.environ["AWS_REGION"])
    if not session.region_name:
        raise ConfigurationError(
            "AWS_REGION",
            "no AWS region configured for SES (AWS_REGION, AWS_DEFAULT_REGION "
            "or the profile's region)",
        )
    if session.get_credentials() is None:
        raise ConfigurationError(
            "AWS credentials", "none found in the standard chain (env, profile, role)"
        )
    config = Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=min(connect_timeout, send_timeout),
        read_timeout=send_timeout,
        max_pool_connections=max(10, concurrency),
        tcp_keepalive=True,
    )
    client: SESV2Client = session.client("sesv2", config=config)
    return client


class SesSender:
    """Sends through SES v2; thread-safe (boto3 clients are)."""

    name = "ses"

    def __init__(self, client: SESV2Client, *, configuration_set: str | None = None) -> None:
        self.client = client
        self.configuration_set = configuration_set

    def send(self, message: OutgoingMessage) -> Outcome:
        request = build_request(message, configuration_set=self.configuration_set)
        try:
            response = self.client.send_email(**request)
        except Exception as exc:  # classified, never raised: see classify()
            return classify(exc)
        return Accepted(provider_message_id=response.get("MessageId"))

    def max_send_rate(self) -> float | None:
        """The account's ``MaxSendRate`` (recipients per second), or None if SES (or an
        emulator) does not answer ``GetAccount``."""
        try:
            quota = self.client.get_account().get("SendQuota", {})
        except Exception as exc:
            log.warning(
                "GetAccount failed (%s); no account send rate known",
                type(exc).__name__,
                extra={"action": "send_quota_unknown"},
            )
            return None
        rate = quota.get("MaxSendRate")
        return float(rate) if rate else None
