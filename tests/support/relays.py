"""Running ``outbox-relay`` as real processes, and reading what they did from the database.

:class:`Relays` starts relays that send through ``relay.testing:sender_from_env``
(``FAKE_SENDER``), which appends one ``id<TAB>key<TAB>pid`` line per send to a record file
shared by all processes (:func:`read_records`); :class:`SesRelays` starts relays that send
through SES (the fault server of :mod:`tests.support.ses`); :func:`spawn` starts one with any
sender.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from outbox.schema import messages, relays
from tests.support.ses import aws_env

__all__ = [
    "FAKE_SENDER",
    "RELAY",
    "Record",
    "RelayProc",
    "Relays",
    "SesRelays",
    "clean_env",
    "in_flight_ids",
    "kill_all",
    "message_rows",
    "read_records",
    "relay_rows",
    "sleep_until",
    "spawn",
    "statuses",
]

RELAY = str(Path(sys.executable).with_name("outbox-relay"))
FAKE_SENDER = "relay.testing:sender_from_env"


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any ``OUTBOX_*`` variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(extra)
    return env


@dataclass(frozen=True, kw_only=True)
class Record:
    """One send as the fake sender recorded it: the outbox id and key, and the relay's pid."""

    message_id: int
    key: str
    pid: int


def read_records(path: Path) -> list[Record]:
    """Every complete line of the record file (a line still being written is left out)."""
    if not path.exists():
        return []
    *lines, _partial = path.read_text().split("\n")
    out = []
    for line in lines:
        id_, key, pid = line.split("\t")
        out.append(Record(message_id=int(id_), key=key, pid=int(pid)))
    return out


@dataclass
class RelayProc:
    """A running (or finished) ``outbox-relay run`` process, its relay id and its log file."""

    popen: subprocess.Popen[bytes]
    relay_id: str
    log: Path

    @property
    def pid(self) -> int:
        """The process id."""
        return self.popen.pid

    def output(self) -> str:
        """Everything the process wrote so far (stdout and stderr)."""
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        """The exit code; fail with the end of the log if it still runs after ``timeout``."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        # every thread's stack, so the failure says what it waits on (relay.cli's SIGUSR1)
        self.popen.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        raise AssertionError(
            f"relay {self.relay_id} still running after {timeout}s; its log:\n"
            + self.output()[-12000:]
        )


def spawn(
    url: str, sender: str, relay_id: str, log: Path, env: dict[str, str], *args: str
) -> RelayProc:
    """Start ``outbox-relay run`` with its output in ``log``."""
    with log.open("wb") as out:
        popen = subprocess.Popen(
            [
                RELAY,
                "run",
                "--database-url",
                url,
                "--sender",
                sender,
                "--relay-id",
                relay_id,
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    return RelayProc(popen, relay_id, log)


@dataclass
class Relays:
    """Starts relay processes and kills whatever is still running when the test ends."""

    url: str
    workdir: Path
    record: Path
    started: list[RelayProc] = field(default_factory=list)

    def start(self, *args: str, latency: float = 0.0, name: str | None = None) -> RelayProc:
        """Start a relay with the fake sender (``latency`` seconds per send) and ``args``."""
        relay_id = name or f"acceptance-{len(self.started) + 1}"
        log = self.workdir / f"{relay_id}.log"
        env = clean_env(
            OUTBOX_FAKE_RECORD_FILE=str(self.record),
            OUTBOX_FAKE_LATENCY=str(latency),
        )
        proc = spawn(self.url, FAKE_SENDER, relay_id, log, env, *args)
        self.started.append(proc)
        return proc

    def deliveries(self) -> Counter[int]:
        """How many times each outbox id was sent, by every relay started here."""
        return Counter(r.message_id for r in read_records(self.record))

    def kill_all(self) -> None:
        """SIGKILL every relay still running."""
        kill_all(self.started)


@dataclass
class SesRelays:
    """Starts ``outbox-relay run --sender ses`` processes (ids ``{name}-1``, ``{name}-2``, ...)
    pointed at ``endpoint``, the SES fault server, with no AWS variable of the test's own."""

    url: str
    endpoint: str
    workdir: Path
    name: str = "ses"
    started: list[RelayProc] = field(default_factory=list)

    def start(self, *args: str) -> RelayProc:
        """Start a relay with ``args``."""
        relay_id = f"{self.name}-{len(self.started) + 1}"
        log = self.workdir / f"{relay_id}.log"
        env = {k: v for k, v in clean_env().items() if not k.startswith("AWS_")}
        env.update(aws_env(self.endpoint))
        proc = spawn(self.url, "ses", relay_id, log, env, *args)
        self.started.append(proc)
        return proc

    def stop_all(self, timeout: float = 30) -> None:
        """SIGTERM every relay still running; each must drain and exit 0."""
        running = [p for p in self.started if p.popen.poll() is None]
        for proc in running:
            proc.popen.send_signal(signal.SIGTERM)
        for proc in running:
            assert proc.wait(timeout) == 0, proc.output()[-4000:]

    def kill_all(self) -> None:
        """SIGKILL every relay still running."""
        kill_all(self.started)


def kill_all(procs: Iterable[RelayProc]) -> None:
    """SIGKILL every process of ``procs`` still running, and reap it."""
    for proc in procs:
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGKILL)
            proc.popen.wait(10)


def message_rows(engine: sa.Engine) -> dict[int, sa.Row[Any]]:
    """{id: row} of every message."""
    with engine.connect() as conn:
        return {row.id: row for row in conn.execute(sa.select(messages).order_by(messages.c.id))}


def relay_rows(engine: sa.Engine) -> dict[str, sa.Row[Any]]:
    """{relay id: row} of every registered relay."""
    with engine.connect() as conn:
        return {row.relay_id: row for row in conn.execute(sa.select(relays))}


def statuses(engine: sa.Engine) -> Counter[str]:
    """How many messages are in each status (not :func:`tests.support.db.statuses`, which
    gives each message's)."""
    with engine.connect() as conn:
        return Counter(
            {
                status: n
                for status, n in conn.execute(
                    sa.select(messages.c.status, sa.func.count()).group_by(messages.c.status)
                )
            }
        )


def in_flight_ids(engine: sa.Engine) -> set[int]:
    """Rows claimed with their send started and not yet finalized."""
    with engine.connect() as conn:
        return set(
            conn.execute(
                sa.select(messages.c.id).where(
                    messages.c.status == "processing", messages.c.send_started_at.is_not(None)
                )
            ).scalars()
        )


def sleep_until(moment: datetime) -> None:
    """Sleep until the wall clock reaches ``moment`` (at once if it has)."""
    delay = (moment - datetime.now(UTC)).total_seconds()
    if delay > 0:
        time.sleep(delay)
