"""The Sender protocol: BaseSender's defaults, what ``--sender module:factory`` may return, and
how ``--sender smtp`` maps its flags onto SmtpSettings."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from outbox import Email
from outbox.exceptions import ConfigurationError
from relay.cli import build_sender
from relay.config import RelayConfig
from relay.senders import Accepted, BaseSender, OutgoingMessage, Sender, as_sender
from relay.senders.smtp import SmtpSender, SmtpSettings

MESSAGE = OutgoingMessage(
    id=7,
    key="k",
    category="default",
    attempt=1,
    email=Email(sender="shop@example.com", to=["a@example.com"], subject="s", text="t"),
)
CONFIG = RelayConfig(database_url="sqlite:///never-opened.db")


class Minimal(BaseSender):
    def send(self, message: OutgoingMessage) -> Accepted:
        return Accepted(provider_message_id=f"minimal-{message.id}")


class Named(Minimal):
    name = "named"


class SendOnly:
    def __init__(self) -> None:
        self.sent: list[int] = []

    def send(self, message: OutgoingMessage) -> Accepted:
        self.sent.append(message.id)
        return Accepted(provider_message_id=None)


class Partial(SendOnly):
    name = "partial"

    def __init__(self) -> None:
        super().__init__()
        self.closed = 0

    def close(self) -> None:
        self.closed += 1

    def max_send_rate(self) -> int:
        return 14


def test_base_sender_gives_the_defaults():
    sender = Minimal()
    assert isinstance(sender, Sender)
    assert sender.name == "Minimal"
    assert Named().name == "named"
    assert sender.close() is None
    assert sender.max_send_rate() is None
    assert sender.send(MESSAGE) == Accepted(provider_message_id="minimal-7")


def test_base_sender_without_send_cannot_be_made():
    class NoSend(BaseSender):
        pass

    with pytest.raises(TypeError, match="send"):
        NoSend()


def test_a_complete_sender_is_used_as_it_is():
    sender = Named()
    assert as_sender(sender) is sender


def test_an_object_with_only_send_gets_the_defaults():
    plain = SendOnly()
    sender = as_sender(plain)
    assert isinstance(sender, Sender)
    assert (sender.name, sender.max_send_rate()) == ("SendOnly", None)
    sender.close()
    assert sender.send(MESSAGE) == Accepted(provider_message_id=None)
    assert plain.sent == [7]


def test_an_object_keeps_the_members_it_has():
    partial = Partial()
    sender = as_sender(partial)
    assert sender is partial  # every member present: not wrapped
    partial.close = None  # present but unusable
    wrapped = as_sender(partial)
    assert wrapped is not partial
    assert (wrapped.name, wrapped.max_send_rate()) == ("partial", 14.0)
    wrapped.close()  # the default: nothing to call


@pytest.mark.parametrize("candidate", [object(), types.SimpleNamespace(send="not callable")])
def test_an_object_without_send_is_refused(candidate):
    with pytest.raises(TypeError, match=r"which has no send\(message\)"):
        as_sender(candidate)


@pytest.fixture
def factories(monkeypatch):
    module = types.ModuleType("h4_factories")
    module.send_only = SendOnly
    module.nothing = object
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.__name__


def test_the_cli_adapts_a_factorys_send_only_object(factories):
    sender = build_sender(f"{factories}:send_only", CONFIG, {})
    assert sender.name == "SendOnly"
    assert sender.max_send_rate() is None
    sender.close()
    assert sender.send(MESSAGE) == Accepted(provider_message_id=None)


def test_the_cli_refuses_a_factorys_object_without_send_in_one_line(factories):
    with pytest.raises(ConfigurationError) as caught:
        build_sender(f"{factories}:nothing", CONFIG, {})
    assert caught.value.setting == "--sender"
    assert str(caught.value) == (
        f"--sender: '{factories}:nothing' returned an instance of object, which has no "
        "send(message): subclass relay.senders.BaseSender and write send()"
    )


def smtp_options(**flags: object) -> dict[str, object]:
    """``run``'s SMTP options as click hands them over: unset flags are None."""
    unset = ("smtp_host", "smtp_port", "smtp_username", "smtp_password", "smtp_timeout")
    return {**dict.fromkeys(unset), "smtp_security": "starttls", **flags}


@pytest.mark.parametrize(
    ("flags", "settings", "port"),
    [
        ({}, SmtpSettings(host="mail.example.com", port=None, timeout=20.0), 587),
        ({"smtp_security": "ssl"}, SmtpSettings(host="mail.example.com", security="ssl"), 465),
        (
            {"smtp_port": 2525, "smtp_username": "u", "smtp_password": "p", "smtp_timeout": 5.0},
            SmtpSettings(
                host="mail.example.com", port=2525, username="u", password="p", timeout=5.0
            ),
            2525,
        ),
    ],
)
def test_the_cli_maps_its_smtp_flags_onto_the_settings(flags, settings, port):
    sender = build_sender("smtp", CONFIG, smtp_options(smtp_host="mail.example.com", **flags))
    assert isinstance(sender, SmtpSender)
    assert (sender.settings, sender.port) == (settings, port)


def test_the_smtp_timeout_follows_send_timeout_unless_set():
    config = RelayConfig(database_url="sqlite:///never-opened.db", send_timeout=8.0)
    sender = build_sender("smtp", config, smtp_options(smtp_host="h"))
    assert isinstance(sender, SmtpSender)
    assert sender.timeout == 8.0


@pytest.mark.parametrize(
    ("flags", "setting", "text"),
    [
        ({}, "--smtp-host", "required (or OUTBOX_SMTP_HOST)"),
        ({"smtp_host": "h", "smtp_port": 0}, "--smtp-port", "from 1 to 65535"),
        ({"smtp_host": "h", "smtp_password": "hunter2"}, "--smtp-username", "--smtp-password"),
        ({"smtp_host": "h", "smtp_timeout": 0.0}, "--smtp-timeout", "positive"),
        ({"smtp_host": "h", "smtp_timeout": 21.0}, "--smtp-timeout", "at most --send-timeout"),
    ],
)
def test_bad_smtp_flags_are_refused_naming_the_flag(flags, setting, text):
    with pytest.raises(ConfigurationError) as caught:
        build_sender("smtp", CONFIG, smtp_options(**flags))
    assert caught.value.setting == setting
    assert text in str(caught.value)
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize(("sender", "rate"), [(SendOnly, None), (Partial, 14)])
def test_a_relay_given_a_send_only_object_delivers_with_the_defaults(tmp_path, sender, rate):
    import sqlalchemy as sa

    from outbox import Outbox, migrations
    from relay.testing import run_until_idle
    from relay.worker import Relay

    engine = sa.create_engine(f"sqlite:///{tmp_path / 'outbox.db'}")
    migrations.upgrade(engine)
    with sa.orm.Session(engine) as session, session.begin():
        ids = [Outbox().enqueue(session, MESSAGE.email, key=f"k{n}").id for n in range(3)]
    given = sender()
    config = dataclasses.replace(CONFIG, max_send_rate="auto")
    relay = Relay(engine=engine, sender=given, config=config)
    assert relay.sender.max_send_rate() == rate
    run_until_idle(engine, given, max_send_rate="auto")
    assert sorted(given.sent) == sorted(ids)
    engine.dispose()


@pytest.mark.parametrize("given", ["SSL", "StartTLS", "none"])
def test_the_smtp_security_flag_takes_any_case_as_its_variable_does(given):
    from relay import cli

    (param,) = [p for p in cli.run.params if p.name == "smtp_security"]
    assert param.type.convert(given, param, None) == given.lower()
    assert SmtpSettings.from_env(
        {"OUTBOX_SMTP_HOST": "h", "OUTBOX_SMTP_SECURITY": given}
    ).security == (given.lower())


def test_a_sender_whose_account_rate_raises_runs_at_the_fallback_rate(tmp_path, caplog):
    """``--max-send-rate auto`` with a custom sender whose max_send_rate() raises: the relay
    starts at the fallback rate with a warning naming the error, and delivers."""
    import logging

    import sqlalchemy as sa

    from outbox import Outbox, migrations
    from relay.testing import run_until_idle

    class RateRaises(SendOnly):
        def max_send_rate(self) -> float | None:
            raise RuntimeError("account lookup broke")

    engine = sa.create_engine(f"sqlite:///{tmp_path / 'outbox.db'}")
    migrations.upgrade(engine)
    with sa.orm.Session(engine) as session, session.begin():
        ids = [Outbox().enqueue(session, MESSAGE.email, key=f"k{n}").id for n in range(2)]
    given = RateRaises()
    caplog.set_level(logging.WARNING, logger="relay")
    run_until_idle(engine, given, max_send_rate="auto")
    assert sorted(given.sent) == sorted(ids)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("account lookup broke" in w and "using 1/s" in w for w in warnings), warnings
    engine.dispose()
