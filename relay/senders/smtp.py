"""Delivery over SMTP with the standard library's :mod:`smtplib`.

SMTP has no idempotency either, so the rule is the same as for SES (see :func:`classify`):

* The server **answered** with a reply code: it did not take the message (or, for a partial
  recipient refusal, it took it for the others). 4xx is transient, 5xx permanent; bad
  credentials or a server that lacks STARTTLS/AUTH pause the relay without using attempts.
* **No answer** came: before the ``DATA`` command nothing can have been queued (transient);
  once ``DATA`` was sent the server may have queued the message before the connection died or
  timed out (ambiguous).

Each worker thread keeps one connection (opened lazily, checked with ``RSET`` before reuse,
reopened when the server has closed it). The password never appears in a log line, a
``repr`` or an outcome message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import smtplib
import socket
import ssl
import threading
from collections.abc import Mapping
from email.message import EmailMessage
from email.utils import formatdate, parseaddr
from typing import TYPE_CHECKING, Literal, Self

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
    from _typeshed import ReadableBuffer

__all__ = [
    "OUTBOX_ID_HEADER",
    "Security",
    "SmtpSender",
    "classify",
    "from_env",
]

log = logging.getLogger("relay")

Security = Literal["starttls", "ssl", "none"]
SECURITY_MODES: tuple[Security, ...] = ("starttls", "ssl", "none")
OUTBOX_ID_HEADER = "X-Outbox-Message-Id"
_MAX_MESSAGE_CHARS = 1000
_MAX_PROVIDER_ID_CHARS = 255


# -- classification -------------------------------------------------------------------------


def classify(exc: BaseException, *, data_sent: bool) -> Outcome:
    """What an exception raised while sending one message means for it. Pure.

    ``data_sent`` tells whether the ``DATA`` command had been sent on the connection: from then
    on a lost connection or a timeout may hide a message the server already queued.
    """
    text = _describe(exc)
    if isinstance(exc, smtplib.SMTPAuthenticationError):
        if _is_temporary(exc.smtp_code):  # 454 "temporary authentication failure"
            return Transient(code=f"smtp_{exc.smtp_code}", message=text)
        return Disabled(code="smtp_auth_failed", message=text, pause=True)
    if isinstance(exc, smtplib.SMTPNotSupportedError):
        return Disabled(code="smtp_not_supported", message=text, pause=True)
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        return _recipients_refused(exc, text)
    if isinstance(exc, smtplib.SMTPConnectError | smtplib.SMTPHeloError):
        # refused while setting up the session: not this message's fault, never queued
        code = exc.smtp_code
        code_name = f"smtp_{code}" if _is_reply(code) else "smtp_connect_failed"
        return Transient(code=code_name, message=text)
    if isinstance(exc, smtplib.SMTPResponseException):  # sender refused, data error, ...
        code = exc.smtp_code
        if _is_temporary(code):
            return Transient(code=f"smtp_{code}", message=text)
        if _is_reply(code) and code >= 500:
            # MAIL FROM refused (sender not allowed, AUTH required): every message will be;
            # 552 there is this message's size (announced with SIZE=)
            setup = isinstance(exc, smtplib.SMTPSenderRefused) and code != 552
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


def _is_reply(code: int) -> bool:
    return 200 <= code <= 599


def _is_temporary(code: int) -> bool:
    return 400 <= code <= 499


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
    codes = [code for code, _reply in exc.recipients.values()]
    temporary = next((code for code in codes if _is_temporary(code)), None)
    if temporary is not None:  # some might be accepted later (or the server hung up: 421)
        return Transient(code=f"smtp_{temporary}", message=text)
    permanent = next((code for code in codes if _is_reply(code) and code >= 500), None)
    if permanent is not None:
        return Permanent(code=f"smtp_{permanent}", message=text)
    return Transient(code="smtp_recipients_refused", message=text)


def _reply_text(reply: bytes | str) -> str:
    return reply.decode("utf-8", "replace") if isinstance(reply, bytes) else str(reply)


def _describe(exc: BaseException) -> str:
    """A short text for the outcome: the server's reply, never the recipients' addresses in
    bulk."""
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        replies = exc.recipients.values()
        first = next(iter(replies), None)
        detail = "" if first is None else f"; first: {first[0]} {_reply_text(first[1])}"
        text = f"{len(exc.recipients)} recipient(s) refused{detail}"
    elif isinstance(exc, smtplib.SMTPResponseException):
        text = f"{type(exc).__name__}: {exc.smtp_code} {_reply_text(exc.smtp_error)}"
    else:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    text = " ".join(text.split())
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[: _MAX_MESSAGE_CHARS - 3] + "..."


# -- connections ----------------------------------------------------------------------------


class _TrackedSMTP(smtplib.SMTP):
    """An SMTP connection that remembers whether ``DATA`` was sent for the current message."""

    data_sent = False

    def data(self, msg: ReadableBuffer | str) -> tuple[int, bytes]:
        self.data_sent = True
        return super().data(msg)


class _TrackedSMTPSSL(_TrackedSMTP, smtplib.SMTP_SSL):
    """The same over implicit TLS (port 465)."""


class _ThreadState(threading.local):
    conn: _TrackedSMTP | None = None


# -- the sender -----------------------------------------------------------------------------


class SmtpSender:
    """Sends through an SMTP server (submission with STARTTLS, implicit TLS, or plain).

    Thread-safe: every thread has its own connection. Settings are checked here and a bad one
    raises :class:`~outbox.exceptions.ConfigurationError` naming its ``--smtp-*`` flag. Call
    :meth:`close` once no send is in flight to say QUIT on every connection.
    """

    name = "smtp"

    def __init__(
        self,
        host: str,
        port: int = 587,
        *,
        security: Security = "starttls",
        username: str | None = None,
        password: str | None = None,
        timeout: float = 20.0,
        local_hostname: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if not isinstance(host, str) or not host or any(c.isspace() for c in host):
            raise ConfigurationError("--smtp-host", "must be a host name or address, no spaces")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ConfigurationError("--smtp-port", "must be an integer from 1 to 65535")
        if security not in SECURITY_MODES:
            raise ConfigurationError(
                "--smtp-security", f"{security!r} is not one of {', '.join(SECURITY_MODES)}"
            )
        if username is not None and (not isinstance(username, str) or not username):
            raise ConfigurationError("--smtp-username", "must be a non-empty string")
        if password is not None and (not isinstance(password, str) or not password):
            raise ConfigurationError("--smtp-password", "must be a non-empty string")
        if username is not None and password is None:
            raise ConfigurationError("--smtp-password", "is required with --smtp-username")
        if password is not None and username is None:
            raise ConfigurationError("--smtp-username", "is required with --smtp-password")
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ConfigurationError("--smtp-timeout", "must be a positive number of seconds")
        if local_hostname is not None and (
            not isinstance(local_hostname, str)
            or not local_hostname
            or any(c.isspace() for c in local_hostname)
        ):
            raise ConfigurationError("local_hostname", "must be a host name, no spaces")
        if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
            raise ConfigurationError("ssl_context", "must be an ssl.SSLContext")
        if ssl_context is not None and security == "none":
            raise ConfigurationError(
                "--smtp-security", "an ssl_context was given, but security is 'none'"
            )
        self.host = host
        self.port = port
        self.security: Security = security
        self.username = username
        self._password = password
        self.timeout = float(timeout)
        self.local_hostname = local_hostname
        self._ssl_context = ssl_context
        if self._ssl_context is None and security != "none":
            self._ssl_context = ssl.create_default_context()
        self._local = _ThreadState()
        self._lock = threading.Lock()
        self._connections: dict[threading.Thread, _TrackedSMTP] = {}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        """Build one from ``OUTBOX_SMTP_HOST`` (required), ``OUTBOX_SMTP_PORT`` (default 465
        with ``ssl``, else 587), ``OUTBOX_SMTP_SECURITY`` (starttls), ``OUTBOX_SMTP_USERNAME``,
        ``OUTBOX_SMTP_PASSWORD`` and ``OUTBOX_SMTP_TIMEOUT`` (20 seconds). An empty variable
        counts as unset."""
        env = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            value = env.get(f"OUTBOX_SMTP_{name}", "").strip()
            return value or None

        host = get("HOST")
        if host is None:
            raise ConfigurationError("--smtp-host", "OUTBOX_SMTP_HOST is not set")
        security = (get("SECURITY") or "starttls").lower()
        if security not in SECURITY_MODES:
            raise ConfigurationError(
                "--smtp-security",
                f"OUTBOX_SMTP_SECURITY={security!r} is not one of {', '.join(SECURITY_MODES)}",
            )
        port_text = get("PORT")
        port = 465 if security == "ssl" else 587
        if port_text is not None:
            try:
                port = int(port_text)
            except ValueError:
                raise ConfigurationError(
                    "--smtp-port", f"OUTBOX_SMTP_PORT={port_text!r} is not an integer"
                ) from None
        timeout_text = get("TIMEOUT")
        timeout = 20.0
        if timeout_text is not None:
            try:
                timeout = float(timeout_text)
            except ValueError:
                raise ConfigurationError(
                    "--smtp-timeout", f"OUTBOX_SMTP_TIMEOUT={timeout_text!r} is not a number"
                ) from None
        # the password is read as given (spaces may be part of it), the rest stripped
        password = env.get("OUTBOX_SMTP_PASSWORD") or None
        return cls(
            host,
            port,
            security=security,
            username=get("USERNAME"),
            password=password,
            timeout=timeout,
        )

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
            refused = conn.send_message(mime, from_addr=from_addr, to_addrs=to_addrs)
        except Exception as exc:  # classified, never raised: see classify()
            data_sent = conn is not None and conn.data_sent
            outcome = self._scrubbed(classify(exc, data_sent=data_sent))
            if conn is not None and not _reusable_after(exc):
                self._discard(conn)
            return outcome
        if refused:
            log.warning(
                "smtp server refused %d of %d recipients; sent to the others",
                len(refused),
                len(to_addrs),
                extra={"action": "smtp_partial_refusal", "message_id": message.id},
            )
        # outbox_messages.provider_message_id is 255 characters; a Message-ID may be longer
        return Accepted(provider_message_id=str(mime["Message-ID"])[:_MAX_PROVIDER_ID_CHARS])

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
        if isinstance(outcome, Accepted) or self._password is None:
            return outcome
        if self._password not in outcome.message:
            return outcome
        return dataclasses.replace(outcome, message=outcome.message.replace(self._password, "***"))

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
        log.debug(
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
    """After a refusal smtplib has reset the transaction (or closed the connection on 421,
    which the next send sees); after anything else the connection's state is unknown."""
    return isinstance(
        exc,
        smtplib.SMTPSenderRefused | smtplib.SMTPRecipientsRefused | smtplib.SMTPDataError,
    )


def from_env() -> SmtpSender:
    """``outbox-relay run --sender relay.senders.smtp:from_env``: an :class:`SmtpSender` built
    from the ``OUTBOX_SMTP_*`` variables."""
    return SmtpSender.from_env()
