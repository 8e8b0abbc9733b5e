"""The file sender on its own: what it writes, how it names it, and how it fails."""

from __future__ import annotations

import io
import os
import re
import stat
from datetime import UTC, datetime
from email.generator import BytesGenerator

import pytest

from outbox.exceptions import ConfigurationError
from outbox.message import Email
from relay.senders import Accepted, OutgoingMessage, Permanent, Transient
from relay.senders.file import FileSender, file_name, render
from relay.senders.smtp import SmtpSender, SmtpSettings
from tests.support.eml import RICH, assert_reads_back_as
from tests.support.factories import make, template

NOW = datetime(2026, 12, 5, 12, 0, 0, 123456, tzinfo=UTC)


def outgoing(mail: Email = RICH, *, id: int = 42, attempt: int = 1) -> OutgoingMessage:
    return OutgoingMessage(id=id, key=f"key-{id}", category="default", attempt=attempt, email=mail)


def without_date(data: bytes) -> bytes:
    return re.sub(rb"\r\nDate: [^\r]*\r\n", b"\r\n", data, count=1)


def test_render_is_the_bytes_the_smtp_sender_sends():
    """The file sender's copy of SmtpSender._mime and its flatten must not drift apart."""
    message = outgoing()
    smtp = SmtpSender(SmtpSettings(host="mail.example.com"))
    buffer = io.BytesIO()
    BytesGenerator(buffer).flatten(smtp._mime(message), linesep="\r\n")
    boundaries = re.compile(rb"={15}\d+==")
    ours = boundaries.sub(b"B", without_date(render(message, now=NOW)))
    theirs = boundaries.sub(b"B", without_date(buffer.getvalue()))
    assert ours == theirs
    assert b"\r\nDate: Sat, 05 Dec 2026 12:00:00 " in render(message, now=NOW)


def test_a_message_is_one_eml_named_by_time_id_and_attempt(tmp_path):
    sender = FileSender(tmp_path / "mail", clock=lambda: NOW)
    outcome = sender.send(outgoing(attempt=3))
    (written,) = (tmp_path / "mail").iterdir()  # no temporary file left beside it
    assert written.name == "20261205T120000.123Z-42-3.eml"
    assert outcome == Accepted(provider_message_id=f"file-{written.name}")
    assert stat.S_IMODE(written.stat().st_mode) == 0o600  # bodies are personal data
    assert stat.S_IMODE((tmp_path / "mail").stat().st_mode) == 0o700
    read = assert_reads_back_as(written.read_bytes(), RICH)
    assert read["X-Outbox-Message-Id"] == "42"


def test_names_sort_by_time_and_never_collide_across_ids_and_attempts():
    times = [datetime(2026, 12, 5, 9, 59, 59, 999000, tzinfo=UTC), NOW]
    names = [
        file_name(outgoing(id=i, attempt=a), t) for t in times for i in (7, 42) for a in (1, 2)
    ]
    assert max(names[:4]) < min(names[4:])  # earlier first, whatever the id
    assert len(set(names)) == len(names)


def test_a_failed_write_is_transient_and_leaves_nothing(tmp_path, monkeypatch):
    sender = FileSender(tmp_path, clock=lambda: NOW)

    def disk_full(src: str, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    outcome = sender.send(outgoing())
    assert isinstance(outcome, Transient)
    assert outcome.code == "file_write_failed"
    assert "No space left on device" in outcome.message
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone too


def test_a_folder_removed_while_running_is_transient(tmp_path):
    sender = FileSender(tmp_path / "mail")
    (tmp_path / "mail").rmdir()
    outcome = sender.send(outgoing())
    assert isinstance(outcome, Transient)
    assert outcome.code == "file_write_failed"


def test_a_template_email_fails_for_good(tmp_path):
    outcome = FileSender(tmp_path).send(outgoing(make(**template())))
    assert isinstance(outcome, Permanent)
    assert outcome.code == "template_not_supported_by_file"


@pytest.mark.parametrize(
    ("where", "why"),
    [("plain-file", "it is not a folder"), ("plain-file/sub", "Not a directory")],
    ids=["a-file", "under-a-file"],
)
def test_a_folder_that_cannot_be_created_or_written_names_mail_dir(tmp_path, where, why):
    (tmp_path / "plain-file").write_text("")
    with pytest.raises(ConfigurationError) as raised:
        FileSender(tmp_path / where)
    assert raised.value.setting == "--mail-dir"
    assert why in str(raised.value)
    assert "\n" not in str(raised.value)


def test_the_file_sender_says_it_delivers_nothing_and_where_it_writes(tmp_path):
    sender = FileSender(tmp_path)
    assert (sender.name, sender.delivers) == ("file", False)
    assert sender.where() == {"mail_dir": str(tmp_path)}
