"""SmtpSender against a real SMTP server (aiosmtpd on 127.0.0.1), and the relay through it."""

from __future__ import annotations

import asyncio
import email
import email.policy
import logging
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from email.message import EmailMessage
from pathlib import Path

import pytest
import sqlalchemy as sa
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP as SMTPServer
from aiosmtpd.smtp import AuthResult, Envelope, LoginPassword, Session

from outbox import Attachment, Category, Email, HeaderInjection, Outbox, Status
from outbox.schema import attempts, messages
from relay.senders import Accepted, Ambiguous, Disabled, OutgoingMessage, Permanent, Transient
from relay.senders.smtp import OUTBOX_ID_HEADER, SmtpSender, SmtpSettings
from tests.support.db import attempt_rows, rows
from tests.support.factories import enqueue
from tests.support.inprocess import relay_for
from tests.support.tls import make_certificate
from tests.support.waiting import wait_for

USER, PASSWORD = "relay-user", "s3cret-pa55word"


# -- the server ------------------------------------------------------------------------------


@dataclass
class Received:
    mail_from: str
    rcpt_tos: list[str]
    peer: tuple[str, int]  # the client's address: one per connection
    authenticated: bool
    raw: bytes

    @property
    def message(self) -> EmailMessage:
        return email.message_from_bytes(self.raw, policy=email.policy.default)


@dataclass
class Handler:
    """An aiosmtpd handler that records what it accepts; its answers are set per test."""

    received: list[Received] = field(default_factory=list)
    mail_reply: str | None = None  # e.g. "553 5.7.1 sender not allowed"
    rcpt_replies: dict[str, str] = field(default_factory=dict)  # address -> reply, or "drop"
    data_reply: str | None = None
    after_data: str | None = None  # "drop": close without a reply; "hang": never reply
    release: asyncio.Event | None = None  # set at teardown to let hanging sessions end
    rsets: int = 0
    drop_at_rset: bool = False  # close the connection instead of answering the next RSET

    async def handle_MAIL(self, server, session, envelope, address, mail_options):
        if self.mail_reply:
            return self.mail_reply
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        return "250 OK"

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        reply = self.rcpt_replies.get(address)
        if reply == "drop":  # the connection dies before the answer
            assert server.transport is not None
            server.transport.close()
            return "250 OK"
        if reply:
            return reply
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_RSET(self, server, session, envelope):
        self.rsets += 1
        if self.drop_at_rset:
            self.drop_at_rset = False
            assert server.transport is not None
            server.transport.close()
        return "250 OK"

    async def handle_DATA(self, server: SMTPServer, session: Session, envelope: Envelope):
        if self.data_reply:
            return self.data_reply
        assert isinstance(envelope.content, bytes)
        self.received.append(
            Received(
                envelope.mail_from,
                list(envelope.rcpt_tos),
                session.peer,
                bool(session.authenticated),
                envelope.content,
            )
        )
        if self.after_data == "drop":  # queued, but the answer never makes it back
            assert server.transport is not None
            server.transport.close()  # the "250" below goes nowhere
        if self.after_data == "hang":
            self.release = self.release or asyncio.Event()
            await self.release.wait()
        return "250 2.0.0 queued"


class _Controller(Controller):
    """aiosmtpd's threaded controller on an ephemeral port (it pokes its own port to start
    the server, so it must learn the port the OS picked before it does)."""

    def _trigger_server(self):
        assert self.server is not None
        self.port = self.server.sockets[0].getsockname()[1]
        super()._trigger_server()


@dataclass
class Server:
    handler: Handler
    controller: _Controller

    @property
    def port(self) -> int:
        return self.controller.port

    def unhang(self) -> None:
        release = self.handler.release
        if release is not None:
            self.controller.loop.call_soon_threadsafe(release.set)


@pytest.fixture
def start_server():
    servers: list[Server] = []

    def start(handler: Handler | None = None, **smtp_kwargs) -> Server:
        controller = _Controller(
            handler or Handler(),
            hostname="127.0.0.1",
            port=0,
            server_hostname="mx.test",
            ready_timeout=5.0,
            **smtp_kwargs,
        )
        controller.start()
        server = Server(controller.handler, controller)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.unhang()
        server.controller.stop()


@pytest.fixture
def server(start_server) -> Server:
    return start_server()


@pytest.fixture
def make_sender():
    senders: list[SmtpSender] = []

    def make(port: int, **kw) -> SmtpSender:
        kw.setdefault("security", "none")
        kw.setdefault("timeout", 5.0)
        if kw.get("username") and kw["security"] == "none":  # the test server is on loopback
            kw.setdefault("allow_cleartext_login", True)
        sender = SmtpSender(
            SmtpSettings(host="127.0.0.1", port=port, local_hostname="relay.test", **kw)
        )
        senders.append(sender)
        return sender

    yield make
    for sender in senders:
        sender.close()


def authenticator(accept: threading.Event | None = None, echo: bool = False):
    """Accepts USER/PASSWORD (while ``accept`` is set, if given)."""

    def check(server, session, envelope, mechanism, auth_data):
        assert isinstance(auth_data, LoginPassword)
        good = (auth_data.login, auth_data.password) == (USER.encode(), PASSWORD.encode())
        if good and (accept is None or accept.is_set()):
            return AuthResult(success=True)
        if echo:  # a server that repeats what it got: it must not reach the outcome
            return AuthResult(
                success=False,
                handled=False,
                message=f"535 5.7.8 bad credentials {auth_data.password.decode()}",
            )
        return AuthResult(success=False, handled=False)

    return check


# -- TLS material ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Tls:
    server: ssl.SSLContext
    client: ssl.SSLContext  # trusts exactly the test certificate


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> Tls:
    """A self-signed certificate for 127.0.0.1 (IP SAN), made by ``tests.support.tls``."""
    certificate = make_certificate(tmp_path_factory.mktemp("tls"), "outbox test smtp")
    client = ssl.create_default_context(cafile=str(certificate.cert_file))
    return Tls(server=certificate.server_context(), client=client)


# -- messages --------------------------------------------------------------------------------


def outgoing(n: int = 1, **fields) -> OutgoingMessage:
    values = {
        "sender": "Shop <shop@example.com>",
        "to": [f"customer{n}@example.com"],
        "subject": f"Order {n}",
        "text": f"Thanks for order {n}.",
    }
    values.update(fields)
    return OutgoingMessage(
        id=n, key=f"order:{n}", category="transactional", attempt=1, email=Email(**values)
    )


# -- delivery and content ------------------------------------------------------------------


def test_message_arrives_with_headers_envelope_and_attachments(server, make_sender):
    sender = make_sender(server.port)
    message = outgoing(
        7,
        to=["Ada <ada@example.com>"],
        cc=["bob@example.com"],
        bcc=["audit@example.org"],
        reply_to=["help@example.com"],
        subject="Your order #7",
        text="plain body",
        html="<p>html body</p>",
        headers={"X-Ref": "order-7"},
        attachments=[
            Attachment(
                filename="invoice.pdf", content=b"%PDF-1.4 fake", content_type="application/pdf"
            )
        ],
    )

    outcome = sender.send(message)

    assert isinstance(outcome, Accepted)
    (got,) = server.handler.received
    assert got.mail_from == "shop@example.com"
    assert got.rcpt_tos == ["ada@example.com", "bob@example.com", "audit@example.org"]
    mime = got.message
    assert mime["Subject"] == "Your order #7"
    assert mime["From"] == "Shop <shop@example.com>"
    assert mime["To"] == "Ada <ada@example.com>"
    assert mime["Cc"] == "bob@example.com"
    assert mime["Reply-To"] == "help@example.com"
    assert mime["X-Ref"] == "order-7"
    assert "Bcc" not in mime
    assert b"audit@example.org" not in got.raw
    assert mime[OUTBOX_ID_HEADER] == "7"
    assert mime["Date"] is not None
    assert mime["Message-ID"].endswith("@example.com>")
    assert outcome.provider_message_id == mime["Message-ID"]
    assert mime.get_body(("plain",)).get_content().rstrip() == "plain body"
    assert mime.get_body(("html",)).get_content().rstrip() == "<p>html body</p>"
    (attachment,) = mime.iter_attachments()
    assert attachment.get_filename() == "invoice.pdf"
    assert attachment.get_content_type() == "application/pdf"
    assert attachment.get_content() == b"%PDF-1.4 fake"


def test_an_encoded_word_line_break_never_reaches_the_smtp_server(server, make_sender):
    """A subject and a file name holding ``=?utf-8?q?...=0D=0A...?=``: Python's email package
    decodes them when it writes the message (this machine's 3.11 writes the CRLF as it is), so
    an SMTP server would receive the attacker's headers. Email refuses them; a message that
    got past validation (a row stored before the check) fails at rendering, and nothing is
    sent: a permanent failure, not a retry."""
    with pytest.raises(HeaderInjection):
        outgoing(subject="=?utf-8?q?Hi=0D=0ABcc:_spy@example.com?=")
    message = outgoing(
        attachments=[Attachment(filename="invoice.pdf", content=b"%PDF", content_type="a/b")]
    )
    object.__setattr__(message.email, "subject", "=?utf-8?q?Hi=0D=0ABcc:_spy@example.com?=")
    outcome = make_sender(server.port).send(message)
    assert isinstance(outcome, Permanent)
    assert outcome.code == "invalid_payload"
    assert "U+000D" in outcome.message
    assert server.handler.received == []
    kept = make_sender(server.port).send(outgoing(subject="=?utf-8?q?caf=C3=A9?= ok"))
    assert isinstance(kept, Accepted)
    (got,) = server.handler.received
    assert got.message["Subject"] == "café ok"
    assert "Bcc" not in got.message


def test_a_message_id_given_by_the_app_is_kept(server, make_sender):
    sender = make_sender(server.port)
    outcome = sender.send(outgoing(headers={"Message-ID": "<order-1@shop.example.com>"}))
    assert outcome == Accepted(provider_message_id="<order-1@shop.example.com>")
    (got,) = server.handler.received
    assert got.message.get_all("Message-ID") == ["<order-1@shop.example.com>"]


def test_a_long_message_id_is_cut_to_fit_the_provider_id_column(server, make_sender):
    long_id = "<" + "x" * 300 + "@shop.example.com>"
    sender = make_sender(server.port)
    outcome = sender.send(outgoing(headers={"Message-ID": long_id}))
    assert outcome == Accepted(provider_message_id=long_id[:255])
    assert server.handler.received[0].message["Message-ID"] == long_id


def test_duplicate_recipients_get_one_rcpt(server, make_sender):
    sender = make_sender(server.port)
    outcome = sender.send(outgoing(to=["a@example.com"], cc=["a@example.com", "b@example.com"]))
    assert isinstance(outcome, Accepted)
    assert server.handler.received[0].rcpt_tos == ["a@example.com", "b@example.com"]


def test_template_email_is_permanent_and_nothing_is_sent(server, make_sender):
    sender = make_sender(server.port)
    message = OutgoingMessage(
        id=1,
        key="k",
        category="transactional",
        attempt=1,
        email=Email(sender="shop@example.com", to=["a@example.com"], template="welcome"),
    )
    outcome = sender.send(message)
    assert isinstance(outcome, Permanent)
    assert outcome.code == "template_not_supported_by_smtp"
    assert server.handler.received == []
    assert sender.open_connections == 0


# -- connections ---------------------------------------------------------------------------


def test_one_connection_is_reused_for_several_sends(server, make_sender):
    sender = make_sender(server.port)
    outcomes = [sender.send(outgoing(n)) for n in range(1, 6)]
    assert all(isinstance(o, Accepted) for o in outcomes)
    assert len({o.provider_message_id for o in outcomes}) == 5
    peers = {got.peer for got in server.handler.received}
    assert len(server.handler.received) == 5
    assert len(peers) == 1
    assert server.handler.rsets == 4  # checked before each reuse
    assert sender.open_connections == 1


def test_a_connection_the_server_closed_is_reopened(start_server, make_sender):
    server = start_server(timeout=0.3)  # the server hangs up on idle clients after 0.3 s
    sender = make_sender(server.port)
    assert isinstance(sender.send(outgoing(1)), Accepted)
    time.sleep(0.6)
    assert isinstance(sender.send(outgoing(2)), Accepted)
    first, second = server.handler.received
    assert first.peer != second.peer
    assert sender.open_connections == 1


def test_concurrent_sends_from_four_threads_arrive_exactly_once(server, make_sender):
    sender = make_sender(server.port)
    start = threading.Barrier(4)
    outcomes: dict[int, object] = {}

    def worker(t: int) -> None:
        start.wait()
        for i in range(10):
            n = t * 100 + i
            outcomes[n] = sender.send(outgoing(n))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(1, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert all(isinstance(o, Accepted) for o in outcomes.values())
    assert len(outcomes) == 40
    ids = Counter(got.message[OUTBOX_ID_HEADER] for got in server.handler.received)
    assert ids == Counter({str(n): 1 for n in outcomes})
    assert len({got.peer for got in server.handler.received}) == 4  # one connection per thread
    for got in server.handler.received:  # each body went with its own envelope
        assert got.rcpt_tos == [f"customer{got.message[OUTBOX_ID_HEADER]}@example.com"]


def test_connections_of_finished_threads_are_closed(server, make_sender):
    sender = make_sender(server.port)
    thread = threading.Thread(target=sender.send, args=(outgoing(1),))
    thread.start()
    thread.join()
    assert sender.open_connections == 1
    assert isinstance(sender.send(outgoing(2)), Accepted)  # this thread's own connection
    assert sender.open_connections == 1
    sender.close()
    assert sender.open_connections == 0
    assert isinstance(sender.send(outgoing(3)), Accepted)  # reopens after close()
    assert len({got.peer for got in server.handler.received}) == 3


# -- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "reply", "expected"),
    [
        # the sender's identity is refused: every message from it would fail the same way
        ("mail", "553 5.7.1 sender not allowed", Disabled(code="smtp_553", pause=True)),
        ("mail", "451 4.3.0 try later", Transient(code="smtp_451")),
        ("mail", "421 4.7.0 too many connections", Transient(code="smtp_421", throttled=True)),
        ("rcpt", "550 5.1.1 no such user", Permanent(code="smtp_550")),
        ("rcpt", "451 4.7.1 greylisted", Transient(code="smtp_recipient_deferred")),
        ("rcpt", "452 4.2.2 mailbox full", Transient(code="smtp_recipient_deferred")),
        ("rcpt", "421 4.3.2 shutting down", Transient(code="smtp_421", throttled=True)),
        ("data", "554 5.6.0 message refused", Permanent(code="smtp_554")),
        ("data", "451 4.3.0 local error", Transient(code="smtp_451")),
        ("data", "421 4.3.2 closing", Transient(code="smtp_421", throttled=True)),
    ],
)
def test_refusals_are_classified_by_reply_code(server, make_sender, where, reply, expected):
    if where == "mail":
        server.handler.mail_reply = reply
    elif where == "rcpt":
        server.handler.rcpt_replies["customer1@example.com"] = reply
    else:
        server.handler.data_reply = reply
    sender = make_sender(server.port)

    outcome = sender.send(outgoing(1))

    assert type(outcome) is type(expected)
    assert outcome.code == expected.code
    assert getattr(outcome, "config_error", False) == getattr(expected, "config_error", False)
    assert getattr(outcome, "throttled", False) == getattr(expected, "throttled", False)
    assert reply.split(" ", 2)[2] in outcome.message
    assert server.handler.received == []
    # the sender recovers: the next message goes through (on a new connection after a 421)
    server.handler.mail_reply = server.handler.data_reply = None
    server.handler.rcpt_replies.clear()
    assert isinstance(sender.send(outgoing(2)), Accepted)


def test_a_greylisted_recipient_defers_the_whole_message_before_data(server, make_sender):
    """One recipient answered "try later": nothing is sent to anyone, so the retry of the whole
    message cannot duplicate it, and nobody is left out."""
    to, cc, bcc = "to@example.com", "cc@example.com", "audit@example.com"
    server.handler.rcpt_replies[cc] = "450 4.2.0 greylisted"
    sender = make_sender(server.port)
    message = outgoing(4, to=[to], cc=[cc], bcc=[bcc])

    outcome = sender.send(message)

    assert isinstance(outcome, Transient)
    assert outcome.code == "smtp_recipient_deferred"
    assert not outcome.throttled
    assert outcome.message == (
        "1 of 3 recipient(s) deferred, nothing sent; first: 450 4.2.0 greylisted"
    )
    assert server.handler.received == []  # no DATA: the server queued nothing
    assert server.handler.rsets == 1  # the transaction was reset instead
    assert sender.open_connections == 1  # and the connection is kept

    server.handler.rcpt_replies.clear()  # the greylisting window has passed
    retry = sender.send(replace(message, attempt=2))

    (got,) = server.handler.received
    assert got.rcpt_tos == [to, cc, bcc]
    assert retry == Accepted(provider_message_id=got.message["Message-ID"])
    assert len({got.peer for got in server.handler.received}) == 1


def test_a_deferral_stands_when_the_server_hangs_up_at_rset(server, make_sender):
    server.handler.rcpt_replies["cc@example.com"] = "450 4.2.0 greylisted"
    server.handler.drop_at_rset = True
    sender = make_sender(server.port)
    message = outgoing(8, to=["to@example.com"], cc=["cc@example.com"])

    outcome = sender.send(message)

    assert isinstance(outcome, Transient)
    assert outcome.code == "smtp_recipient_deferred"
    assert server.handler.received == []
    assert sender.open_connections == 0  # closed, not reused in an unknown state
    server.handler.rcpt_replies.clear()
    assert isinstance(sender.send(replace(message, attempt=2)), Accepted)
    (got,) = server.handler.received
    assert got.rcpt_tos == ["to@example.com", "cc@example.com"]


def test_a_deferral_and_a_refusal_together_defer_the_whole_message(server, make_sender):
    server.handler.rcpt_replies["gone@example.com"] = "550 5.1.1 no such user"
    server.handler.rcpt_replies["later@example.com"] = "451 4.7.1 try again later"
    sender = make_sender(server.port)

    outcome = sender.send(
        outgoing(5, to=["ok@example.com"], cc=["gone@example.com", "later@example.com"])
    )

    assert isinstance(outcome, Transient)
    assert outcome.code == "smtp_recipient_deferred"
    assert outcome.message == (
        "1 of 3 recipient(s) deferred, 1 refused, nothing sent; first: 451 4.7.1 try again later"
    )
    assert server.handler.received == []


def test_a_permanently_refused_cc_does_not_stop_the_to_and_is_reported(server, make_sender, caplog):
    """A 5xx for one recipient and none deferred: the others get the message, and the outcome
    names who did not (the log line does not: it names no address)."""
    server.handler.rcpt_replies["gone@example.com"] = "550 5.1.1 no such user"
    sender = make_sender(server.port)
    caplog.set_level(logging.WARNING, logger="relay")

    outcome = sender.send(outgoing(3, to=["ok@example.com"], cc=["gone@example.com"]))

    (got,) = server.handler.received
    assert got.rcpt_tos == ["ok@example.com"]
    assert outcome == Accepted(
        provider_message_id=got.message["Message-ID"],
        refused=("gone@example.com: 550 5.1.1 no such user",),
    )
    (record,) = [r for r in caplog.records if getattr(r, "action", None) == "smtp_partial_refusal"]
    assert record.levelno == logging.WARNING
    assert record.message_id == 3
    assert "1 of 2" in record.getMessage()
    assert "gone@example.com" not in record.getMessage()


def test_a_connection_lost_at_rcpt_is_transient_and_sends_nothing(server, make_sender):
    server.handler.rcpt_replies["cc@example.com"] = "drop"
    sender = make_sender(server.port)

    outcome = sender.send(outgoing(6, to=["to@example.com"], cc=["cc@example.com"]))

    assert isinstance(outcome, Transient)
    assert outcome.code == "smtp_connection_lost"
    assert server.handler.received == []
    server.handler.rcpt_replies.clear()
    assert isinstance(sender.send(outgoing(7)), Accepted)  # on a new connection


# -- lost answers: before and after DATA ----------------------------------------------------


def test_connection_dropped_after_data_is_ambiguous(server, make_sender):
    server.handler.after_data = "drop"
    sender = make_sender(server.port)

    outcome = sender.send(outgoing(1))

    assert isinstance(outcome, Ambiguous)
    assert outcome.code == "smtp_connection_lost_after_data"
    assert len(server.handler.received) == 1  # the server did queue it: a resend duplicates
    server.handler.after_data = None
    assert isinstance(sender.send(outgoing(2)), Accepted)  # a fresh connection


def test_server_silent_after_data_times_out_as_ambiguous(server, make_sender):
    server.handler.after_data = "hang"
    sender = make_sender(server.port, timeout=0.5)

    started = time.monotonic()
    outcome = sender.send(outgoing(1))

    assert 0.4 < time.monotonic() - started < 3
    assert isinstance(outcome, Ambiguous)
    assert outcome.code == "smtp_connection_lost_after_data"
    assert sender.open_connections == 0  # a connection in an unknown state is not reused


def test_server_silent_before_data_is_transient(make_sender):
    """A listener that never greets: the client times out before anything was sent."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        sender = make_sender(silent.getsockname()[1], timeout=0.3)
        outcome = sender.send(outgoing(1))
    assert isinstance(outcome, Transient)
    assert outcome.code == "smtp_connection_lost"
    assert sender.open_connections == 0


def test_connection_refused_is_transient(make_sender):
    with socket.socket() as closed:  # bound, not listening: the kernel refuses connections
        closed.bind(("127.0.0.1", 0))
        sender = make_sender(closed.getsockname()[1])
        outcome = sender.send(outgoing(1))
    assert outcome == Transient(code="smtp_connection_refused", message=outcome.message)
    assert "ConnectionRefusedError" in outcome.message


def test_unknown_host_is_transient():
    sender = SmtpSender(
        SmtpSettings(host="smtp.invalid", port=2525, security="none", local_hostname="relay.test")
    )
    outcome = sender.send(outgoing(1))
    assert isinstance(outcome, Transient)
    assert outcome.code == "smtp_dns_error"


# -- authentication --------------------------------------------------------------------------
# Plain-text servers offer AUTH without requiring it: aiosmtpd warns (UserWarning, an error
# here) when AUTH is required without TLS. Required AUTH is tested behind STARTTLS.


def plain_auth_server(start_server, accept: threading.Event | None = None, echo: bool = False):
    return start_server(auth_require_tls=False, authenticator=authenticator(accept, echo))


def test_auth_with_good_credentials_sends(start_server, make_sender):
    server = plain_auth_server(start_server)
    sender = make_sender(server.port, username=USER, password=PASSWORD)
    assert isinstance(sender.send(outgoing(1)), Accepted)
    assert isinstance(sender.send(outgoing(2)), Accepted)
    assert [got.authenticated for got in server.handler.received] == [True, True]
    assert len({got.peer for got in server.handler.received}) == 1  # logged in once


@pytest.mark.parametrize("echo", [False, True])
def test_bad_credentials_disable_and_pause_and_never_leak(start_server, make_sender, echo):
    server = plain_auth_server(start_server, echo=echo)
    wrong = "wrong-" + PASSWORD
    sender = make_sender(server.port, username=USER, password=wrong)

    outcome = sender.send(outgoing(1))

    assert isinstance(outcome, Disabled)
    assert outcome.code == "smtp_auth_failed"
    assert outcome.pause is True
    assert "535" in outcome.message
    assert wrong not in outcome.message
    assert ("***" in outcome.message) is echo  # the server echoed it: scrubbed
    assert wrong not in repr(sender)
    assert server.handler.received == []
    assert sender.open_connections == 0


def test_starttls_with_required_auth(start_server, make_sender, tls):
    server = start_server(
        tls_context=tls.server,
        require_starttls=True,
        auth_required=True,
        authenticator=authenticator(),  # auth_require_tls stays on: AUTH only after STARTTLS
    )
    sender = make_sender(
        server.port, security="starttls", ssl_context=tls.client, username=USER, password=PASSWORD
    )
    assert isinstance(sender.send(outgoing(1)), Accepted)
    assert isinstance(sender.send(outgoing(2)), Accepted)
    assert [got.authenticated for got in server.handler.received] == [True, True]
    assert len({got.peer for got in server.handler.received}) == 1


def test_no_credentials_for_a_server_requiring_auth_pauses_instead_of_failing_mail(
    start_server, make_sender, tls
):
    server = start_server(
        tls_context=tls.server,
        require_starttls=True,
        auth_required=True,
        authenticator=authenticator(),
    )
    sender = make_sender(server.port, security="starttls", ssl_context=tls.client)
    outcome = sender.send(outgoing(1))
    # refused at MAIL FROM for the relay's credentials, not the message: the relay pauses
    assert isinstance(outcome, Disabled)
    assert (outcome.code, outcome.pause, outcome.scope.kind.value) == (
        "smtp_auth_failed",
        True,
        "account",
    )
    assert "530" in outcome.message
    assert server.handler.received == []


def test_starttls_with_an_untrusted_certificate_is_transient(start_server, make_sender, tls):
    server = start_server(tls_context=tls.server, require_starttls=True)
    sender = make_sender(server.port, security="starttls")  # system CAs: self-signed fails
    outcome = sender.send(outgoing(1))
    assert isinstance(outcome, Transient)
    assert outcome.code == "smtp_tls_error"
    assert "CERTIFICATE_VERIFY_FAILED" in outcome.message
    assert server.handler.received == []


def test_starttls_required_but_not_offered_disables(server, make_sender, tls):
    sender = make_sender(server.port, security="starttls", ssl_context=tls.client)
    outcome = sender.send(outgoing(1))
    assert isinstance(outcome, Disabled)
    assert outcome.code == "smtp_not_supported"
    assert outcome.pause is True
    assert server.handler.received == []


def test_implicit_tls(start_server, make_sender, tls):
    server = start_server(ssl_context=tls.server)
    sender = make_sender(server.port, security="ssl", ssl_context=tls.client)
    assert isinstance(sender.send(outgoing(1)), Accepted)
    assert isinstance(sender.send(outgoing(2)), Accepted)
    assert len({got.peer for got in server.handler.received}) == 1


def test_implicit_tls_against_a_plain_server_is_transient(server, make_sender, tls):
    sender = make_sender(server.port, security="ssl", ssl_context=tls.client, timeout=2.0)
    outcome = sender.send(outgoing(1))
    assert isinstance(outcome, Transient)
    assert outcome.code == "smtp_tls_error"


# -- the relay, end to end -------------------------------------------------------------------

RELAY_SETTINGS = {
    "relay_id": "smtp-relay",
    "send_timeout": 2.0,
    "lease_seconds": 10.0,
    "concurrency": 3,
}


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_relay_delivers_the_backlog_over_smtp(backend, server, make_sender):
    ids = enqueue(backend.engine, 5, short=True, bcc=["archive@example.com"])
    sender = make_sender(server.port)

    relay_for(backend, sender, **RELAY_SETTINGS, exit_when_idle=True).run()

    received = Counter(int(got.message[OUTBOX_ID_HEADER]) for got in server.handler.received)
    assert received == Counter({i: 1 for i in ids})
    for got in server.handler.received:
        assert got.rcpt_tos[-1] == "archive@example.com"
        assert "Bcc" not in got.message
    by_id = {
        int(got.message[OUTBOX_ID_HEADER]): got.message["Message-ID"]
        for got in server.handler.received
    }
    for row in rows(backend.engine):
        assert row.status == Status.SENT
        assert row.attempt_count == 1
        assert row.provider_message_id == by_id[row.id]


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_relay_pauses_on_bad_credentials_and_resumes(backend, start_server, make_sender):
    accept = threading.Event()
    server = plain_auth_server(start_server, accept)
    ids = enqueue(backend.engine, 3, short=True, bcc=["archive@example.com"])
    sender = make_sender(server.port, username=USER, password=PASSWORD)
    relay = relay_for(backend, sender, **RELAY_SETTINGS, exit_when_idle=True, pause_seconds=0.2)
    runner = threading.Thread(target=relay.run)
    runner.start()
    try:
        wait_for(lambda: relay.paused)

        def recorded_codes() -> list[str]:
            with backend.engine.connect() as conn:
                return list(conn.execute(sa.select(attempts.c.error_code).distinct()).scalars())

        # the relay pauses as soon as it sees the answer; the attempt rows follow at its next save
        wait_for(recorded_codes)
        assert recorded_codes() == ["smtp_auth_failed"]
        with backend.engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.max(messages.c.attempt_count))).scalar() == 0
        assert server.handler.received == []
        accept.set()
    finally:
        if not accept.is_set():
            relay.request_stop()
        runner.join(15)
    assert not runner.is_alive()
    assert [row.status for row in rows(backend.engine)] == [Status.SENT] * len(ids)
    assert [row.attempt_count for row in rows(backend.engine)] == [1] * len(ids)
    assert len(server.handler.received) == len(ids)


class Recording:
    """Wraps a sender and keeps every outcome it returned to the relay."""

    def __init__(self, sender: SmtpSender) -> None:
        self.sender = sender
        self.name = sender.name
        self.outcomes: list[object] = []

    def send(self, message: OutgoingMessage):
        outcome = self.sender.send(message)
        self.outcomes.append(outcome)
        return outcome


QUICK = Outbox(categories=[Category(name="quick", backoff_base=0.01, backoff_cap=0.01)])


@dataclass
class Greylisting(Handler):
    """Answers 450 to the first RCPT for each address in ``greylist``, 250 from then on."""

    greylist: set[str] = field(default_factory=set)

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        if address in self.greylist:
            self.greylist.discard(address)
            return "450 4.2.0 greylisted, try again later"
        return await super().handle_RCPT(server, session, envelope, address, rcpt_options)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_relay_retries_a_greylisted_message_and_delivers_it_to_everyone_once(
    backend, start_server, make_sender
):
    to, cc = "to@example.com", "cc@example.com"
    server = start_server(Greylisting(greylist={cc}))
    (message_id,) = enqueue(
        backend.engine,
        [Email(sender="shop@example.com", to=[to], cc=[cc], subject="s", text="t")],
        outbox=QUICK,
        key="smtp-e2e:one",
        category="quick",
    )
    relay = relay_for(backend, make_sender(server.port), **RELAY_SETTINGS)
    runner = threading.Thread(target=relay.run)
    runner.start()
    try:
        wait_for(lambda: rows(backend.engine)[0].status == Status.SENT)
    finally:
        relay.request_stop()
        runner.join(15)
    assert not runner.is_alive()

    (row,) = rows(backend.engine)
    assert row.attempt_count == 2
    (got,) = server.handler.received
    assert got.rcpt_tos == [to, cc]
    assert int(got.message[OUTBOX_ID_HEADER]) == message_id
    assert row.provider_message_id == got.message["Message-ID"]
    first, second = attempt_rows(backend.engine)
    assert (first.outcome, first.error_code) == ("transient", "smtp_recipient_deferred")
    assert first.error_message == (
        "1 of 2 recipient(s) deferred, nothing sent; first: 450 4.2.0 greylisted, try again later"
    )
    assert second.outcome == "accepted"


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_relay_sends_to_the_to_when_a_cc_is_refused_for_good(backend, server, make_sender):
    to, cc = "to@example.com", "gone@example.com"
    enqueue(
        backend.engine,
        [Email(sender="shop@example.com", to=[to], cc=[cc], subject="s", text="t")],
        outbox=QUICK,
        key="smtp-e2e:one",
        category="quick",
    )
    server.handler.rcpt_replies[cc] = "550 5.1.1 no such user"
    sender = Recording(make_sender(server.port))

    relay_for(backend, sender, **RELAY_SETTINGS, exit_when_idle=True).run()

    (row,) = rows(backend.engine)
    assert (row.status, row.attempt_count) == (Status.SENT, 1)
    (got,) = server.handler.received
    assert got.rcpt_tos == [to]
    (outcome,) = sender.outcomes
    assert outcome == Accepted(
        provider_message_id=row.provider_message_id,
        refused=("gone@example.com: 550 5.1.1 no such user",),
    )
    (attempt,) = attempt_rows(backend.engine)  # where an operator sees who did not get it
    assert (attempt.outcome, attempt.error_code) == ("accepted", "recipients_refused")
    assert "gone@example.com: 550 5.1.1 no such user" in attempt.error_message
    assert attempt.provider_message_id == row.provider_message_id


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_outbox_relay_run_with_the_smtp_flags(backend, server):
    """The real CLI, as a process: --sender smtp with its flags from OUTBOX_* variables."""
    ids = enqueue(backend.engine, 4, short=True, bcc=["archive@example.com"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(
        OUTBOX_DATABASE_URL=backend.url,
        OUTBOX_SMTP_HOST="127.0.0.1",
        OUTBOX_SMTP_PORT=str(server.port),
        OUTBOX_SMTP_SECURITY="none",
    )
    relay = str(Path(sys.executable).with_name("outbox-relay"))
    done = subprocess.run(
        [relay, "run", "--sender", "smtp", "--exit-when-idle", "--send-timeout", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    received = Counter(int(got.message[OUTBOX_ID_HEADER]) for got in server.handler.received)
    assert received == Counter({i: 1 for i in ids})
    assert [row.status for row in rows(backend.engine)] == [Status.SENT] * len(ids)
    missing = subprocess.run(
        [relay, "run", "--sender", "smtp", "--database-url", backend.url],
        env={k: v for k, v in env.items() if k != "OUTBOX_SMTP_HOST"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert missing.returncode == 2
    assert "--smtp-host" in missing.stderr
