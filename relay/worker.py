"""The relay loop: save finished sends, claim and mark what can be sent now, send on threads.

The loop only orders its services (:mod:`relay.loop`): the producer's one-transaction pass,
dispatch, the completer, leases, the registry and maintenance. It never holds a database
transaction while a send is in flight, and it always saves before it sweeps (docs/design.md,
Decisions: "One transaction per busy pass").

Time: everything compared across relays (leases, the sweep's cut-off, heartbeats) is on the
database's clock; intervals inside the process are on the monotonic clock.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Generic, TypeVar, overload

import sqlalchemy as sa
import tenacity

from outbox.schema import RelayState
from relay.clock import DatabaseClock
from relay.config import RelayConfig
from relay.loop.admission import total_rate
from relay.loop.completer import Completer
from relay.loop.connection import LoopConnection
from relay.loop.dispatch import Dispatch
from relay.loop.leases import Leases
from relay.loop.maintenance import Maintenance
from relay.loop.pausing import PauseControl
from relay.loop.producer import Producer
from relay.loop.registry import Registry
from relay.pause import ACCOUNT, Pauses
from relay.ratelimit import RateController, SendBudget
from relay.senders import Sender, as_sender

__all__ = ["STUCK_RETRY", "Relay"]

_log = logging.getLogger("relay")

_T = TypeVar("_T")

STUCK_RETRY = 30.0  # seconds between tries to save a finished send that could not be saved


class _Stopped(Exception):
    """Raised out of the start-up wait's sleep when the relay is told to stop."""


class _Shared(Generic[_T]):
    """A setting or state of the relay its services hold too: replacing it on the relay
    replaces it in every service with an attribute of that name, as when the loop read it
    from the relay at each use."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, relay: None, owner: type) -> _Shared[_T]: ...
    @overload
    def __get__(self, relay: Relay, owner: type) -> _T: ...
    def __get__(self, relay: Relay | None, owner: type) -> _Shared[_T] | _T:
        if relay is None:
            return self
        value: _T = relay.__dict__[self._name]
        return value

    def __set__(self, relay: Relay, value: _T) -> None:
        relay.__dict__[self._name] = value
        for service in relay.__dict__.get("_services", ()):
            if hasattr(service, self._name):
                setattr(service, self._name, value)


_SLOT_LOOK = 0.05  # seconds between looks for a send slot another relay may have freed


class Relay:
    """One relay process's loop. ``run()`` returns when stopped (drained) or, with
    ``exit_when_idle``, when nothing is due and nothing is in flight."""

    config = _Shared[RelayConfig]()
    relay_id = _Shared[str]()
    rate = _Shared[RateController]()
    limiter = _Shared[SendBudget]()  # the send budget all relays share
    pauses = _Shared[Pauses]()

    def __init__(
        self,
        *,
        engine: sa.Engine,
        sender: Sender,
        config: RelayConfig,
        clock: Callable[[], datetime] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """``clock`` replaces the database's clock (tests that move time by hand); ``rng``,
        the random source of every jitter (retry backoff, polling, reconnecting), a seeded one
        for a replayable run."""
        self.sender = as_sender(sender)
        self.config = config
        self._db_clock = DatabaseClock() if clock is None else None
        self.clock: Callable[[], datetime] = clock if clock is not None else self._db_clock  # type: ignore[assignment]
        self._rng = rng if rng is not None else random.Random()
        self.relay_id = config.relay_id
        self.rate = RateController(total_rate(config.max_send_rate, self.sender))
        # the send budget all relays share; without --max-send-rate it is never touched
        self.limiter = SendBudget(self.rate, clock=lambda: self.clock())
        self.pauses = Pauses(config.pause_seconds)
        self.state = RelayState.RUNNING
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self.connection = LoopConnection(engine, config, self._db_clock, self._rng)
        self.registry = Registry(config, self.connection, lambda: self.clock(), self.pauses)
        self.dispatch = Dispatch(lambda: self.sender, config, self.limiter, self._wake)
        self.completer = Completer(
            self, config, self.connection, self._rng, stuck_retry=lambda: STUCK_RETRY
        )
        self.control = PauseControl(
            self.pauses,
            config,
            self.rate,
            on_account=self._account_paused,
            release=lambda scope: self.producer.release(scope),
        )
        self.producer = Producer(
            source=self,
            config=config,
            clock=lambda: self.clock(),
            connection=self.connection,
            completer=self.completer,
            dispatch=self.dispatch,
            pauses=self.pauses,
            control=self.control,
            limiter=self.limiter,
            stopping=self._stopping,
        )
        self.leases = Leases(
            config, self.connection, self.dispatch, self.completer, self.producer, self._hung
        )
        self.maintenance = Maintenance(self, config.relay_id, self.connection, self._rng)
        services = (self.connection, self.registry, self.dispatch, self.completer, self.control)
        others = (self.leases, self.producer, *self.producer.filters, *self.maintenance.services)
        self._services = (*services, *others)
        self.loop_at: float | None = None  # monotonic time of the loop's last pass, in run()
        # monotonic time of the last try to reach the database before the loop's first pass
        self.waiting_at: float | None = None

    # -- control ---------------------------------------------------------------------------

    @property
    def engine(self) -> sa.Engine:
        """The database the loop's connection opens on (its next connection, if replaced)."""
        return self.connection.engine

    @engine.setter
    def engine(self, engine: sa.Engine) -> None:
        self.connection.engine = engine

    def request_stop(self) -> None:
        """Begin draining: claim nothing more, finish what is in flight. Thread/signal-safe."""
        self._stopping.set()
        self._wake.set()

    def wake(self) -> None:
        """Look for due messages now (called on a PostgreSQL NOTIFY)."""
        self._wake.set()

    @property
    def in_flight(self) -> int:
        return len(self.dispatch.in_flight)

    @property
    def paused(self) -> bool:
        """True while all sending is paused (account paused, bad credentials, daily quota);
        a paused configuration set or identity holds only its own messages."""
        return self.pauses.account_paused

    @property
    def pause_code(self) -> str | None:
        """The provider's code while all sending is paused."""
        return self.pauses.code(ACCOUNT)

    @property
    def set_aside(self) -> int:
        """Finished sends that could not be saved as they were."""
        return self.completer.set_aside

    @set_aside.setter
    def set_aside(self, count: int) -> None:
        self.completer.set_aside = count

    def run(self) -> None:
        """Run until stopped or, with ``exit_when_idle``, until there is nothing left to do.

        Raises :class:`~outbox.exceptions.ConfigurationError` before sending anything if the
        database has no outbox tables."""
        try:
            if not self._wait_for_the_database():
                return
        finally:  # once the loop runs, or never will (no outbox tables, the relay id in use)
            self.waiting_at = None
        try:
            while not self._stopping.is_set():
                self.loop_at = time.monotonic()
                busy = self.connection.guard(self.step)
                if busy is None:  # database error: back off, then try again
                    self._stopping.wait(self.connection.backoff())
                    continue
                if not busy and self.config.exit_when_idle and self._idle():
                    _log.info("idle, exiting", extra={"action": "idle_exit"})
                    break
                if not busy:
                    self._wait()
            self._drain()
        finally:
            self.dispatch.shutdown()
            self.connection.guard(self.registry.deregister)
            self.connection.drop()
            self.loop_at = None

    def _wait_for_the_database(self) -> bool:
        """Wait for the schema, then register; False if stopped before the database answered.
        Each try is a sign of life for ``/healthz`` (``waiting_at``): a relay started during
        an outage must not be restarted by its liveness probe for it."""
        waiting = tenacity.Retrying(
            retry=tenacity.retry_if_result(lambda checked: checked is None),
            wait=lambda _: self.connection.backoff(),
            sleep=self._sleep_unless_stopped,
            before=lambda _: setattr(self, "waiting_at", time.monotonic()),
        )
        try:
            waiting(self.connection.guard, self.registry.check_schema)
        except _Stopped:
            self.dispatch.shutdown(cancel=False)
            self.connection.drop()
            _log.info("stopped before the database answered", extra={"action": "stopped"})
            return False
        self.connection.guard(lambda: self.registry.register(self.sender, self.engine, self.state))
        return True

    def _sleep_unless_stopped(self, seconds: float) -> None:
        """The start-up wait's sleep: a stop ends it at once, and no try follows it."""
        if self._stopping.wait(seconds):
            raise _Stopped

    # -- one tick --------------------------------------------------------------------------

    def step(self) -> bool:
        """One pass of the loop; True if it did any work (so the next pass follows at once).

        Finished sends are saved (and leases renewed) before any sweep, so after a database
        outage longer than the lease a relay settles its own sends instead of sweeping them."""
        if self._db_clock is not None and self._db_clock.stale():
            with self.connection.transaction() as conn:
                self._db_clock.sample(conn)
        now = self.clock()
        self.rate.tick()
        self.completer.collect(self.dispatch.finished(), now, self.control.react)
        self.leases.extend(now)
        self.completer.retry_stuck(now)
        busy = self.producer.exchange(now)
        self._heartbeat(now)
        busy = self.maintenance.tick(now) or busy
        return busy

    def _heartbeat(self, now: datetime) -> None:
        taken = self.registry.heartbeat(now, self.state)
        if taken is None:
            return
        _log.error(
            "relay id %r taken over by a relay on host %s (pid %s); stopping",
            self.relay_id,
            taken.host,
            taken.pid,
            extra={"action": "relay_id_taken", "relay_id": self.relay_id},
        )
        self.request_stop()

    def _account_paused(self, paused: bool) -> None:
        self.state = RelayState.PAUSED if paused else RelayState.RUNNING
        self.registry.beat_soon()  # show the pause or the resumption in outbox_relays at once

    def _hung(self) -> None:
        if not self.pauses.account_paused:
            self.control.pause(ACCOUNT, "sender_hung")

    def finalize(self) -> bool:
        """Save finished sends now, claiming nothing (drain, tests)."""
        now = self.clock()
        self.completer.collect(self.dispatch.finished(), now, self.control.react)
        return self.completer.finalize(now)

    # -- drain, waiting --------------------------------------------------------------------

    def _drain(self) -> None:
        """Stop claiming, give back unstarted claims, let sends in flight finish and finalize
        them within ``drain_seconds``."""
        self.state = RelayState.DRAINING
        deadline = time.monotonic() + self.config.drain_seconds
        in_flight = self.dispatch.in_flight
        _log.info("draining", extra={"action": "draining", "in_flight": len(in_flight)})
        self.connection.guard(self.producer.release)
        while in_flight or self.completer.unsaved:
            self.loop_at = time.monotonic()
            if time.monotonic() >= deadline:
                _log.error(
                    "drain deadline passed with sends in flight; their leases will expire",
                    extra={"action": "drain_timeout", "in_flight": len(in_flight)},
                )
                return
            if self.connection.guard(self._drain_step) is None:
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                continue
            if in_flight:
                self._wake.wait(0.05)
                self._wake.clear()
        _log.info("drained", extra={"action": "drained"})

    def _drain_step(self) -> None:
        self.finalize()
        self.leases.extend(self.clock())

    def _idle(self) -> bool:
        """Nothing held, and the last claim was not cut short by the rate limit."""
        completer = self.completer
        busy = bool(
            self.dispatch.in_flight or self.producer.ready or completer.unsaved or completer.stuck
        )
        # paused: idle once a probe found nothing due (a paused scope's held messages are
        # not due; they wait for a later run)
        busy = busy or (self.pauses.account_paused and not self.producer.probe_found_nothing)
        # a message its key's or identity's limit sent back in line is due again shortly: idle
        # only once a claim made at or after that time found nothing more to send back
        deferred, looked = self.producer.deferred_until, self.producer.claimed_at
        busy = busy or (deferred is not None and (looked is None or looked < deferred))
        return not busy and self.limiter.available() >= 1

    def _wait(self) -> None:
        if self.producer.ready or self.limiter.available() < 1:  # waiting for the rate limit
            # or for a send slot of a key at its most in flight: a send ending here wakes the
            # loop; one ending on another relay is seen at the next look
            wait = self.limiter.seconds_until_available()
            slot_only = wait <= 0 and self.producer.budget.kept
            timeout = _SLOT_LOOK if slot_only else max(0.005, wait)
        elif (probe_in := self.pauses.next_probe_in()) is not None and probe_in > 0:
            timeout = max(0.005, min(self.config.poll_interval, probe_in))
        else:
            timeout = self.config.poll_interval * self._rng.uniform(0.8, 1.2)
        self._wake.wait(timeout)
        self._wake.clear()
