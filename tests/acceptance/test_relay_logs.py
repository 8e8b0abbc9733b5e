"""A real ``outbox-relay run`` process's stderr, line by line, as a log shipper reads it: in
``--log-format text`` every line is strict logfmt (:mod:`tests.support.logfmt`), in ``json``
every line is one JSON object; both with a UTC ``ts`` ending in ``Z``, whatever the sender's
errors and tracebacks hold."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session

import relay
from outbox import Email, Outbox
from tests.support.logfmt import parse
from tests.support.relays import RELAY, clean_env

PROJECT = str(Path(relay.__file__).resolve().parents[1])  # the relay this test imports
RAISED = 'the provider\'s SDK broke:\nsecond "line" = here \\ end'

SENDER = textwrap.dedent(
    f'''
    """A sender whose answers put spaces, quotes, "=" and newlines into the relay's logs."""
    from pathlib import Path

    from relay.senders import Accepted, Transient

    class OddSender:
        name = "odd"

        def __init__(self, marker):
            self.marker = marker

        def send(self, message):
            subject = message.email.subject
            if subject == "raise":
                raise RuntimeError({RAISED!r})
            if subject == "transient" and not self.marker.exists():
                self.marker.touch()
                return Transient(code="Throttled now", message="slow\\ndown")
            return Accepted(provider_message_id=f"odd-{{message.id}}")

    def factory():
        return OddSender(Path(__file__).with_name("transient.done"))
    '''
)


def enqueue(engine: Any, subjects: list[str]) -> list[int]:
    with Session(engine) as session:
        ids = [
            Outbox()
            .enqueue(
                session,
                Email(sender="shop@example.com", to=["c@example.com"], subject=s, text="t"),
                key=f"logs:{n}",
            )
            .id
            for n, s in enumerate(subjects)
        ]
        session.commit()
    return ids


def run_relay(url: str, workdir: Path, fmt: str) -> subprocess.CompletedProcess[str]:
    (workdir / "oddsender.py").write_text(SENDER)
    return subprocess.run(
        [
            RELAY,
            "run",
            "--database-url",
            url,
            "--sender",
            "oddsender:factory",
            "--relay-id",
            "logs test=1",
            "--log-format",
            fmt,
            "--log-level",
            "DEBUG",
            "--exit-when-idle",
            "--poll-interval",
            "0.1",
        ],
        env=clean_env(PYTHONPATH=os.pathsep.join([str(workdir), PROJECT])),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def read_line(fmt: str, line: str) -> dict[str, Any]:
    """One stderr line as the shipper reads it; fails on anything that is not one record."""
    if fmt == "text":
        return dict(parse(line))
    doc = json.loads(line)
    assert isinstance(doc, dict), line
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in doc.items()}


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_every_stderr_line_of_a_relay_is_one_record(backend, tmp_path, fmt):
    ids = enqueue(backend.engine, ["raise", "transient", "a subject with spaces"])
    launched = datetime.now(UTC) - timedelta(seconds=1)
    done = run_relay(backend.url, tmp_path, fmt)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout == ""

    records = [read_line(fmt, line) for line in done.stderr.splitlines()]
    assert records, "the relay logged nothing"
    for record in records:
        assert list(record)[:3] == ["ts", "level", "logger"]
        assert "msg" in record
        assert record["logger"].startswith("relay")
        assert record["ts"].endswith("Z")
        ts = datetime.fromisoformat(record["ts"])
        assert ts.utcoffset() == timedelta(0)
        assert launched <= ts <= datetime.now(UTC)
    by_action: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_action.setdefault(record.get("action", ""), []).append(record)

    (started,) = by_action["started"]
    assert started["relay_id"] == "logs test=1"
    (raised,) = by_action["sender_error"]
    assert raised["message_id"] == str(ids[0])
    assert raised["exc"].startswith("Traceback (most recent call last):\n")
    assert raised["exc"].endswith(f"RuntimeError: {RAISED}")
    (retry,) = by_action["retry_scheduled"]
    assert (retry["message_id"], retry["code"]) == (str(ids[1]), "Throttled now")
    assert str(ids[2]) in {r["message_id"] for r in by_action["sent"]}
    assert "stopped" in by_action
