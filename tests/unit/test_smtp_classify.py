"""SmtpSender without a server: the classification table and the settings checks."""

from __future__ import annotations

import smtplib
import socket
import ssl

import pytest

from outbox.exceptions import ConfigurationError
from relay.pause import ACCOUNT, Scope, ScopeKind
from relay.senders import Ambiguous, Disabled, Permanent, Sender, Transient
from relay.senders import smtp as smtp_module
from relay.senders.smtp import SmtpSender, SmtpSettings, classify

A = "a@example.com"


def refused(**codes: int) -> smtplib.SMTPRecipientsRefused:
    return smtplib.SMTPRecipientsRefused(
        {f"{name}@example.com": (code, b"reply") for name, code in codes.items()}
    )


CASES = [
    # never connected, or refused while setting up the session: the message never left
    (
        ConnectionRefusedError(111, "Connection refused"),
        False,
        Transient,
        "smtp_connection_refused",
    ),
    (socket.gaierror(-2, "Name or service not known"), False, Transient, "smtp_dns_error"),
    (TimeoutError("timed out"), False, Transient, "smtp_timeout"),
    (OSError(101, "Network is unreachable"), False, Transient, "smtp_network_error"),
    (
        ssl.SSLCertVerificationError(1, "certificate verify failed"),
        False,
        Transient,
        "smtp_tls_error",
    ),
    (ssl.SSLError(1, "wrong version number"), False, Transient, "smtp_tls_error"),
    (smtplib.SMTPConnectError(421, b"too busy"), False, Transient, "smtp_421"),
    (smtplib.SMTPHeloError(421, b"closing"), False, Transient, "smtp_421"),
    (smtplib.SMTPConnectError(554, b"no service"), False, Transient, "smtp_554"),
    (smtplib.SMTPConnectError(-1, b"garbled greeting"), False, Transient, "smtp_connect_failed"),
    (smtplib.SMTPHeloError(501, b"bad hostname"), False, Transient, "smtp_501"),
    (
        smtplib.SMTPServerDisconnected("Connection unexpectedly closed"),
        False,
        Transient,
        "smtp_connection_lost",
    ),
    # the configuration is wrong: pause the relay, count no attempt
    (
        smtplib.SMTPAuthenticationError(535, b"5.7.8 bad credentials"),
        False,
        Disabled,
        "smtp_auth_failed",
    ),
    (
        smtplib.SMTPAuthenticationError(534, b"5.7.9 mechanism too weak"),
        False,
        Disabled,
        "smtp_auth_failed",
    ),
    (
        smtplib.SMTPNotSupportedError("STARTTLS extension not supported"),
        False,
        Disabled,
        "smtp_not_supported",
    ),
    # a temporary authentication failure is just transient
    (smtplib.SMTPAuthenticationError(454, b"4.7.0 try later"), False, Transient, "smtp_454"),
    # the server answered: 4xx transient, 5xx permanent
    (smtplib.SMTPSenderRefused(553, b"not yours", A), False, Permanent, "smtp_553"),
    (smtplib.SMTPSenderRefused(451, b"try later", A), False, Transient, "smtp_451"),
    (smtplib.SMTPSenderRefused(421, b"closing", A), False, Transient, "smtp_421"),
    # recipients: any refused for now defers the whole message (nothing was sent)
    (refused(a=550, b=553), False, Permanent, "smtp_550"),
    (refused(a=450), False, Transient, "smtp_recipient_deferred"),
    (refused(a=550, b=451), False, Transient, "smtp_recipient_deferred"),
    (refused(a=452, b=550), False, Transient, "smtp_recipient_deferred"),
    (refused(a=421), False, Transient, "smtp_421"),
    (refused(a=450, b=421), False, Transient, "smtp_421"),
    (refused(a=550, b=-1), False, Transient, "smtp_recipients_refused"),
    (refused(), False, Transient, "smtp_recipients_refused"),
    (smtplib.SMTPDataError(554, b"spam"), True, Permanent, "smtp_554"),
    (smtplib.SMTPDataError(552, b"too big"), True, Permanent, "smtp_552"),
    (smtplib.SMTPDataError(451, b"local error"), True, Transient, "smtp_451"),
    (smtplib.SMTPDataError(421, b"closing"), True, Transient, "smtp_421"),
    (smtplib.SMTPDataError(503, b"need RCPT"), False, Permanent, "smtp_503"),
    (smtplib.SMTPResponseException(550, b"no"), False, Permanent, "smtp_550"),
    # a reply that is no error code: ambiguous once DATA was sent
    (smtplib.SMTPDataError(-1, b"garbled"), False, Transient, "smtp_unexpected_reply"),
    (smtplib.SMTPDataError(-1, b"garbled"), True, Ambiguous, "smtp_unexpected_reply"),
    # no answer after DATA: the server may have queued it
    (
        smtplib.SMTPServerDisconnected("Connection unexpectedly closed: timed out"),
        True,
        Ambiguous,
        "smtp_connection_lost_after_data",
    ),
    (TimeoutError("timed out"), True, Ambiguous, "smtp_connection_lost_after_data"),
    (
        ConnectionResetError(104, "reset by peer"),
        True,
        Ambiguous,
        "smtp_connection_lost_after_data",
    ),
    (ssl.SSLError(1, "bad record mac"), True, Ambiguous, "smtp_connection_lost_after_data"),
    # anything else
    (smtplib.SMTPException("odd"), False, Transient, "smtp_error"),
    (smtplib.SMTPException("odd"), True, Ambiguous, "smtp_error_after_data"),
    (RuntimeError("bug"), False, Transient, "smtp_unexpected_error"),
    (RuntimeError("bug"), True, Ambiguous, "smtp_unexpected_error"),
]


@pytest.mark.parametrize(
    ("exc", "data_sent", "kind", "code"),
    CASES,
    ids=[f"{type(c[0]).__name__}-{c[3]}-{'after' if c[1] else 'before'}" for c in CASES],
)
def test_classify(exc, data_sent, kind, code):
    outcome = classify(exc, data_sent=data_sent)
    assert type(outcome) is kind
    assert outcome.code == code
    assert outcome.message


def test_disabled_outcomes_pause_the_relay():
    for exc in (smtplib.SMTPAuthenticationError(535, b"no"), smtplib.SMTPNotSupportedError("x")):
        outcome = classify(exc, data_sent=False)
        assert isinstance(outcome, Disabled)
        assert outcome.pause is True


@pytest.mark.parametrize(
    "reply",
    [
        b"5.3.4 Message size exceeds fixed maximum message size",  # aiosmtpd, Postfix
        b"5.2.3 Message length exceeds administrative limit",
    ],
)
def test_a_mail_from_refusal_saying_the_message_is_too_big_fails_only_it(reply):
    """A 550/554 to MAIL FROM whose enhanced status code says the message is too big (its
    SIZE=) is that message's permanent failure: pausing its sender would hold the sender's
    other mail, and the message itself, as the probe, would pause it again for ever."""
    for code in (550, 554):
        outcome = classify(
            smtplib.SMTPSenderRefused(code, reply, A), data_sent=False, sender="shop@example.com"
        )
        assert isinstance(outcome, Permanent), outcome
        assert outcome.code == f"smtp_{code}"
        assert not outcome.config_error


@pytest.mark.parametrize(
    "reply",
    [
        b"5.3.5 System incorrectly configured",
        b"5.3.2 System not accepting network messages",
        b"5.2.1 Sender mailbox disabled",
        b"5.0.0 Sender rejected",
        b"5.6.0 Content rejected",  # nothing of the content was sent yet
        b"5.9.9 Something new",
        b"Sender rejected",
    ],
)
def test_any_other_mail_from_refusal_pauses_the_sender_and_fails_nothing(reply):
    """Before DATA nothing of the message was sent: any other refusal of MAIL FROM meets every
    message from that sender alike, so their mail waits (a pause) instead of all failing."""
    outcome = classify(
        smtplib.SMTPSenderRefused(550, reply, A), data_sent=False, sender="shop@example.com"
    )
    assert isinstance(outcome, Disabled), outcome
    assert outcome.scope == Scope(ScopeKind.IDENTITY, "shop@example.com")


def test_a_refused_sender_is_a_config_error_a_refused_recipient_is_not():
    sender = classify(smtplib.SMTPSenderRefused(550, b"relay denied", A), data_sent=False)
    too_big = classify(smtplib.SMTPSenderRefused(552, b"size exceeds limit", A), data_sent=False)
    recipient = classify(refused(a=550), data_sent=False)
    assert isinstance(sender, Permanent)
    assert sender.config_error
    assert isinstance(too_big, Permanent)
    assert not too_big.config_error
    assert isinstance(recipient, Permanent)
    assert not recipient.config_error


@pytest.mark.parametrize(
    "exc",
    [
        smtplib.SMTPConnectError(421, b"4.7.0 too many connections"),
        smtplib.SMTPSenderRefused(421, b"4.7.0 slow down", A),
        refused(a=450, b=421),
        smtplib.SMTPDataError(421, b"4.3.2 closing"),
    ],
    ids=["greeting", "mail", "rcpt", "data"],
)
def test_a_server_closing_the_connection_with_421_throttles(exc):
    """421 is the server shedding load: the relay slows down, not only this message."""
    outcome = classify(exc, data_sent=False)
    assert isinstance(outcome, Transient)
    assert outcome.throttled


@pytest.mark.parametrize(
    "exc",
    [
        refused(a=450),  # greylisting: one sender/recipient pair, not the relay's rate
        refused(a=452),  # too many recipients, or a full mailbox: slowing down does not help
        smtplib.SMTPSenderRefused(451, b"try later", A),
        smtplib.SMTPDataError(451, b"local error"),
        smtplib.SMTPAuthenticationError(454, b"4.7.0 try later"),
    ],
)
def test_other_temporary_replies_do_not_throttle(exc):
    outcome = classify(exc, data_sent=False)
    assert isinstance(outcome, Transient)
    assert not outcome.throttled


def test_a_deferral_names_the_temporary_reply_first():
    outcome = classify(refused(a=550, b=451), data_sent=False)
    assert outcome.message == "1 recipient(s) deferred, 1 refused, nothing sent; first: 451 reply"
    outcome = classify(refused(a=452, b=450), data_sent=False)
    assert outcome.message == "2 recipient(s) deferred, nothing sent; first: 452 reply"


def test_messages_carry_the_reply_and_stay_short():
    outcome = classify(smtplib.SMTPDataError(554, b"5.7.1 message\r\n refused"), data_sent=True)
    assert outcome.message == "SMTPDataError: 554 5.7.1 message refused"
    outcome = classify(refused(a=550, b=550), data_sent=False)
    assert outcome.message == "2 recipient(s) refused; first: 550 reply"
    outcome = classify(smtplib.SMTPResponseException(550, b"x" * 5000), data_sent=False)
    assert len(outcome.message) == 1000
    assert outcome.message.endswith("...")


# -- settings --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"host": ""}, "--smtp-host"),
        ({"host": "smtp example.com"}, "--smtp-host"),
        ({"host": None}, "--smtp-host"),
        ({"port": 0}, "--smtp-port"),
        ({"port": 65536}, "--smtp-port"),
        ({"port": "25"}, "--smtp-port"),
        ({"port": True}, "--smtp-port"),
        ({"security": "tls"}, "--smtp-security"),
        ({"username": "u"}, "--smtp-password"),
        ({"password": "p"}, "--smtp-username"),
        ({"username": "", "password": "p"}, "--smtp-username"),
        ({"username": "u", "password": ""}, "--smtp-password"),
        ({"timeout": 0}, "--smtp-timeout"),
        ({"timeout": -1.0}, "--smtp-timeout"),
        ({"timeout": float("nan")}, "--smtp-timeout"),
        ({"timeout": float("inf")}, "--smtp-timeout"),
        ({"timeout": "20"}, "--smtp-timeout"),
        ({"timeout": True}, "--smtp-timeout"),
        ({"security": "none", "ssl_context": ssl.create_default_context()}, "--smtp-security"),
        # a login over a cleartext connection: refused unless asked for by name
        ({"security": "none", "username": "u", "password": "p"}, "--smtp-security"),
        ({"ssl_context": "yes"}, "ssl_context"),
        ({"local_hostname": "relay host"}, "local_hostname"),
    ],
)
def test_bad_settings_name_their_flag(kwargs, setting):
    arguments = {"host": "smtp.example.com", **kwargs}
    with pytest.raises(ConfigurationError) as caught:
        SmtpSettings(**arguments)
    assert caught.value.setting == setting


def test_a_cleartext_login_is_allowed_only_when_asked_for(monkeypatch):
    settings = SmtpSettings(
        host="mail.internal", security="none", username="u", password="p",
        allow_cleartext_login=True,
    )  # fmt: skip
    assert settings.username == "u"
    monkeypatch.setenv("OUTBOX_SMTP_HOST", "mail.internal")
    monkeypatch.setenv("OUTBOX_SMTP_SECURITY", "none")
    monkeypatch.setenv("OUTBOX_SMTP_USERNAME", "u")
    monkeypatch.setenv("OUTBOX_SMTP_PASSWORD", "p")
    with pytest.raises(ConfigurationError) as caught:
        SmtpSettings.from_env()
    assert caught.value.setting == "--smtp-security"
    monkeypatch.setenv("OUTBOX_SMTP_ALLOW_CLEARTEXT_LOGIN", "true")
    assert SmtpSettings.from_env().allow_cleartext_login is True


def test_a_sender_takes_settings_not_a_host():
    with pytest.raises(TypeError, match="SmtpSettings"):
        SmtpSender("smtp.example.com")


def test_a_password_never_shows_in_errors_or_repr():
    with pytest.raises(ConfigurationError) as caught:
        SmtpSettings(host="smtp.example.com", password="hunter2")
    assert "hunter2" not in str(caught.value)
    settings = SmtpSettings(host="smtp.example.com", username="u", password="hunter2")
    assert "hunter2" not in repr(settings)
    assert "hunter2" not in repr(SmtpSender(settings))


def test_defaults_and_the_sender_protocol():
    sender = SmtpSender(SmtpSettings(host="smtp.example.com"))
    assert (sender.port, sender.security, sender.timeout) == (587, "starttls", 20.0)
    assert sender.username is None
    assert isinstance(sender, Sender)
    assert sender.name == "smtp"
    assert sender.max_send_rate() is None
    assert sender.open_connections == 0
    sender.close()  # nothing open: a no-op


@pytest.mark.parametrize(
    ("settings", "port"),
    [
        ({"security": "ssl"}, 465),
        ({"security": "starttls"}, 587),
        ({"security": "none"}, 587),
        ({"security": "ssl", "port": 2465}, 2465),
    ],
)
def test_the_default_port_follows_security_however_the_settings_are_made(settings, port):
    assert SmtpSettings(host="h", **settings).effective_port == port
    assert SmtpSender(SmtpSettings(host="h", **settings)).port == port


def test_from_env_reads_every_variable():
    settings = SmtpSettings.from_env(
        {
            "OUTBOX_SMTP_HOST": "mail.example.com",
            "OUTBOX_SMTP_PORT": "2525",
            "OUTBOX_SMTP_SECURITY": "SSL",
            "OUTBOX_SMTP_USERNAME": "relay",
            "OUTBOX_SMTP_PASSWORD": " spaced secret ",
            "OUTBOX_SMTP_TIMEOUT": "7.5",
        }
    )
    assert settings == SmtpSettings(
        host="mail.example.com",
        port=2525,
        security="ssl",
        username="relay",
        password=" spaced secret ",
        timeout=7.5,
    )
    sender = SmtpSender.from_env({"OUTBOX_SMTP_HOST": "mail.example.com"})
    assert sender.settings == SmtpSettings(host="mail.example.com")


@pytest.mark.parametrize(("security", "port"), [("ssl", 465), ("starttls", 587), ("none", 587)])
def test_from_env_default_port_follows_security(security, port):
    sender = SmtpSender.from_env({"OUTBOX_SMTP_HOST": "h", "OUTBOX_SMTP_SECURITY": security})
    assert sender.port == port


def test_from_env_treats_empty_variables_as_unset():
    sender = SmtpSender.from_env(
        {
            "OUTBOX_SMTP_HOST": "h",
            "OUTBOX_SMTP_PORT": "",
            "OUTBOX_SMTP_SECURITY": "",
            "OUTBOX_SMTP_USERNAME": "",
            "OUTBOX_SMTP_PASSWORD": "",
            "OUTBOX_SMTP_TIMEOUT": " ",
        }
    )
    assert (sender.port, sender.security, sender.username, sender.timeout) == (
        587,
        "starttls",
        None,
        20.0,
    )


@pytest.mark.parametrize(
    ("env", "setting", "text"),
    [
        ({}, "--smtp-host", "required (or OUTBOX_SMTP_HOST)"),
        ({"OUTBOX_SMTP_PORT": "smtp"}, "--smtp-port", "OUTBOX_SMTP_PORT='smtp'"),
        ({"OUTBOX_SMTP_PORT": "70000"}, "--smtp-port", "65535"),
        ({"OUTBOX_SMTP_SECURITY": "tls"}, "--smtp-security", "'tls' is not one of"),
        ({"OUTBOX_SMTP_TIMEOUT": "soon"}, "--smtp-timeout", "OUTBOX_SMTP_TIMEOUT='soon'"),
        ({"OUTBOX_SMTP_TIMEOUT": "-1"}, "--smtp-timeout", "positive"),
        ({"OUTBOX_SMTP_USERNAME": "relay"}, "--smtp-password", "--smtp-username"),
        ({"OUTBOX_SMTP_PASSWORD": "hunter2"}, "--smtp-username", "--smtp-password"),
    ],
)
def test_from_env_errors_name_the_setting(env, setting, text):
    if env:
        env = {"OUTBOX_SMTP_HOST": "h", **env}
    with pytest.raises(ConfigurationError) as caught:
        SmtpSender.from_env(env)
    assert caught.value.setting == setting
    assert text in str(caught.value)
    assert "hunter2" not in str(caught.value)


def test_module_factory_reads_os_environ(monkeypatch):
    """``outbox-relay run --sender relay.senders.smtp:from_env``."""
    monkeypatch.setenv("OUTBOX_SMTP_HOST", "smtp.example.net")
    monkeypatch.setenv("OUTBOX_SMTP_SECURITY", "none")
    monkeypatch.setenv("OUTBOX_SMTP_PORT", "25")
    monkeypatch.delenv("OUTBOX_SMTP_USERNAME", raising=False)
    monkeypatch.delenv("OUTBOX_SMTP_PASSWORD", raising=False)
    monkeypatch.delenv("OUTBOX_SMTP_TIMEOUT", raising=False)
    sender = smtp_module.from_env()
    assert (sender.host, sender.port, sender.security) == ("smtp.example.net", 25, "none")


# -- the relay's credentials and the sending identity are not the message's problem ----------

SES_NOT_VERIFIED = (
    b"Message rejected: Email address is not verified. The following identities failed the "
    b"check in region US-EAST-1: "
)
SHOP_SCOPE = Scope(ScopeKind.IDENTITY, "shop@example.com")
DENIED = (
    b"Access denied: User `arn:aws:iam::123456789012:user/relay' is not authorized to perform "
    b"`ses:SendRawEmail' on resource `arn:aws:ses:us-west-2:123456789012:"
)

IDENTITY_CASES = [
    pytest.param(
        smtplib.SMTPDataError(554, SES_NOT_VERIFIED + b"Shop <shop@example.com>"),
        True,
        SHOP_SCOPE,
        "smtp_554",
        id="ses-sender-not-verified",
    ),
    pytest.param(
        smtplib.SMTPDataError(554, SES_NOT_VERIFIED + b"c1@example.org, SHOP@example.com"),
        True,
        SHOP_SCOPE,
        "smtp_554",
        id="ses-several-with-the-sender",
    ),
    pytest.param(
        smtplib.SMTPDataError(554, DENIED + b"identity/shop@example.com'"),
        True,
        SHOP_SCOPE,
        "smtp_554",
        id="ses-identity-denied",
    ),
    pytest.param(
        smtplib.SMTPDataError(554, DENIED + b"configuration-set/tracked'"),
        True,
        Scope(ScopeKind.CONFIGURATION_SET, "tracked", via="shop@example.com"),
        "smtp_554",
        id="ses-default-set-denied",
    ),
    pytest.param(
        smtplib.SMTPSenderRefused(553, b"5.7.1 sender not owned by user", A),
        False,
        SHOP_SCOPE,
        "smtp_553",
        id="mail-from-not-owned",
    ),
    pytest.param(
        smtplib.SMTPSenderRefused(550, b"5.7.1 relay denied", A),
        False,
        SHOP_SCOPE,
        "smtp_550",
        id="mail-from-not-allowed",
    ),
    pytest.param(
        smtplib.SMTPSenderRefused(530, b"5.7.0 Authentication required", A),
        False,
        ACCOUNT,
        "smtp_auth_failed",
        id="auth-required-at-mail-from",
    ),
    pytest.param(
        smtplib.SMTPSenderRefused(535, b"Authentication Credentials Invalid", A),
        False,
        ACCOUNT,
        "smtp_auth_failed",
        id="credentials-invalid-at-mail-from",
    ),
    pytest.param(
        smtplib.SMTPAuthenticationError(535, b"Authentication Credentials Invalid"),
        False,
        ACCOUNT,
        "smtp_auth_failed",
        id="credentials-invalid-at-login",
    ),
]


@pytest.mark.parametrize(("exc", "data_sent", "scope", "code"), IDENTITY_CASES)
def test_a_refusal_of_the_sender_or_the_credentials_pauses_without_an_attempt(
    exc, data_sent, scope, code
):
    outcome = classify(exc, data_sent=data_sent, sender="Shop <Shop@example.com>")
    assert isinstance(outcome, Disabled)
    assert outcome.pause
    assert (outcome.scope, outcome.code) == (scope, code)


@pytest.mark.parametrize(
    "exc",
    [
        pytest.param(
            smtplib.SMTPDataError(554, SES_NOT_VERIFIED + b"c1@example.org"), id="ses-recipient"
        ),
        pytest.param(smtplib.SMTPSenderRefused(552, b"size exceeds limit", A), id="size"),
        pytest.param(smtplib.SMTPSenderRefused(555, b"5.5.4 unsupported", A), id="parameter"),
        pytest.param(smtplib.SMTPDataError(554, b"5.7.1 spam"), id="content"),
    ],
)
def test_a_refusal_of_this_message_still_fails_it(exc):
    outcome = classify(exc, data_sent=True, sender="Shop <shop@example.com>")
    assert isinstance(outcome, Permanent)
