"""Dispatch: send threads, their deadlines, hung calls. It never opens a transaction."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

from relay import tracing
from relay.config import RelayConfig
from relay.loop.records import InFlight, Ready
from relay.ratelimit import SendBudget, Slot
from relay.senders import Ambiguous, Disabled, Outcome, OutgoingMessage, Sender

__all__ = ["Dispatch"]

_log = logging.getLogger("relay")


class Dispatch:
    """The sends in flight, each on a thread of its own pool."""

    def __init__(
        self,
        sender: Callable[[], Sender],
        config: RelayConfig,
        limiter: SendBudget,
        wake: threading.Event,
    ) -> None:
        self._sender = sender  # read at each send: the relay's sender may be replaced
        self.config = config
        self.limiter = limiter
        self._wake = wake
        # twice the concurrency: a call hung past --send-timeout keeps its thread, but not its
        # slot; once as many are hung as there are slots, the relay pauses (sender_hung)
        self.pool = ThreadPoolExecutor(2 * config.concurrency, thread_name_prefix="outbox-send")
        # keyed by (id, claim token): a swept and reclaimed row can be in flight twice
        self.in_flight: dict[tuple[int, str], InFlight] = {}

    def sending(self) -> int:
        """Sends in flight within their deadline (a hung call past it holds no slot)."""
        return sum(1 for flight in self.in_flight.values() if not flight.overdue)

    def hung(self) -> int:
        return len(self.in_flight) - self.sending()

    def start(
        self,
        wave: list[tuple[Ready, Slot | None]],
        marked: dict[tuple[int, str], datetime],
        now: datetime,
    ) -> list[Ready]:
        """Hand each marked message of the wave to a send thread; returns those not started
        (no mark applied: the lease was lost). After a failed pass the same id can be queued
        under two claims; only the one whose mark applied is sent, its attempt starting at
        its ``send_started_at``."""
        lost: list[Ready] = []
        traced = bool(wave) and tracing.recording()  # asked once a wave, not once a send
        for ready, slot in wave:
            claim = ready.claim
            started_at = marked.get((claim.id, claim.claim_token))
            if started_at is None:
                _log.warning(
                    "lease lost before the send started; not sending",
                    extra={"action": "lease_lost", "message_id": claim.id},
                )
                lost.append(ready)
                continue
            message = OutgoingMessage(
                id=claim.id,
                key=claim.key,
                category=claim.category,
                attempt=claim.attempt_count + 1,
                email=ready.email,
                claim_token=claim.claim_token,
            )
            started = time.monotonic()
            lease_ends = started + (claim.lease_expires_at - now).total_seconds()
            span = tracing.Attempt(message, ready.trace) if traced else None
            send = self._send if span is None else span.run(self._send)
            future = self.pool.submit(send, message, slot, lease_ends)
            self.in_flight[(claim.id, claim.claim_token)] = InFlight(
                claim=claim,
                started_at=started_at,
                future=future,
                deadline=started + self.config.send_timeout,
                probe=ready.probe,
                dropped=ready.dropped,
                trace=span,
            )
            future.add_done_callback(lambda _f: self._wake.set())
        return lost

    def _send(
        self, message: OutgoingMessage, slot: Slot | None, deadline: float
    ) -> tuple[Outcome, float]:
        """Runs on a send thread; returns the outcome and the call's seconds. A sender that
        raises is ambiguous (the request may have left before the error). A thread that
        starts after the lease ran out (the process was frozen) does not send: another relay
        may have swept the row already."""
        if slot is not None and (late := self.limiter.wait(slot)) is not None:
            # later than its booking allows: sending now could crowd a second of the budget
            _log.warning(
                "send started %.3fs after its booked time; given back unsent",
                late,
                extra={"action": "send_slot_missed", "message_id": message.id},
            )
            return Disabled(
                code="send_slot_missed",
                message=f"the send thread started {late:.3f}s after its booked time",
            ), 0.0
        began = time.monotonic()
        if began >= deadline:
            return Disabled(code="lease_lost", message="lease expired before the send"), 0.0
        try:
            outcome: Outcome = self._sender().send(message)
        except Exception as exc:
            _log.exception(
                "sender raised", extra={"action": "sender_error", "message_id": message.id}
            )
            outcome = Ambiguous(code="sender_exception", message=f"{type(exc).__name__}: {exc}")
        return outcome, time.monotonic() - began

    def finished(self) -> Iterator[tuple[InFlight, Outcome, float]]:
        """The sends that finished, with their outcome and the call's seconds, each taken out
        of flight only as it is handed over: if handling one raises (a pause's give-back
        meets a dropped connection), the rest stay in flight for the next pass."""
        for key, flight in list(self.in_flight.items()):
            if flight.future.done():
                del self.in_flight[key]
                outcome, duration = flight.future.result()
                yield flight, outcome, duration

    def shutdown(self, *, cancel: bool = True) -> None:
        self.pool.shutdown(wait=False, cancel_futures=cancel)
