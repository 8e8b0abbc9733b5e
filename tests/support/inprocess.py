"""A relay run inside the test process, with a FakeSender or a sender the test holds open.

``relay_for`` builds one on a test backend with quick settings (its clock may be a
:class:`tests.support.hand_clocks.Clock`); ``settle`` steps it by hand, ``closing`` ends a
hand-stepped relay's connection and threads, and ``running`` runs it on a thread.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from outbox import AmbiguityPolicy, Category, Outbox
from relay.config import RelayConfig
from relay.senders import Accepted, OutgoingMessage
from relay.worker import Relay
from tests.support.db import Backend

__all__ = [
    "OUTBOX",
    "HeldSender",
    "Run",
    "closing",
    "maintain",
    "receiving",
    "relay_for",
    "running",
    "settle",
]

OUTBOX = Outbox(
    categories=[Category(name="digest", ambiguity=AmbiguityPolicy.RESEND, max_attempts=3)]
)
"""The app's outbox: the default category, and ``digest``, which resends an unknown outcome
(three attempts at most)."""


def relay_for(
    backend: Backend | None,
    sender: Any,
    clock: Callable[[], datetime] | None = None,
    *,
    engine: sa.Engine | None = None,
    url: str | None = None,
    relay_id: str = "test-relay",
    **settings: Any,
) -> Relay:
    """A relay on ``backend`` (or on ``engine`` and ``url``) sending through ``sender``: polls
    every 0.05 s, 1 s send timeout, 5 s lease and drain, unless ``settings`` say otherwise."""
    database_url = url if url is not None else backend.url if backend is not None else None
    relay_engine = engine if engine is not None else backend.engine if backend is not None else None
    if database_url is None or relay_engine is None:
        raise TypeError("relay_for needs a backend, or an engine and its url")
    config = RelayConfig(
        database_url=database_url,
        relay_id=relay_id,
        **{
            "poll_interval": 0.05,
            "send_timeout": 1.0,
            "lease_seconds": 5.0,
            "drain_seconds": 5.0,
            **settings,
        },
    )
    return Relay(engine=relay_engine, sender=sender, config=config, clock=clock)


def settle(relay: Relay, steps: int = 200) -> None:
    """Step until nothing is in flight and a step finds no work."""
    for _ in range(steps):
        busy = relay.step()
        if not busy and relay.in_flight == 0:
            return
        time.sleep(0.005)
    raise AssertionError("relay did not settle")


class Run:
    """``relay.run()`` on a daemon thread, with what it raised."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.relay.run()
        except BaseException as exc:  # reported by the test, not by the thread
            self.errors.append(exc)

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for run() to return."""
        self.thread.join(timeout)

    def is_alive(self) -> bool:
        """True while run() has not returned."""
        return self.thread.is_alive()

    def returned_within(self, seconds: float) -> bool:
        """True if run() returned (or raised) within ``seconds``."""
        self.thread.join(seconds)
        return not self.thread.is_alive()


@contextlib.contextmanager
def running(relay: Relay, *senders: HeldSender) -> Iterator[Run]:
    """The relay running on a thread; stopped, and every held call let go, when the block ends
    (so a regression fails the test instead of hanging it). What run() raised fails the test."""
    run = Run(relay)
    try:
        yield run
    finally:
        relay.request_stop()
        for sender in senders:
            sender.release_all()
        run.thread.join(15)
    if run.errors:
        raise AssertionError(f"relay.run() raised {run.errors!r}")


def maintain(relay: Relay) -> None:
    """Run the relay's sweep, then its reconcile, now (whatever their intervals), each in its
    own transaction and announced after it commits, as the loop runs them."""
    maintenance = relay.maintenance
    with relay.connection.transaction() as conn:  # a new connection samples the clock
        now = relay.clock()
        swept = maintenance.sweep.run_once(conn, now)
    maintenance.sweep.announce(swept)
    with relay.connection.transaction() as conn:
        changed = maintenance.reconcile.run_once(conn, now)
    maintenance.reconcile.announce(changed)


@contextlib.contextmanager
def closing(relay: Relay) -> Iterator[Relay]:
    """A relay stepped by hand: its loop connection and send threads end with the block."""
    try:
        yield relay
    finally:
        relay.connection.drop()
        relay.dispatch.pool.shutdown(wait=False)


@contextlib.contextmanager
def receiving(signal: Any, relay: Relay | None = None) -> Iterator[list[dict[str, Any]]]:
    """What ``signal`` carried during the block: from any sender, or from ``relay`` only."""
    seen: list[dict[str, Any]] = []

    def receiver(_sender: Any, **kw: Any) -> None:
        seen.append(kw)

    if relay is None:
        signal.connect(receiver, weak=False)
    else:
        signal.connect(receiver, sender=relay, weak=False)
    try:
        yield seen
    finally:
        if relay is None:
            signal.disconnect(receiver)
        else:
            signal.disconnect(receiver, sender=relay)


class HeldSender:
    """A sender whose calls can be held open: ``hold(id)`` (or ``hold((id, attempt))``)
    returns an event the call waits on. ``outcomes`` are answered first, one per call, then
    ``answer`` (by default Accepted with provider id ``ses-<id>-<attempt>``). ``calls`` and
    ``returned`` list (id, attempt) as calls start and end."""

    name = "held"

    def __init__(
        self,
        answer: Callable[[OutgoingMessage], Any] | None = None,
        outcomes: Iterable[Any] = (),
    ) -> None:
        self.answer = answer or (lambda m: Accepted(provider_message_id=f"ses-{m.id}-{m.attempt}"))
        self.outcomes = collections.deque(outcomes)
        self.calls: list[tuple[int, int]] = []
        self.started: list[float] = []
        self.returned: list[tuple[int, int]] = []
        self.gates: dict[object, threading.Event] = {}
        self.lock = threading.Lock()

    def hold(self, *keys: object) -> threading.Event:
        """An event that calls for each of ``keys`` (an id, or an (id, attempt)) wait on."""
        gate = threading.Event()
        for key in keys:
            self.gates[key] = gate
        return gate

    def release_all(self) -> None:
        """Let every held call go."""
        for gate in self.gates.values():
            gate.set()

    def send(self, message: OutgoingMessage) -> Any:
        """Record the call, wait on its gate if held, then answer."""
        with self.lock:
            self.calls.append((message.id, message.attempt))
            self.started.append(time.monotonic())
            scripted = self.outcomes.popleft() if self.outcomes else None
        gate = self.gates.get((message.id, message.attempt)) or self.gates.get(message.id)
        if gate is not None:
            gate.wait(10)
        outcome = scripted if scripted is not None else self.answer(message)
        with self.lock:
            self.returned.append((message.id, message.attempt))
        return outcome

    def count(self, message_id: int) -> int:
        """How many calls ``message_id`` has had."""
        with self.lock:
            return [id_ for id_, _attempt in self.calls].count(message_id)

    def times(self, message_id: int) -> list[float]:
        """The monotonic times ``message_id``'s calls started."""
        with self.lock:
            return [
                at
                for (id_, _), at in zip(self.calls, self.started, strict=True)
                if id_ == message_id
            ]
