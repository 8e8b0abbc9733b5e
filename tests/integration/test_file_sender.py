"""The file sender under a real relay, and `outbox-relay show --body`, on SQLite, PostgreSQL
and MariaDB."""

from __future__ import annotations

import json

import sqlalchemy as sa
from click.testing import CliRunner, Result

from outbox.schema import messages
from relay.cli import main
from relay.senders.file import FileSender
from relay.testing import run_until_idle
from tests.support.db import attempt_rows
from tests.support.eml import RICH, assert_reads_back_as
from tests.support.factories import enqueue, make, template

NOTICE = "Note: showing the body of message"


def show(backend, *args: str) -> Result:
    result = CliRunner().invoke(
        main, ["show", *args], env={"OUTBOX_DATABASE_URL": backend.url}, catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    return result


def test_the_relay_writes_each_message_as_one_eml_and_marks_it_sent(backend, tmp_path):
    (mid,) = enqueue(backend.engine, [RICH], prefix="file")
    run_until_idle(backend.engine, FileSender(tmp_path / "mail"))
    (written,) = (tmp_path / "mail").iterdir()
    assert written.name.endswith(f"-{mid}-1.eml")
    read = assert_reads_back_as(written.read_bytes(), RICH)
    assert read["X-Outbox-Message-Id"] == str(mid)
    with backend.engine.connect() as conn:
        row = conn.execute(sa.select(messages).where(messages.c.id == mid)).one()
    assert (row.status, row.provider_message_id) == ("sent", f"file-{written.name}")
    (attempt,) = attempt_rows(backend.engine, mid)
    assert attempt.outcome == "accepted"


def test_show_body_prints_the_email_and_says_so_on_stderr(backend):
    (mid,) = enqueue(backend.engine, [RICH], prefix="body")
    plain = show(backend, str(mid))
    assert "Merci" not in plain.stdout
    assert NOTICE not in plain.stderr

    shown = show(backend, str(mid), "--body")
    assert shown.stderr == f"{NOTICE} {mid} (personal data)\n"
    body = shown.stdout.split("\nbody\n", 1)[1]
    assert "Subject  Votre reçu ✓ — 注文 42" in body
    assert "Cc       ben@example.com" in body
    assert "X-Ref    order-42" in body
    assert (
        "text (26 bytes)\nMerci !\nTotal : 12,50 €\n\n"
        "html (37 bytes; --json or --body raw shows it)\n"
    ) in body
    assert "<p>" not in body
    assert "reçu.pdf  application/pdf  attachment" in body
    assert "1024" in body

    data = json.loads(show(backend, str(mid), "--body", "--json").stdout)["body"]
    assert data["headers"]["Subject"] == RICH.subject
    assert (data["text"], data["html"]) == (RICH.text, RICH.html)
    assert [(a["filename"], a["size"]) for a in data["attachments"]] == [
        ("reçu.pdf", 1024),
        ("data.csv", 9),
    ]
    assert "body" not in json.loads(show(backend, str(mid), "--json").stdout)

    raw = show(backend, str(mid), "--body", "raw")
    mime = raw.stdout.split("\nbody (MIME)\n", 1)[1]
    assert_reads_back_as(mime.encode("ascii"), RICH)
    assert NOTICE in raw.stderr


def test_show_body_of_a_template_email_or_a_broken_payload_says_why(backend):
    tpl, broken = enqueue(
        backend.engine, [make(**template(template_data={"name": "Ana"})), make()], prefix="tpl"
    )
    with backend.engine.begin() as conn:
        conn.execute(messages.update().where(messages.c.id == broken).values(payload={"v": 99}))
    data = json.loads(show(backend, str(tpl), "--body", "--json").stdout)["body"]
    assert (data["template"], data["template_data"]) == ("welcome", {"name": "Ana"})
    refused = show(backend, str(tpl), "--body", "raw")
    assert "body: a template email is rendered by SES" in refused.stdout
    garbled = show(backend, str(broken), "--body")
    assert "body: the payload is not a valid email" in garbled.stdout
