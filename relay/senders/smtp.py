"""Delivery over SMTP with the standard library's :mod:`smtplib`.

SMTP has no idempotency either, so the rule is the same as for SES (see :func:`classify`):

* The server **answered** with a reply code: it did not take the message. 4xx is transient
  (421, the server closing the connection, also slows the relay down), 5xx permanent; bad
  credentials or a server that lacks STARTTLS/AUTH pause the relay without using attempts.
* **No answer** came: before the ``DATA`` command nothing can have been queued (transient);
  once ``DATA`` was sent the server may have queued the message before the connection died or
  timed out (ambiguous).

Recipients are answered one by one, before ``DATA``, and the sender decides there whether to
send the message at all (:meth:`_TrackedSMTP.transact`). A recipient refused for now
(greylisting, a full mailbox) ends the transaction with ``RSET``: nothing is queued for anyone
and the whole message is retried, so nobody is left out and nobody gets it twice. Recipients
refused for good (5xx) do not stop the others; the :class:`~relay.senders.Accepted` outcome
lists them.

Each worker thread keeps one connection (opened lazily, checked with ``RSET`` before reuse,
reopened when the server has closed it). The password never appears in a log line, a
``repr`` or an outcome message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import math
import os
import re
import smtplib
import socket
import ssl
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from email.generator import BytesGenerator
from email.message import EmailMessage
from email.utils import formatdate, parseaddr
from typing import TYPE_CHECKING, Any, Literal, Self

from outbox.exceptions import ConfigurationError, InvalidEmail
from relay.pause import Scope, ScopeKind, identity, resource_scope, unverified_scope
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
    from _typeshed import ReadableBuffer

__all__ = [
    "DEFAULT_SECURITY",
    "OUTBOX_ID_HEADER",
    "SECURITY_MODES",
    "Security",
    "SmtpSender",
    "SmtpSettings",
    "classify",
    "from_env",
]

_log = logging.getLogger("relay")

Security = Literal["starttls", "ssl", "none"]
SECURITY_MODES: tuple[Security, ...] = ("starttls", "ssl", "none")
DEFAULT_SECURITY: Security = "starttls"
OUTBOX_ID_HEADER = "X-Outbox-Message-Id"
_MAX_MESSAGE_CHARS = 1000
_MAX_PROVIDER_ID_CHARS = 255
_MAX_REFUSAL_CHARS = 300
_CLOSING = 421  # "service not available, closing transmission channel"
# authentication required, mechanism too weak, credentials invalid, encryption required
_AUTHENTICATION = frozenset({530, 534, 535, 538})
# MAIL FROM refused for the address itself (not allowed, not owned, rejected); not 552 (the
# message's size) nor 555 (a parameter of this transaction)
_SENDER_NOT_ALLOWED = frozenset({550, 553, 554})
# RFC 3463's enhanced status code at the start of a reply ("5.3.4 Message too big")
_ENHANCED = re.compile(r"\s*[245]\.(\d{1,3}\.\d{1,3})\b")
# the only ones that, to MAIL FROM, are about this message (its size, announced with SIZE=):
# nothing else of it has been sent yet, so any other refusal there is the sender's or the
# server's, for every message alike
_MESSAGE_TOO_BIG = frozenset({"3.4", "2.3"})


# -- classification -------------------------------------------------------------------------


def classify(exc: BaseException, *, data_sent: bool, sender: str = "") -> Outcome:
    """What an exception raised while sending one message from ``sender`` (its From) means
    for it. Pure.

    ``data_sent`` tells whether the ``DATA`` command had been sent on the connection: from then
    on a lost connection or a timeout may hide a message the server already queued.

    The relay's credentials and the sending identity are not the message's problem: an
    authentication reply (530, 534, 535, 538) pauses the relay whatever command it answered,
    and a refusal that names the From identity pauses that identity (SES's SMTP interface:
    "554 Message rejected: Email address is not verified. The following identities failed
    the check in region ...: <the From>", "554 Access denied: ... on resource
    `...:identity/<it>'"; any server: a 550, 553 or 554 to ``MAIL FROM``).
    """
    text = _describe(exc)
    if isinstance(exc, InvalidEmail):  # refused while rendering, before any connection
        return Permanent(code="invalid_payload", message=text)
    if isinstance(exc, smtplib.SMTPAuthenticationError):
        if _is_temporary(exc.smtp_code):  # 454 "temporary authentication failure"
            return _temporary(exc.smtp_code, text)
        return Disabled(code="smtp_auth_failed", message=text, pause=True)
    if isinstance(exc, smtplib.SMTPNotSupportedError):
        return Disabled(code="smtp_not_supported", message=text, pause=True)
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        return _recipients_refused(exc, text)
    if isinstance(exc, smtplib.SMTPConnectError | smtplib.SMTPHeloError):
        # refused while setting up the session: not this message's fault, never queued
        code = exc.smtp_code
        if _is_temporary(code):
            return _temporary(code, text)
        code_name = f"smtp_{code}" if _is_reply(code) else "smtp_connect_failed"
        return Transient(code=code_name, message=text)
    if isinstance(exc, smtplib.SMTPResponseException):  # sender refused, data error, ...
        code = exc.smtp_code
        if _is_temporary(code):
            return _temporary(code, text)
        if code in _AUTHENTICATION:  # "530 5.7.0 Authentication required" to MAIL FROM
            return Disabled(code="smtp_auth_failed", message=text, pause=True)
        reply = _reply_text(exc.smtp_error)
        # SMTP names no configuration set: one SES denies is the From identity's default
        scope = unverified_scope(reply, sender) or resource_scope(
            reply, sender=sender, configuration_set=None
        )
        refused_from = (
            isinstance(exc, smtplib.SMTPSenderRefused)
            and code in _SENDER_NOT_ALLOWED
            and not _blames_message(reply)
        )
        if scope is None and refused_from and sender:
            scope = Scope(ScopeKind.IDENTITY, identity(sender))
        if scope is not None and _is_permanent(code):
            return Disabled(code=f"smtp_{code}", message=text, pause=True, scope=scope)
        if _is_permanent(code):
            # MAIL FROM refused for a parameter or without a From to pause: every message
            # will be; 552 there, or 5.3.4 or 5.2.3, is this message's own size (SIZE=)
            setup = (
                isinstance(exc, smtplib.SMTPSenderRefused)
                and code != 552
                and not _blames_message(reply)
            )
            return Permanent(code=f"smtp_{code}", message=text, config_error=setup)
        # not an error reply at all (garbled, or an unexpected 2xx/3xx)
        if data_sent:
            return Ambiguous(code="smtp_unexpected_reply", message=text)
        return Transient(code="smtp_unexpected_reply", message=text)
    if isinstance(exc, smtplib.SMTPServerDisconnected):
        if data_sent:
            return Ambiguous(code="smtp_connection_lost_after_data", message=text)
        return Transient(code="smtp_connection_lost", message=text)
    if isinstance(exc, smtplib.SMTPException):  # a client-side SMTP error without a reply
        if data_sent:
            return Ambiguous(code="smtp_error_after_data", message=text)
        return Transient(code="smtp_error", message=text)
    if isinstance(exc, OSError):  # SMTPException is an OSError too: checked above
        if data_sent:
            return Ambiguous(code="smtp_connection_lost_after_data", message=text)
        return Transient(code=_network_code(exc), message=text)
    if data_sent:
        return Ambiguous(code="smtp_unexpected_error", message=text)
    return Transient(code="smtp_unexpected_error", message=text)


def _blames_message(reply: str) -> bool:
    """Whether a refusal of ``MAIL FROM`` says this message is too big (5.3.4, 5.2.3): its own
    problem, unlike any other refusal there (a 5.3.5 misconfigured server, a 5.2.1 disabled
    sender mailbox, an unknown code), which every message from the sender would meet."""
    found = _ENHANCED.match(reply)
    return found is not None and found.group(1) in _MESSAGE_TOO_BIG


def _is_reply(code: int) -> bool:
    return 200 <= code <= 599


def _is_temporary(code: int) -> bool:
    return 400 <= code <= 499


def _is_permanent(code: int) -> bool:
    return 500 <= code <= 599


def _temporary(code: int, text: str) -> Transient:
    """A 4xx reply. 421 is the server shedding load or going down, whatever the command: the
    relay slows down (``throttled``). Other 4xx replies concern this message or one recipient
    (greylisting, a full mailbox, a local error): slowing every other message would not help."""
    return Transient(code=f"smtp_{code}", message=text, throttled=code == _CLOSING)


def _network_code(exc: OSError) -> str:
    if isinstance(exc, ssl.SSLError):
        return "smtp_tls_error"
    if isinstance(exc, socket.gaierror):
        return "smtp_dns_error"
    if isinstance(exc, ConnectionRefusedError):
        return "smtp_connection_refused"
    if isinstance(exc, TimeoutError):
        return "smtp_timeout"
    return "smtp_network_error"


def _recipients_refused(exc: smtplib.SMTPRecipientsRefused, text: str) -> Outcome:
    """Recipients refused before DATA, so the message went to nobody: any refusal for now
    defers all of it; refusals that are all for good fail it."""
    codes = [code for code, _reply in exc.recipients.values()]
    if _CLOSING in codes:  # the server hung up in the middle: the rest were never asked
        return _temporary(_CLOSING, text)
    if any(_is_temporary(code) for code in codes):
        return Transient(code="smtp_recipient_deferred", message=text)
    if codes and all(_is_permanent(code) for code in codes):
        return Permanent(code=f"smtp_{codes[0]}", message=text)
    return Transient(code="smtp_recipients_refused", message=text)  # not a reply code


def _refusal(address: str, reply: tuple[int, bytes]) -> str:
    """One permanently refused recipient, as :attr:`Accepted.refused` lists it."""
    text = " ".join(f"{address}: {reply[0]} {_reply_text(reply[1])}".split())
    return text if len(text) <= _MAX_REFUSAL_CHARS else text[: _MAX_REFUSAL_CHARS - 3] + "..."


def _reply_text(reply: bytes | str) -> str:
    return reply.decode("utf-8", "replace") if isinstance(reply, bytes) else str(reply)


def _describe(exc: BaseException) -> str:
    """A short text for the outcome: the server's reply, never the recipients' addresses in
    bulk."""
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        text = _describe_refusals(exc)
    elif isinstance(exc, smtplib.SMTPResponseException):
        text = f"{type(exc).__name__}: {exc.smtp_code} {_reply_text(exc.smtp_error)}"
    else:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    text = " ".join(text.split())
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[: _MAX_MESSAGE_CHARS - 3] + "..."


def _describe_refusals(exc: smtplib.SMTPRecipientsRefused) -> str:
    """How many were refused (of how many, when known), and the first telling reply: the
    first deferral if there is one, since that is why the message waits."""
    replies = list(exc.recipients.values())
    deferred = [reply for reply in replies if _is_temporary(reply[0])]
    of = f" of {exc.asked}" if isinstance(exc, _RefusedBeforeData) else ""
    if deferred:
        others = len(replies) - len(deferred)
        text = f"{len(deferred)}{of} recipient(s) deferred"
        text += f", {others} refused, nothing sent" if others else ", nothing sent"
    else:
        text = f"{len(replies)}{of} recipient(s) refused"
    if not replies:
        return text
    code, reply = (deferred or replies)[0]
    return f"{text}; first: {code} {_reply_text(reply)}"


# -- connections ----------------------------------------------------------------------------


class _RefusedBeforeData(smtplib.SMTPRecipientsRefused):
    """The transaction ended before ``DATA`` because of these refusals; ``asked`` recipients
    were named (the accepted ones are not in ``recipients``)."""

    def __init__(self, recipients: dict[str, tuple[int, bytes]], *, asked: int) -> None:
        super().__init__(recipients)
        self.asked = asked


class _TrackedSMTP(smtplib.SMTP):
    """An SMTP connection that runs the relay's mail transaction and remembers whether
    ``DATA`` was sent for the current message."""

    data_sent = False

    def data(self, msg: ReadableBuffer | str) -> tuple[int, bytes]:
        self.data_sent = True
        return super().data(msg)

    def transact(
        self, mime: EmailMessage, from_addr: str, to_addrs: Sequence[str]
    ) -> dict[str, tuple[int, bytes]]:
        """``MAIL FROM``, ``RCPT TO`` for each recipient, then ``DATA`` only if every
        recipient was accepted or refused for good, and at least one accepted. Returns the
        ones refused for good.

        smtplib's ``sendmail`` sends ``DATA`` as soon as one recipient is accepted, so one
        refused for now would quietly miss the message. Here any such refusal, or no recipient
        accepted, ends the transaction with ``RSET`` before ``DATA`` and raises
        :class:`_RefusedBeforeData`: the server queued nothing, and the whole message can be
        tried again without a duplicate. Raises like ``sendmail`` otherwise
        (``SMTPSenderRefused``, ``SMTPDataError``; a 421 closes the connection).
        """
        with io.BytesIO() as buffer:  # as send_message does (our messages carry no Bcc)
            BytesGenerator(buffer).flatten(mime, linesep="\r\n")
            body = buffer.getvalue()
        self.ehlo_or_helo_if_needed()
        options = [f"size={len(body)}"] if self.does_esmtp and self.has_extn("size") else []
        code, reply = self.mail(from_addr, options)
        if code != 250:
            self._abandon(code)
            raise smtplib.SMTPSenderRefused(code, reply, from_addr)
        refused: dict[str, tuple[int, bytes]] = {}
        for address in to_addrs:
            code, reply = self.rcpt(address)
            if code in (250, 251):
                continue
            refused[address] = (code, reply)
            if code == _CLOSING:  # the server is going away: the rest cannot be asked
                self.close()
                raise _RefusedBeforeData(refused, asked=len(to_addrs))
        everyone = len(refused) == len(to_addrs)
        if everyone or not all(_is_permanent(code) for code, _reply in refused.values()):
            self._reset()
            raise _RefusedBeforeData(refused, asked=len(to_addrs))
        code, reply = self.data(body)
        if code != 250:
            self._abandon(code)
            raise smtplib.SMTPDataError(code, reply)
        return refused

    def _abandon(self, code: int) -> None:
        """After a refusal: close the connection on 421, else reset the transaction."""
        if code == _CLOSING:
            self.close()
        else:
            self._reset()

    def _reset(self) -> None:
        """``RSET``; if that fails the connection is closed (the next send opens a new one)
        and the refusal that led here still stands."""
        try:
            self.rset()
        except OSError:  # SMTPServerDisconnected, a timeout
            self.close()


class _TrackedSMTPSSL(_TrackedSMTP, smtplib.SMTP_SSL):
    """The same over implicit TLS (port 465)."""


class _ThreadState(threading.local):
    conn: _TrackedSMTP | None = None


# -- the sender -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class SmtpSettings:
    """How to reach one SMTP server, checked when made: a bad value raises
    :class:`~outbox.exceptions.ConfigurationError` naming the ``outbox-relay run`` flag that
    sets it (each flag's ``OUTBOX_SMTP_*`` variable sets it too).

    ``port`` None is 465 with ``ssl``, else 587 (:attr:`effective_port`). ``timeout`` is how
    long each connect and read on the connection may take, in seconds. ``local_hostname``
    (the EHLO name) and ``ssl_context`` have no flag."""

    host: str
    port: int | None = None
    security: Security = DEFAULT_SECURITY
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    timeout: float = 20.0
    local_hostname: str | None = None
    ssl_context: ssl.SSLContext | None = field(default=None, repr=False, compare=False)
    allow_cleartext_login: bool = False  # a login over security "none": only if asked for

    def __post_init__(self) -> None:
        host = self.host
        if host is None or host == "":
            raise ConfigurationError(
                "--smtp-host", "required (or OUTBOX_SMTP_HOST): the SMTP server's name or address"
            )
        if not isinstance(host, str) or any(c.isspace() for c in host):
            raise ConfigurationError("--smtp-host", "must be a host name or address, no spaces")
        port = self.port
        if port is not None and (
            isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535
        ):
            raise ConfigurationError("--smtp-port", "must be an integer from 1 to 65535")
        if self.security not in SECURITY_MODES:
            raise ConfigurationError(
                "--smtp-security",
                f"{self.security!r} is not one of {', '.join(SECURITY_MODES)}",
            )
        username, password = self.username, self.password
        if username is not None and (not isinstance(username, str) or not username):
            raise ConfigurationError("--smtp-username", "must be a non-empty string")
        if password is not None and (not isinstance(password, str) or not password):
            raise ConfigurationError("--smtp-password", "must be a non-empty string")
        if username is not None and password is None:
            raise ConfigurationError("--smtp-password", "is required with --smtp-username")
        if password is not None and username is None:
            raise ConfigurationError("--smtp-username", "is required with --smtp-password")
        if username is not None and self.security == "none" and not self.allow_cleartext_login:
            raise ConfigurationError(
                "--smtp-security",
                "is none, so the login would cross the network in clear text: use starttls or "
                "ssl, or pass --smtp-allow-cleartext-login for a server on a trusted network",
            )
        timeout = self.timeout
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ConfigurationError("--smtp-timeout", "must be a positive number of seconds")
        name = self.local_hostname
        if name is not None and (
            not isinstance(name, str) or not name or any(c.isspace() for c in name)
        ):
            raise ConfigurationError("local_hostname", "must be a host name, no spaces")
        if self.ssl_context is not None and not isinstance(self.ssl_context, ssl.SSLContext):
            raise ConfigurationError("ssl_context", "must be an ssl.SSLContext")
        if self.ssl_context is not None and self.security == "none":
            raise ConfigurationError(
                "--smtp-security", "an ssl_context was given, but security is 'none'"
            )

    @property
    def effective_port(self) -> int:
        """``port``, or its default: 465 with ``ssl``, else 587."""
        if self.port is not None:
            return self.port
        return 465 if self.security == "ssl" else 587

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        """Read ``OUTBOX_SMTP_HOST`` (required), ``OUTBOX_SMTP_PORT``, ``OUTBOX_SMTP_SECURITY``
        (any case), ``OUTBOX_SMTP_USERNAME``, ``OUTBOX_SMTP_PASSWORD`` and
        ``OUTBOX_SMTP_TIMEOUT``: the variables of the ``--smtp-*`` flags. An empty variable
        counts as unset; the password is taken as given (spaces may be part of it), the rest
        stripped."""
        env = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            return env.get(f"OUTBOX_SMTP_{name}", "").strip() or None

        values: dict[str, Any] = {
            "host": get("HOST") or "",
            "username": get("USERNAME"),
            "password": env.get("OUTBOX_SMTP_PASSWORD") or None,
            "allow_cleartext_login": (get("ALLOW_CLEARTEXT_LOGIN") or "").lower()
            in ("1", "true", "yes", "on"),
        }
        if (security := get("SECURITY")) is not None:
            values["security"] = security.lower()
        if (port := get("PORT")) is not None:
            try:
                values["port"] = int(port)
            except ValueError:
                raise ConfigurationError(
                    "--smtp-port", f"OUTBOX_SMTP_PORT={port!r} is not an integer"
                ) from None
        if (timeout := get("TIMEOUT")) is not None:
            try:
                values["timeout"] = float(timeout)
            except ValueError:
                raise ConfigurationError(
                    "--smtp-timeout", f"OUTBOX_SMTP_TIMEOUT={timeout!r} is not a number"
                ) from None
        return cls(**values)


class SmtpSender(BaseSender):
    """Sends through an SMTP server (submission with STARTTLS, implicit TLS, or plain), as
    :class:`SmtpSettings` say.

    Thread-safe: every thread has its own connection. Call :meth:`close` once no send is in
    flight to say QUIT on every connection.
    """

    name = "smtp"

    def __init__(self, settings: SmtpSettings) -> None:
        if not isinstance(settings, SmtpSettings):
            raise TypeError(
                f"SmtpSender takes SmtpSettings(host=..., ...), not {type(settings).__name__}"
            )
        self.settings = settings
        self.host = settings.host
        self.port = settings.effective_port
        self.security: Security = settings.security
        self.username = settings.username
        self._password = settings.password
        self.timeout = float(settings.timeout)
        self.local_hostname = settings.local_hostname
        self._ssl_context = settings.ssl_context
        if self._ssl_context is None and settings.security != "none":
            self._ssl_context = ssl.create_default_context()
        self._local = _ThreadState()
        self._lock = threading.Lock()
        self._connections: dict[threading.Thread, _TrackedSMTP] = {}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        """An SmtpSender with :meth:`SmtpSettings.from_env` (``OUTBOX_SMTP_*``; the timeout
        20 seconds unless ``OUTBOX_SMTP_TIMEOUT`` says otherwise)."""
        return cls(SmtpSettings.from_env(environ))

    def __repr__(self) -> str:
        user = "" if self.username is None else f", username={self.username!r}"
        return (
            f"SmtpSender(host={self.host!r}, port={self.port}, "
            f"security={self.security!r}{user}, timeout={self.timeout:g})"
        )

    # -- sending ----------------------------------------------------------------------------

    def send(self, message: OutgoingMessage) -> Outcome:
        email = message.email
        if email.template is not None:
            return Permanent(
                code="template_not_supported_by_smtp",
                message=f"template {email.template!r} is rendered by SES; SMTP cannot send it",
            )
        conn: _TrackedSMTP | None = None
        try:
            mime = self._mime(message)
            from_addr = parseaddr(email.sender)[1]
            to_addrs = list(dict.fromkeys(parseaddr(a)[1] for a in email.recipients))
            conn = self._connection()
            conn.data_sent = False
            refused = conn.transact(mime, from_addr, to_addrs)
        except Exception as exc:  # classified, never raised: see classify()
            data_sent = conn is not None and conn.data_sent
            outcome = self._scrubbed(classify(exc, data_sent=data_sent, sender=email.sender))
            if conn is not None and not _reusable_after(exc):
                self._discard(conn)
            return outcome
        if refused:
            _log.warning(
                "smtp server refused %d of %d recipients for good; sent to the others",
                len(refused),
                len(to_addrs),
                extra={"action": "smtp_partial_refusal", "message_id": message.id},
            )
        # outbox_messages.provider_message_id is 255 characters; a Message-ID may be longer
        return self._scrubbed(
            Accepted(
                provider_message_id=str(mime["Message-ID"])[:_MAX_PROVIDER_ID_CHARS],
                refused=tuple(_refusal(address, reply) for address, reply in refused.items()),
            )
        )

    def _mime(self, message: OutgoingMessage) -> EmailMessage:
        mime = message.email.to_mime()
        if "Message-ID" not in mime:
            domain = parseaddr(message.email.sender)[1].rpartition("@")[2] or "localhost"
            # The same on every attempt: a receiving server can drop a resent duplicate.
            digest = hashlib.sha256(message.key.encode()).hexdigest()[:16]
            mime["Message-ID"] = f"<outbox.{message.id}.{digest}@{domain}>"
        if "Date" not in mime:
            mime["Date"] = formatdate(usegmt=True)
        del mime[OUTBOX_ID_HEADER]
        mime[OUTBOX_ID_HEADER] = str(message.id)
        return mime

    def _scrubbed(self, outcome: Outcome) -> Outcome:
        """Belt and braces: a server that echoes the password must not get it into the
        database or the logs."""
        secret = self._password
        if secret is None:
            return outcome
        if isinstance(outcome, Accepted):
            if not any(secret in refusal for refusal in outcome.refused):
                return outcome
            refused = tuple(refusal.replace(secret, "***") for refusal in outcome.refused)
            return dataclasses.replace(outcome, refused=refused)
        if secret not in outcome.message:
            return outcome
        return dataclasses.replace(outcome, message=outcome.message.replace(secret, "***"))

    # -- connections ------------------------------------------------------------------------

    def _connection(self) -> _TrackedSMTP:
        """This thread's connection: reused while it answers RSET, else opened anew."""
        conn = self._local.conn
        if conn is not None:
            if conn.sock is not None and _alive(conn):
                return conn
            self._discard(conn)
        conn = self._open()
        self._local.conn = conn
        current = threading.current_thread()
        with self._lock:
            dead = [t for t in self._connections if not t.is_alive() and t is not current]
            stale = [self._connections.pop(t) for t in dead]
            self._connections[current] = conn
        for old in stale:  # threads that ended without closing theirs
            old.close()
        return conn

    def _open(self) -> _TrackedSMTP:
        # The host goes to the constructor, which connects: smtplib only verifies the TLS
        # certificate against a host name given there. Every failure in it closes the socket.
        conn: _TrackedSMTP
        if self.security == "ssl":
            conn = _TrackedSMTPSSL(
                self.host,
                self.port,
                local_hostname=self.local_hostname,
                timeout=self.timeout,
                context=self._ssl_context,
            )
        else:
            conn = _TrackedSMTP(
                self.host, self.port, local_hostname=self.local_hostname, timeout=self.timeout
            )
        try:
            conn.ehlo_or_helo_if_needed()
            if self.security == "starttls":
                conn.starttls(context=self._ssl_context)
                conn.ehlo()
            if self.username is not None and self._password is not None:
                conn.login(self.username, self._password)
        except (smtplib.SMTPAuthenticationError, smtplib.SMTPNotSupportedError):
            conn.close()
            raise
        except smtplib.SMTPResponseException as exc:
            # EHLO, STARTTLS or AUTH answered with an error: the session could not be set up
            conn.close()
            raise smtplib.SMTPConnectError(exc.smtp_code, exc.smtp_error) from exc
        except smtplib.SMTPException as exc:
            conn.close()
            if type(exc) is smtplib.SMTPException:  # "No suitable authentication method found."
                raise smtplib.SMTPNotSupportedError(str(exc)) from exc
            raise
        except BaseException:
            conn.close()
            raise
        _log.debug(
            "smtp connection opened",
            extra={"action": "smtp_connected", "host": self.host, "port": self.port},
        )
        return conn

    def _discard(self, conn: _TrackedSMTP) -> None:
        conn.close()
        if self._local.conn is conn:
            self._local.conn = None
        with self._lock:
            current = threading.current_thread()
            if self._connections.get(current) is conn:
                del self._connections[current]

    def probe(self) -> str:
        """Open one connection as a send would (connect, EHLO, STARTTLS, login), say QUIT,
        and return what was done; raises what the opening raised. For ``outbox-relay
        doctor``: nothing is sent."""
        conn = self._open()
        done = ["connected", "EHLO"]
        if self.security != "none":
            done.append("TLS" if self.security == "ssl" else "STARTTLS")
        if self.username is not None and self._password is not None:
            done.append(f"logged in as {self.username}")
        try:
            conn.quit()
        except (smtplib.SMTPException, OSError):
            pass
        finally:
            conn.close()
        return ", ".join(done)

    def where(self) -> dict[str, str]:
        """The server and how the connection is encrypted, for the relay's start line."""
        return {"endpoint": f"{self.settings.host}:{self.port}", "security": self.settings.security}

    def close(self) -> None:
        """QUIT and close every connection. Call it when no send is in flight; a later send
        opens a new connection."""
        with self._lock:
            connections = list(self._connections.values())
            self._connections.clear()
        for conn in connections:
            try:
                if conn.sock is not None:
                    conn.quit()
            except (smtplib.SMTPException, OSError):
                pass
            finally:
                conn.close()

    @property
    def open_connections(self) -> int:
        """How many connections are open (one at most per thread)."""
        with self._lock:
            return sum(1 for conn in self._connections.values() if conn.sock is not None)


def _alive(conn: _TrackedSMTP) -> bool:
    try:
        code, _reply = conn.rset()
    except OSError:  # SMTPServerDisconnected and every SMTPException are OSErrors
        return False
    return code == 250


def _reusable_after(exc: BaseException) -> bool:
    """After a refusal the transaction was reset (or the connection closed, which the next
    send sees); after anything else the connection's state is unknown."""
    return isinstance(
        exc,
        smtplib.SMTPSenderRefused | smtplib.SMTPRecipientsRefused | smtplib.SMTPDataError,
    )


def from_env() -> SmtpSender:
    """``outbox-relay run --sender relay.senders.smtp:from_env``: an :class:`SmtpSender` built
    from the ``OUTBOX_SMTP_*`` variables."""
    return SmtpSender.from_env()
