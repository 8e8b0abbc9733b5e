"""Fakes for tests: a scriptable sender that counts every call, even across processes.

Used by this project's own tests and meant for host apps' tests too::

    sender = FakeSender()                       # accepts everything
    sender = FakeSender(outcomes=[Transient(code="Throttling"), Accepted(...)])
    sender = FakeSender(latency=0.05, record_file=tmp_path / "sent.log")

``outbox-relay run --sender relay.testing:sender_from_env`` builds one from ``OUTBOX_FAKE_*``
variables, so relay *processes* can be tested the same way; :func:`read_deliveries` counts what
they all sent.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from relay.senders import Accepted, Outcome, OutgoingMessage

__all__ = ["FakeSender", "read_deliveries", "run_until_idle", "sender_from_env"]

Script = Callable[[OutgoingMessage], Outcome]


class FakeSender:
    """A sender that records each call and answers from a script.

    ``outcomes`` is either a callable ``(message) -> Outcome`` or a sequence consumed one per
    call (then ``Accepted`` once it runs out). ``latency`` seconds are slept per send. With
    ``record_file``, each call appends ``id<TAB>key<TAB>pid`` to it (one ``write`` of one line
    under ``O_APPEND``, so concurrent processes never interleave).
    """

    name = "fake"

    def __init__(
        self,
        outcomes: Script | Iterable[Outcome] | None = None,
        *,
        latency: float = 0.0,
        record_file: str | os.PathLike[str] | None = None,
    ) -> None:
        self._script: Script | None = outcomes if callable(outcomes) else None
        self._queue = collections.deque(() if outcomes is None or callable(outcomes) else outcomes)
        self.latency = latency
        self.record_file = Path(record_file) if record_file is not None else None
        self.calls: list[OutgoingMessage] = []
        self._lock = threading.Lock()

    def send(self, message: OutgoingMessage) -> Outcome:
        if self.latency:
            time.sleep(self.latency)
        with self._lock:
            self.calls.append(message)
            if self.record_file is not None:
                line = f"{message.id}\t{message.key}\t{os.getpid()}\n".encode()
                fd = os.open(self.record_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)
            script = self._script
            if script is None and self._queue:
                return self._queue.popleft()
        if script is not None:  # outside the lock: a script that blocks holds up only its send
            return script(message)
        return Accepted(provider_message_id=f"fake-{message.id}-{message.attempt}")

    @property
    def sent_ids(self) -> list[int]:
        with self._lock:
            return [m.id for m in self.calls]


def sender_from_env() -> FakeSender:
    """A FakeSender configured by ``OUTBOX_FAKE_RECORD_FILE`` and ``OUTBOX_FAKE_LATENCY``."""
    return FakeSender(
        latency=float(os.environ.get("OUTBOX_FAKE_LATENCY", "0")),
        record_file=os.environ.get("OUTBOX_FAKE_RECORD_FILE") or None,
    )


def read_deliveries(record_file: str | os.PathLike[str]) -> collections.Counter[int]:
    """How many times each message id was sent, from a FakeSender's ``record_file``."""
    path = Path(record_file)
    if not path.exists():
        return collections.Counter()
    return collections.Counter(
        int(line.split("\t", 1)[0]) for line in path.read_text().splitlines() if line
    )


def run_until_idle(
    engine: sa.Engine, sender: FakeSender | None = None, **settings: Any
) -> FakeSender:
    """Run a relay in this process until nothing is due and nothing is in flight, and return
    its sender (a new accepting :class:`FakeSender` unless one is given), so a test can assert
    ``sender.sent_ids`` or ``sender.calls``. ``settings`` are :class:`~relay.config.RelayConfig`
    fields (``batch_size=``, ``concurrency=``, ...). ``engine`` is a sync engine; for an app on
    ``AsyncEngine``, pass ``async_engine.sync_engine``'s URL with a sync driver instead."""
    from relay.config import RelayConfig
    from relay.worker import Relay

    if not isinstance(engine, sa.Engine):
        raise TypeError(
            f"run_until_idle needs a sync sqlalchemy Engine, not {type(engine).__name__}; "
            "for an async app, create_engine() the same database with a sync driver"
        )
    sender = FakeSender() if sender is None else sender
    settings.setdefault("poll_interval", 0.05)
    settings.setdefault("relay_id", f"run-until-idle-{os.getpid()}")
    config = RelayConfig(
        database_url=engine.url.render_as_string(hide_password=False),
        exit_when_idle=True,
        **settings,
    )
    Relay(engine=engine, sender=sender, config=config).run()
    return sender
