"""Helpers for running ``outbox-relay`` as real processes and inspecting what they did.

Every relay started here sends through ``relay.testing:sender_from_env``, which appends one
``id<TAB>key<TAB>pid`` line per send to a record file shared by all processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from outbox import Email, Outbox
from outbox.schema import attempts, messages, relays

RELAY = str(Path(sys.executable).with_name("outbox-relay"))
FAKE_SENDER = "relay.testing:sender_from_env"


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any ``OUTBOX_*`` variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(extra)
    return env


def email(n: int) -> Email:
    return Email(
        sender="Shop <shop@example.com>",
        to=[f"customer{n}@example.com"],
        subject=f"Order {n}",
        text=f"Thanks for order {n}.",
    )


def enqueue(engine: sa.Engine, count: int, *, per_transaction: int = 500) -> list[int]:
    """Enqueue ``count`` emails through ``Outbox.enqueue``, committed in a few transactions."""
    ob, Sessions, ids = Outbox(), sessionmaker(engine), []
    for start in range(0, count, per_transaction):
        with Sessions.begin() as session:
            for n in range(start, min(count, start + per_transaction)):
                result = ob.enqueue(session, email(n), key=f"acceptance:{n}")
                assert not result.duplicate
                ids.append(result.id)
    return ids


@dataclass(frozen=True)
class Record:
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
        out.append(Record(int(id_), key, int(pid)))
    return out


@dataclass
class RelayProc:
    popen: subprocess.Popen[bytes]
    relay_id: str
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"relay {self.relay_id} still running after {timeout}s; its log:\n"
                + self.output()[-4000:]
            ) from None


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
        return Counter(r.message_id for r in read_records(self.record))

    def kill_all(self) -> None:
        for proc in self.started:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGKILL)
                proc.popen.wait(10)


def wait_for(
    condition: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.02
) -> Any:
    """Poll ``condition`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def message_rows(engine: sa.Engine) -> dict[int, sa.Row[Any]]:
    with engine.connect() as conn:
        return {row.id: row for row in conn.execute(sa.select(messages).order_by(messages.c.id))}


def attempt_rows(engine: sa.Engine) -> list[sa.Row[Any]]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(attempts).order_by(attempts.c.id)))


def relay_rows(engine: sa.Engine) -> dict[str, sa.Row[Any]]:
    with engine.connect() as conn:
        return {row.relay_id: row for row in conn.execute(sa.select(relays))}


def statuses(engine: sa.Engine) -> Counter[str]:
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
    delay = (moment - datetime.now(UTC)).total_seconds()
    if delay > 0:
        time.sleep(delay)
