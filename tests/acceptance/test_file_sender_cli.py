"""`outbox-relay run --sender file` as a developer runs it: each message lands in the folder as
one `.eml` file, the start says nothing is delivered, and bad flags stop it in one line."""

from __future__ import annotations

import subprocess

import pytest
import sqlalchemy as sa

from outbox.sqlite import enable_savepoints
from tests.support.eml import RICH, assert_reads_back_as
from tests.support.factories import enqueue
from tests.support.relays import RELAY, clean_env, message_rows


def relay(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [RELAY, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(**env),
        stdin=subprocess.DEVNULL,
        check=False,
    )


def refusal(done: subprocess.CompletedProcess[str]) -> str:
    """The one ``Error:`` line of a refused start, exit 2, nothing else."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, done.stderr
    return errors[0]


@pytest.fixture
def db_url(tmp_path):
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    assert relay("migrate", "--database-url", url).returncode == 0
    return url


def test_run_writes_each_message_as_an_eml_file_and_says_nothing_is_delivered(db_url, tmp_path):
    engine = sa.create_engine(db_url)
    enable_savepoints(engine)
    try:
        (mid,) = enqueue(engine, [RICH], prefix="dev")
        mail_dir = tmp_path / "mail"
        run = ("run", "--database-url", db_url, "--sender", "file", "--exit-when-idle")
        done = relay(*run, OUTBOX_MAIL_DIR=str(mail_dir))
        assert done.returncode == 0, done.stderr
        assert f"mail_dir={mail_dir}" in done.stderr  # the start line says where
        assert "action=file_sender" in done.stderr
        assert "the file sender delivers nothing" in done.stderr
        (written,) = mail_dir.iterdir()
        assert written.name.endswith(f"-{mid}-1.eml")
        assert_reads_back_as(written.read_bytes(), RICH)
        row = message_rows(engine)[mid]
        assert (row.status, row.provider_message_id) == ("sent", f"file-{written.name}")

        shown = relay("show", str(mid), "--body", "--database-url", db_url)
        assert shown.returncode == 0, shown.stderr
        assert shown.stderr == f"Note: showing the body of message {mid} (personal data)\n"
        assert "Merci !" in shown.stdout
        hidden = relay("show", str(mid), "--database-url", db_url)
        assert "Merci" not in hidden.stdout
        assert hidden.stderr == ""
    finally:
        engine.dispose()


def test_the_file_sender_without_a_mail_dir_is_refused_naming_it(tmp_path):
    db = tmp_path / "never-created.db"
    line = refusal(relay("run", "--database-url", f"sqlite:///{db}", "--sender", "file"))
    assert line.startswith("Error: --mail-dir: is required with --sender file")
    assert not db.exists()  # refused before the database is touched


def test_a_mail_dir_that_cannot_be_created_is_refused_naming_it(tmp_path):
    (tmp_path / "a-file").write_text("")
    db = tmp_path / "never-created.db"
    run = ("run", "--database-url", f"sqlite:///{db}", "--sender", "file")
    line = refusal(relay(*run, "--mail-dir", str(tmp_path / "a-file" / "mail")))
    assert line.startswith("Error: --mail-dir: ")
    assert "cannot be created or written to" in line
    assert not db.exists()
