"""`outbox-relay run` as a user runs it: bad settings are refused before anything starts, and
a SQLite quick run delivers its backlog."""

from __future__ import annotations

import os
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox.sqlite import enable_savepoints
from relay import cli
from relay.testing import read_deliveries
from tests.support.db import attempt_rows
from tests.support.factories import enqueue
from tests.support.relays import FAKE_SENDER, RELAY, clean_env, message_rows, relay_rows

FLAGS = (
    "--database-url",
    "--sender",
    "--concurrency",
    "--batch-size",
    "--lease-seconds",
    "--send-timeout",
    "--poll-interval",
    "--max-send-rate",
    "--drain-seconds",
    "--exit-when-idle",
    "--relay-id",
    "--log-level",
)

PROJECT = str(Path(cli.__file__).resolve().parents[2])  # the relay this test imports


def relay(*args: str, timeout: float = 30, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [RELAY, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(**env),
        stdin=subprocess.DEVNULL,
        check=False,
    )


def env_name(flag: str) -> str:
    return "OUTBOX_" + flag.removeprefix("--").replace("-", "_").upper()


def refusal(done: subprocess.CompletedProcess[str]) -> str:
    """The one ``Error:`` line of a refused start, after checking how it was refused."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    assert done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, done.stderr
    return errors[0]


SMTP = {"--sender": "smtp", "--smtp-host": "mail.example.com"}

# (flags and values, the flag the refusal must name). The database URL defaults to a SQLite
# file that must still not exist afterwards: a refused start never connects.
BAD_SETTINGS = {
    "concurrency-zero": ({"--concurrency": "0"}, "--concurrency"),
    "concurrency-negative": ({"--concurrency": "-1"}, "--concurrency"),
    "concurrency-not-a-number": ({"--concurrency": "many"}, "--concurrency"),
    "batch-size-zero": ({"--batch-size": "0"}, "--batch-size"),
    "lease-not-twice-send-timeout": (
        {"--lease-seconds": "10", "--send-timeout": "20"},
        "--lease-seconds",
    ),
    "lease-exactly-twice-send-timeout": (
        {"--lease-seconds": "40", "--send-timeout": "20"},
        "--lease-seconds",
    ),
    "drain-shorter-than-send-timeout": ({"--drain-seconds": "1"}, "--drain-seconds"),
    "drain-not-a-number": ({"--drain-seconds": "nan"}, "--drain-seconds"),
    "poll-interval-zero": ({"--poll-interval": "0"}, "--poll-interval"),
    "max-send-rate-negative": ({"--max-send-rate": "-5"}, "--max-send-rate"),
    "max-send-rate-zero": ({"--max-send-rate": "0"}, "--max-send-rate"),
    "max-send-rate-tiny": ({"--max-send-rate": "1e-300"}, "--max-send-rate"),
    "send-timeout-infinite": ({"--send-timeout": "inf"}, "--send-timeout"),
    "sender-unknown-name": ({"--sender": "nosuch"}, "--sender"),
    "sender-missing-module": ({"--sender": "nosuch.module:x"}, "--sender"),
    "sender-missing-factory": ({"--sender": "relay.testing:nosuch"}, "--sender"),
    "smtp-host-missing": ({"--sender": "smtp"}, "--smtp-host"),
    "smtp-port-zero": ({**SMTP, "--smtp-port": "0"}, "--smtp-port"),
    "smtp-security-unknown": ({**SMTP, "--smtp-security": "tls"}, "--smtp-security"),
    "smtp-username-alone": ({**SMTP, "--smtp-username": "relay"}, "--smtp-password"),
    "smtp-timeout-zero": ({**SMTP, "--smtp-timeout": "0"}, "--smtp-timeout"),
    "smtp-timeout-past-send-timeout": ({**SMTP, "--smtp-timeout": "30"}, "--smtp-timeout"),
    "log-level-unknown": ({"--log-level": "LOUD"}, "--log-level"),
    "database-url-not-a-url": ({"--database-url": "notaurl"}, "--database-url"),
    "database-url-unsupported": ({"--database-url": "oracle://x/y"}, "--database-url"),
}


@pytest.fixture
def db_path(tmp_path):
    path = tmp_path / "never-created.db"
    yield path
    assert not path.exists(), "a refused start touched the database"


def _settings(settings: dict[str, str], db_path) -> dict[str, str]:
    return {"--database-url": f"sqlite:///{db_path}", "--sender": "console", **settings}


def _without_env_hint(line: str) -> str:
    """click names the env var in its own type errors only sometimes; compare without it."""
    return re.sub(r" \(env var: '[A-Z_]+'\)", "", line)


@pytest.mark.parametrize(("settings", "flag"), BAD_SETTINGS.values(), ids=BAD_SETTINGS.keys())
def test_a_bad_setting_is_refused_with_one_line_naming_it_as_flag_or_env_var(
    settings, flag, db_path
):
    full = _settings(settings, db_path)
    as_flags = refusal(relay("run", *(part for item in full.items() for part in item)))
    assert flag in as_flags
    as_env = refusal(relay("run", **{env_name(k): v for k, v in full.items()}))
    assert _without_env_hint(as_env) == _without_env_hint(as_flags)


def test_an_unknown_flag_is_refused(db_path):
    line = refusal(relay("run", "--database-url", f"sqlite:///{db_path}", "--bogus"))
    assert "--bogus" in line


def test_an_empty_relay_id_is_refused(db_path):
    # (as an env var, empty means "not set" to click, and the default id applies)
    line = refusal(relay("run", "--database-url", f"sqlite:///{db_path}", "--relay-id", ""))
    assert "--relay-id" in line


def test_a_missing_database_url_is_refused(db_path):
    line = refusal(relay("run", "--sender", "console"))
    assert "--database-url" in line


@pytest.mark.parametrize(
    "sender",
    [
        "relay.testing:read_deliveries",  # the factory raises (it needs an argument)
        "builtins:object",  # the factory returns something that cannot send
    ],
    ids=["factory-raises", "factory-returns-a-non-sender"],
)
def test_a_sender_factory_that_cannot_make_a_sender_is_refused(sender, tmp_path):
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    assert relay("migrate", "--database-url", url).returncode == 0
    engine = sa.create_engine(url)
    enable_savepoints(engine)
    try:
        (waiting,) = enqueue(engine, 1, prefix="acceptance")
        done = relay(
            "run", "--database-url", url, "--sender", sender, "--exit-when-idle", timeout=15
        )
        line = refusal(done)
        assert "--sender" in line
        assert sender in line
        row = message_rows(engine)[waiting]
        assert (row.status, row.attempt_count) == ("pending", 0)  # not parked as unknown_outcome
    finally:
        engine.dispose()


# a quick drain with the sender's own account rate
DRAIN_AUTO = ("--poll-interval", "0.1", "--max-send-rate", "auto")


def run_custom(
    tmp_path: Path, url: str, sender: str, *flags: str, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """``outbox-relay run --exit-when-idle`` with a ``--sender`` module written to tmp_path."""
    return relay(
        "run",
        "--database-url",
        url,
        "--sender",
        sender,
        "--exit-when-idle",
        *flags,
        timeout=timeout,
        PYTHONPATH=os.pathsep.join([str(tmp_path), PROJECT]),
    )


SEND_ONLY = """
from relay.senders import Accepted


class Plain:
    def send(self, message):
        return Accepted(provider_message_id=f"plain-{message.id}")


def factory():
    return Plain()
"""


def test_a_factory_returning_an_object_with_only_send_delivers_with_the_defaults(tmp_path):
    """name, close and max_send_rate come from BaseSender: the metrics endpoint names the
    class, --max-send-rate auto finds no account rate, the exit closes nothing."""
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    assert relay("migrate", "--database-url", url).returncode == 0
    (tmp_path / "plainsender.py").write_text(SEND_ONLY)
    engine = sa.create_engine(url)
    enable_savepoints(engine)
    try:
        ids = enqueue(engine, 3, prefix="acceptance")
        done = run_custom(
            tmp_path,
            url,
            "plainsender:factory",
            *DRAIN_AUTO,
            "--http-port",
            "0",
            "--http-host",
            "127.0.0.1",
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        assert "the sender reports no account rate" in done.stderr
        rows = message_rows(engine)
        assert {row.status for row in rows.values()} == {"sent"}
        assert {i: row.provider_message_id for i, row in rows.items()} == {
            i: f"plain-{i}" for i in ids
        }
    finally:
        engine.dispose()


def test_help_lists_every_flag_with_its_env_var():
    done = relay("run", "--help")
    assert done.returncode == 0, done.stderr
    # one block per option: its first line starts with the flag, wrapped lines are indented
    blocks: dict[str, str] = {}
    for line in done.stdout.splitlines():
        found = re.match(r"\s{2}(?:-\w, )?(--[a-z-]+)", line)
        if found:
            current = found.group(1)
            blocks[current] = line
        elif line.startswith("      ") and blocks:
            blocks[current] += " " + line.strip()
    declared = {opt for param in cli.run.params for opt in param.opts}
    assert set(FLAGS) <= declared
    for flag in declared:
        assert flag in blocks, f"{flag} missing from --help"
        text = " ".join(blocks[flag].split())
        assert f"env var: {env_name(flag)}" in text, text


def test_a_quick_run_on_sqlite_delivers_every_message_once(tmp_path):
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    migrated = relay("migrate", "--database-url", url)
    assert migrated.returncode == 0, migrated.stderr
    engine = sa.create_engine(url)
    enable_savepoints(engine)
    try:
        ids = enqueue(engine, 20, prefix="acceptance")
        record = tmp_path / "sent.log"
        done = relay(
            "run",
            "--exit-when-idle",
            "--relay-id",
            "sqlite-quick",
            timeout=60,
            OUTBOX_DATABASE_URL=url,
            OUTBOX_SENDER=FAKE_SENDER,
            OUTBOX_POLL_INTERVAL="0.1",
            OUTBOX_FAKE_RECORD_FILE=str(record),
        )
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        assert read_deliveries(record) == Counter(ids)
        rows = message_rows(engine)
        assert {row.status for row in rows.values()} == {"sent"}
        assert all(row.provider_message_id == f"fake-{i}-1" for i, row in rows.items())
        assert Counter(a.message_id for a in attempt_rows(engine)) == Counter(ids)
        assert relay_rows(engine)["sqlite-quick"].state == "stopped"
    finally:
        engine.dispose()


HOSTILE = """
from relay.senders import Accepted


class Closing:
    def send(self, message):
        return Accepted(provider_message_id=f"closing-{message.id}")

    def close(self):
        raise RuntimeError("close failed")

    def max_send_rate(self):
        return RATE


class Unnamed(Closing):
    @property
    def name(self):
        raise RuntimeError("no name")


def closing():
    return Closing()


def unnamed():
    return Unnamed()
"""


@pytest.mark.parametrize("rate", ["float('nan')", "0", "float('inf')", "1e-300", "'abc'", "-3"])
def test_a_sender_whose_close_raises_and_whose_rate_is_garbage_still_delivers_and_exits_0(
    tmp_path, rate
):
    """A sender's account rate that no limit can be built on falls back like a missing one
    (each of these crashed the loop or the start), and a close() that raises after every send
    was saved is logged: the exit is 0 and the engine is disposed (it was exit 1)."""
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    assert relay("migrate", "--database-url", url).returncode == 0
    (tmp_path / "hostilesender.py").write_text(HOSTILE.replace("RATE", rate))
    engine = sa.create_engine(url)
    enable_savepoints(engine)
    try:
        ids = enqueue(engine, 3, prefix="acceptance")
        done = run_custom(tmp_path, url, "hostilesender:closing", *DRAIN_AUTO, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "--max-send-rate auto: the sender reports" in done.stderr
        assert "the sender failed to close" in done.stderr
        rows = message_rows(engine)
        assert {i: (row.status, row.provider_message_id) for i, row in rows.items()} == {
            i: ("sent", f"closing-{i}") for i in ids
        }
    finally:
        engine.dispose()


def run_hostile(tmp_path: Path, url: str, factory: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "hostilesender.py").write_text(HOSTILE.replace("RATE", "None"))
    return run_custom(tmp_path, url, f"hostilesender:{factory}")


def test_a_sender_whose_close_raises_does_not_hide_a_start_up_error(tmp_path):
    url = f"sqlite:///{tmp_path / 'never-migrated.db'}"
    sa.create_engine(url).connect().close()
    assert "lacks the outbox tables" in refusal(run_hostile(tmp_path, url, "closing"))


def test_a_sender_whose_members_raise_is_refused_in_one_line(tmp_path):
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    assert relay("migrate", "--database-url", url).returncode == 0
    line = refusal(run_hostile(tmp_path, url, "unnamed"))
    assert "--sender" in line
    assert "no name" in line


# -- no sender by default, and what a start says ------------------------------------------------


def test_run_without_a_sender_is_refused_naming_it(db_path):
    """A sidecar installed without OUTBOX_SENDER must not mark every message sent."""
    line = refusal(relay("run", "--database-url", f"sqlite:///{db_path}"))
    assert line.startswith("Error: --sender: is required")
    assert "console, which delivers nothing" in line
    as_env = refusal(relay("run", OUTBOX_DATABASE_URL=f"sqlite:///{db_path}"))
    assert as_env == line


def test_the_console_sender_says_it_delivers_nothing_and_masks_every_recipient(tmp_path):
    url = f"sqlite:///{tmp_path / 'console.db'}"
    assert relay("migrate", "--database-url", url).returncode == 0
    engine = sa.create_engine(url)
    enable_savepoints(engine)
    try:
        ids = enqueue(engine, 2, prefix="console")
        done = relay("run", "--database-url", url, "--sender", "console", "--exit-when-idle")
        assert done.returncode == 0, done.stderr
        assert "action=console_sender" in done.stderr
        assert "delivers nothing" in done.stderr
        lines = done.stdout.splitlines()
        assert [line.split()[2] for line in lines] == [str(i) for i in ids]
        for line, row in zip(lines, message_rows(engine).values(), strict=True):
            for address in row.recipients.split(", "):
                assert address not in line  # never unmasked
                assert f"{address[0]}***@{address.split('@')[1]}" in line
            assert row.subject not in line
            assert "not delivered" in line
    finally:
        engine.dispose()


def test_every_run_starts_with_one_line_naming_sender_endpoint_relay_and_database(tmp_path):
    url = f"sqlite:///{tmp_path / 'banner.db'}"
    assert relay("migrate", "--database-url", url).returncode == 0
    done = relay(
        "run",
        "--database-url",
        url,
        "--sender",
        "ses",
        "--relay-id",
        "banner-1",
        "--exit-when-idle",
        AWS_REGION="eu-west-1",
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_ENDPOINT_URL_SESV2="http://127.0.0.1:9",
    )
    assert done.returncode == 0, done.stderr
    (first,) = [x for x in done.stderr.splitlines() if "action=started" in x]
    for field in (
        "sender_kind=ses",
        "region=eu-west-1",
        "endpoint=http://127.0.0.1:9",
        "relay_id=banner-1",
        f"database={url}",
    ):
        assert field in first, first


def test_the_start_line_masks_the_database_password(postgres_backend):
    url = sa.make_url(postgres_backend.url).set(password="s3cret-pw")  # trust auth ignores it
    done = relay(
        "run",
        "--database-url",
        url.render_as_string(hide_password=False),
        "--sender",
        FAKE_SENDER,
        "--exit-when-idle",
    )
    assert done.returncode == 0, done.stderr
    assert "s3cret-pw" not in done.stderr + done.stdout
    (line,) = [x for x in done.stderr.splitlines() if "action=started" in x]
    assert ":***@" in line
    # libpq also takes the password as a query parameter: masked too, and warned about
    in_query = sa.make_url(postgres_backend.url).update_query_dict({"password": "hunter2-pw"})
    done = relay(
        "run",
        "--database-url",
        in_query.render_as_string(hide_password=False),
        "--sender",
        FAKE_SENDER,
        "--exit-when-idle",
    )
    assert done.returncode == 0, done.stderr
    assert "hunter2-pw" not in done.stderr + done.stdout
    assert "Warning: --database-url holds a password" in done.stderr
    (line,) = [x for x in done.stderr.splitlines() if "action=started" in x]
    assert "password=***" in line


def test_a_password_given_as_a_flag_is_warned_about_and_as_a_variable_is_not(tmp_path):
    """A flag is in the process list for every user of the machine; a variable is not."""
    url = f"sqlite:///{tmp_path / 'never.db'}"
    flags = relay(
        "run",
        "--database-url",
        url,
        "--sender",
        "smtp",
        "--smtp-password",
        "pw",
        "--smtp-host",
        "",
    )
    warnings = [line for line in flags.stderr.splitlines() if line.startswith("Warning:")]
    assert warnings == [
        "Warning: --smtp-password holds a password on the command line, where other users of "
        "this machine can read it (ps); set OUTBOX_SMTP_PASSWORD instead"
    ]
    quiet = relay(
        "run", "--sender", "smtp", "--smtp-host", "", OUTBOX_DATABASE_URL=url,
        OUTBOX_SMTP_PASSWORD="pw",
    )  # fmt: skip
    assert "Warning:" not in quiet.stderr
    with_password = relay("status", "--database-url", "postgresql://u:secret@127.0.0.1:9/x")
    assert "Warning: --database-url holds a password" in with_password.stderr
    assert "secret" not in with_password.stderr
