"""Delivery through Amazon SES v2 ``SendEmail``.

SES has no idempotency token, so the one thing this sender must get right is telling "SES did
not take it" (safe to retry) from "SES may have taken it" (ambiguous). It decides by **what
left the process**, not by the exception's type: botocore's event hooks record, per call, how
far the call got (:class:`Progress`), and :func:`classify` reads the exception in that light.

* **Nothing sent** (``before-send`` never fired) is never ambiguous. Failing while the request
  was prepared (parameter validation, serialization) is the message's fault: a bad parameter is
  permanent, anything else transient. Failing while it was signed means no usable credentials
  (none configured, or a refresh from IMDS, ECS, STS or a credential process that failed, an
  STS ``ClientError`` included): that stops every message alike and is usually a short
  hiccup, so the relay pauses and probes instead of using up attempts.
* **Sent, provably never written**: urllib3 could not open the connection (refused, DNS,
  connect timeout, proxy unreachable) or the TLS handshake failed (a certificate the client
  does not trust, a handshake broken or timed out: the request is written only after it).
  Transient.
* **Sent and SES answered** with its own error (a ``ClientError`` for ``SendEmail`` that
  carries SES's error code, from ``x-amzn-ErrorType`` or the body, and its request id): SES
  did not accept the message. Throttling and 5xx are transient, stops (paused, suspended, bad
  credentials, daily quota) pause without using attempts, each with its scope (see
  :func:`pause_scope`: a paused configuration set or a sending identity the credentials may
  not use holds only its own messages; anything else stops the account), a rejection that
  names the From identity ("Email address is not verified. The following identities failed
  the check in region ...": not verified there) pauses that identity, configuration errors
  and other rejections (recipients named: the SES sandbox) are permanent. An error code
  this table does not know is transient if its HTTP status is 429 or 5xx, else permanent. A
  success is SES's only with its ``MessageId``.
* **Sent, and no answer or not SES's**: a read timeout, a closed connection, a TLS error while
  reading the answer, a 502 or 504 (or any status) from a proxy or load balancer without SES's
  error code and request id, a 200 without a ``MessageId``, an exception this module does not
  know: SES may have accepted the message (ambiguous).

botocore's own retries are off (``total_max_attempts=1``): it would otherwise retry read
timeouts, which is exactly how a duplicate email is born.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import ssl
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeGuard

import boto3
import botocore.exceptions as bex
from botocore.config import Config

from outbox.exceptions import ConfigurationError
from relay.pause import ACCOUNT, Scope, ScopeKind, identity, resource_scope, unverified_scope
from relay.senders import (
    Accepted,
    Ambiguous,
    BaseSender,
    Disabled,
    Outcome,
    OutgoingMessage,
    Permanent,
    Transient,
)

if TYPE_CHECKING:
    from mypy_boto3_sesv2 import SESV2Client as _SESV2Client
else:
    _SESV2Client = Any

__all__ = [
    "Progress",
    "SesSender",
    "build_client",
    "build_request",
    "classify",
    "pause_scope",
]

_log = logging.getLogger("relay")


_THROTTLING = frozenset(
    {"TooManyRequestsException", "Throttling", "ThrottlingException", "ThrottledException"}
)
_PAUSED = frozenset(
    {
        "AccountSendingPausedException",
        "SendingPausedException",
        "ConfigurationSetSendingPausedException",
        "AccountSuspendedException",
    }
)
_CREDENTIALS = frozenset(
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
_REJECTED = frozenset(
    {"MessageRejected", "BadRequestException", "InvalidParameterValue", "ValidationError"}
)
_MISCONFIGURED = frozenset(
    {
        "MailFromDomainNotVerifiedException",
        "MailFromDomainNotVerified",
        "NotFoundException",
        "ConfigurationSetDoesNotExist",
        "ConfigurationSetDoesNotExistException",
    }
)
_DAILY_QUOTA = "daily message quota exceeded"
# the tags build_request sets on every send
_RELAY_TAGS = frozenset({"outbox_message_id", "outbox_attempt", "outbox_category"})


class Progress(enum.Enum):
    """How far one ``SendEmail`` call got, as botocore's event hooks saw it."""

    PREPARING = "preparing"  # parameters validated and serialized: nothing signed, nothing sent
    SIGNING = "signing"  # credentials fetched (refreshed when due) and the request signed
    SENT = "sent"  # handed to the HTTP layer: from here on SES may have it


def classify(exc: BaseException, *, progress: Progress, sender: str = "") -> Outcome:
    """What an exception from ``sesv2.send_email`` means for a message from ``sender`` (its
    From), given how far the call got (see the module docstring for the rule). Pure."""
    text = str(exc)
    if _is_ses_answer(exc):  # an answer to SendEmail: it was sent, whatever was recorded
        return _answer(exc, sender)
    if progress is Progress.PREPARING:
        if isinstance(exc, bex.ParamValidationError):
            return Permanent(code="InvalidRequest", message=text)
        return Transient(code=_code(exc), message=text)
    if progress is Progress.SIGNING:
        return Disabled(code=_code(exc), message=text, pause=True)
    if type(exc) in _NEVER_CONNECTED:
        return Transient(code=type(exc).__name__, message=text)
    if any(_raised_in_tls_handshake(e) for e in _wrapped(exc)):
        return Transient(
            code=type(exc).__name__, message=f"{text} (in the TLS handshake: nothing was sent)"
        )
    if isinstance(exc, bex.ClientError):
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        return Ambiguous(
            code=f"http_{status}",
            message=f"HTTP {status} without SES's error code and request id: {text}",
        )
    return Ambiguous(code=type(exc).__name__, message=text)


# botocore raises these (exactly these: a subclass may mean something new) for errors urllib3
# raised while opening a connection, so before anything was written
_NEVER_CONNECTED = frozenset(
    {bex.EndpointConnectionError, bex.ConnectTimeoutError, bex.ProxyConnectionError}
)


def pause_scope(
    code: str,
    text: str,
    configuration_set: str | None,
    *,
    sender: str = "",
    relay_default: str | None = None,
) -> Scope:
    """What a pausing SES answer stops, for a message from ``sender`` sent with
    ``configuration_set`` (None: it named none), by a relay whose ``--ses-configuration-set``
    is ``relay_default``. Pure.

    A message that named no set went out with the relay's default set (then every message
    naming none shares its fate: the scope is the unnamed set) or with the From identity's
    own default (then only that From's mail naming none does: :attr:`Scope.via`).

    ``ConfigurationSetSendingPausedException`` stops one configuration set; an access denial
    that names an identity (``...:identity/example.com``) or a configuration set resource
    (``...:configuration-set/marketing``) stops that one, by the name SES gave (see
    :func:`relay.pause.resource_scope`: a set the message did not name is a default, reached
    through its From address); every other stop (the account paused or suspended,
    credentials refused, the daily quota) stops the account."""
    unnamed = Scope(ScopeKind.CONFIGURATION_SET)
    if code == "ConfigurationSetSendingPausedException":
        if configuration_set is not None:
            return Scope(ScopeKind.CONFIGURATION_SET, configuration_set)
        if relay_default is not None or not sender:
            return unnamed
        return Scope(ScopeKind.CONFIGURATION_SET, via=identity(sender))
    if code in ("AccessDeniedException", "AccessDenied"):
        scope = resource_scope(text, sender=sender, configuration_set=configuration_set)
        if scope is not None and scope.via and relay_default is not None:
            return unnamed  # the relay's default set, which every message naming none uses
        if scope is not None:
            return scope
    return ACCOUNT


def _answer(exc: bex.ClientError, sender: str) -> Outcome:
    """SES's own error answer: it did not accept the message."""
    error = exc.response.get("Error", {})
    code = str(error.get("Code") or "Unknown")
    text = str(error.get("Message") or "")
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    if _DAILY_QUOTA in text.lower():
        return Disabled(code="DailyQuotaExceeded", message=text, pause=True)
    if code in _THROTTLING or status == 429:
        return Transient(code=code, message=text, throttled=True)
    if code in _PAUSED or code in _CREDENTIALS:
        return Disabled(code=code, message=text, pause=True)
    if code in _MISCONFIGURED:
        return Permanent(code=code, message=text, config_error=True)
    if scope := unverified_scope(text, sender):
        # the From identity is not verified in this region: every message from it is refused
        # alike until someone verifies it (or fixes AWS_REGION); its mail waits, the rest goes
        return Disabled(code=code, message=text, pause=True, scope=scope)
    if code in _REJECTED:
        return Permanent(code=code, message=text)
    if status >= 500:
        return Transient(code=code, message=text)
    return Permanent(code=code, message=text)


def _is_ses_answer(exc: BaseException) -> TypeGuard[bex.ClientError]:
    """A ``ClientError`` for ``SendEmail`` with SES's request id and an error code that SES
    named. Without an ``x-amzn-ErrorType`` header or a typed JSON body botocore falls back to
    the bare HTTP status as the code ("502"): that answer came from something else."""
    if not isinstance(exc, bex.ClientError) or exc.operation_name != "SendEmail":
        return False
    code = str(exc.response.get("Error", {}).get("Code") or "")
    request_id = exc.response.get("ResponseMetadata", {}).get("RequestId")
    return bool(request_id) and bool(code) and not code.isdigit()


def _code(exc: BaseException) -> str:
    if isinstance(exc, bex.ClientError):
        return str(exc.response.get("Error", {}).get("Code") or type(exc).__name__)
    return type(exc).__name__


def _wrapped(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it wraps: botocore's ``error=``, urllib3's wrapped exception (an
    argument), ``raise ... from``. Not ``__context__``: an unrelated error being handled when
    this one was raised is no part of its story."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo:
        current = todo.pop()
        if any(current is s for s in seen):
            continue
        seen.append(current)
        yield current
        kwargs = getattr(current, "kwargs", None)
        if isinstance(kwargs, dict) and isinstance(kwargs.get("error"), BaseException):
            todo.append(kwargs["error"])
        todo.extend(a for a in current.args if isinstance(a, BaseException))
        if current.__cause__ is not None:
            todo.append(current.__cause__)


def _raised_in_tls_handshake(exc: BaseException) -> bool:
    """True if ``exc`` is a certificate check failure, or was raised inside the ``ssl``
    module's ``do_handshake``: the handshake of a new connection, which comes before the
    request is written (Python's ssl sends no early data)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return True
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame
    return frame.f_code.co_name == "do_handshake" and frame.f_globals.get("__name__") == "ssl"


def build_request(
    message: OutgoingMessage, *, configuration_set: str | None = None
) -> dict[str, Any]:
    """The ``SendEmail`` arguments for ``message``, tagged with the outbox id, the attempt
    (its claim token) and the category, so SES events (sends, deliveries, bounces,
    complaints) map back to the row and to the attempt that caused them.

    The relay's tags win over an email's own of the same name (an email stored before a name
    was reserved): SES refuses a request that names one tag twice. Every value fits SES's
    tag charset (letters, digits, ``_``, ``-``; at most 256): an id's digits, a UUID, a
    category name."""
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
            *({"Name": k, "Value": v} for k, v in email.tags.items() if k not in _RELAY_TAGS),
            {"Name": "outbox_message_id", "Value": str(message.id)},
            *(
                ({"Name": "outbox_attempt", "Value": message.claim_token},)
                if message.claim_token
                else ()
            ),
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
) -> _SESV2Client:
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
    client: _SESV2Client = session.client("sesv2", config=config)
    return client


class _Progress(threading.local):
    """How far this thread's current ``SendEmail`` call got."""

    def __init__(self) -> None:
        self.reached = Progress.PREPARING


class SesSender(BaseSender):
    """Sends through SES v2; thread-safe (boto3 clients are, and what a call reached is kept
    per thread: a call runs on the thread that made it, hooks included)."""

    name = "ses"

    def __init__(self, client: _SESV2Client, *, configuration_set: str | None = None) -> None:
        self.client = client
        self.configuration_set = configuration_set
        self._progress = _Progress()
        events = client.meta.events
        events.register("before-sign.sesv2.SendEmail", self._signing)
        events.register("before-send.sesv2.SendEmail", self._sending)
        # needs-retry follows every attempt at sending, failed or not: should before-send ever
        # go unheard, a request that went out is still counted as sent
        events.register("needs-retry.sesv2.SendEmail", self._sending)

    def _signing(self, **kwargs: Any) -> None:
        self._progress.reached = Progress.SIGNING

    def _sending(self, **kwargs: Any) -> None:
        # returns None: botocore sends the request itself and decides on retries alone
        self._progress.reached = Progress.SENT

    def send(self, message: OutgoingMessage) -> Outcome:
        request = build_request(message, configuration_set=self.configuration_set)
        progress = self._progress
        progress.reached = Progress.PREPARING
        try:
            response = self.client.send_email(**request)
        except Exception as exc:  # classified, never raised: see classify()
            email = message.email
            outcome = classify(exc, progress=progress.reached, sender=email.sender)
            if isinstance(outcome, Disabled) and outcome.pause and outcome.scope == ACCOUNT:
                scope = pause_scope(
                    outcome.code,
                    outcome.message,
                    email.configuration_set,
                    sender=email.sender,
                    relay_default=self.configuration_set,
                )
                outcome = dataclasses.replace(outcome, scope=scope)
            return outcome
        message_id = response.get("MessageId")
        if not message_id:  # a 200 from something that is not SES (a portal, a proxy)
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return Ambiguous(
                code=f"http_{status}", message="a success answer without SES's MessageId"
            )
        return Accepted(provider_message_id=message_id)

    def where(self) -> dict[str, str]:
        """The region and endpoint boto3 resolved (from ``AWS_REGION``, ``AWS_ENDPOINT_URL``)."""
        meta = self.client.meta
        return {"region": str(meta.region_name), "endpoint": str(meta.endpoint_url)}

    def max_send_rate(self) -> float | None:
        """The account's ``MaxSendRate`` (recipients per second), or None if SES (or an
        emulator) does not answer ``GetAccount``."""
        try:
            quota = self.client.get_account().get("SendQuota", {})
        except Exception as exc:
            _log.warning(
                "GetAccount failed (%s); no account send rate known",
                type(exc).__name__,
                extra={"action": "send_quota_unknown"},
            )
            return None
        rate = quota.get("MaxSendRate")
        return float(rate) if rate else None
