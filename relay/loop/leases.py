"""Leases: renew what this relay still needs; let a hung send's lease run out."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta

from relay import store
from relay.config import RelayConfig
from relay.loop.completer import Completer
from relay.loop.connection import LoopConnection
from relay.loop.dispatch import Dispatch
from relay.loop.producer import Producer
from relay.loop.records import by_token

__all__ = ["Leases"]

_log = logging.getLogger("relay")


class Leases:
    """Renews the leases of sends in flight within their deadline, finished sends not saved
    yet and claims waiting to start, once half their lease is gone. A send past
    ``--send-timeout`` is not renewed: its lease runs out and the sweep settles it as
    ambiguous; ``on_hung()`` is called once as many are hung as there are slots."""

    def __init__(
        self,
        config: RelayConfig,
        connection: LoopConnection,
        dispatch: Dispatch,
        completer: Completer,
        producer: Producer,
        on_hung: Callable[[], None],
    ) -> None:
        self.config = config
        self._connection = connection
        self._dispatch = dispatch
        self._completer = completer
        self._producer = producer
        self._on_hung = on_hung

    def extend(self, now: datetime) -> None:
        half = timedelta(seconds=self.config.lease_seconds / 2)
        mono = time.monotonic()
        dispatch, completer, producer = self._dispatch, self._completer, self._producer
        held: list[store.Claim] = []
        for flight in dispatch.in_flight.values():
            if mono < flight.deadline:
                held.append(flight.claim)
            elif not flight.overdue:
                flight.overdue = True
                _log.error(
                    "send still running past --send-timeout; its lease is left to expire",
                    extra={"action": "send_overdue", "message_id": flight.claim.id},
                )
                if dispatch.hung() >= self.config.concurrency:
                    self._on_hung()
        held += [done.claim for done in completer.unsaved + completer.stuck]
        held += [ready.claim for ready in producer.ready]
        due = [claim for claim in held if claim.lease_expires_at - now < half]
        if not due:
            return
        until = now + timedelta(seconds=self.config.lease_seconds)
        kept: set[tuple[int, str]] = set()
        with self._connection.transaction() as conn:
            for token, ids in by_token(due).items():
                kept.update(
                    (id_, token)
                    for id_ in store.extend_lease(conn, ids=ids, claim_token=token, until=until)
                )

        def renewed(claim: store.Claim) -> store.Claim:
            if claim.lease_expires_at - now >= half or (claim.id, claim.claim_token) not in kept:
                return claim
            return dataclasses.replace(claim, lease_expires_at=until)

        for flight in dispatch.in_flight.values():
            flight.claim = renewed(flight.claim)
        completer.unsaved = [
            dataclasses.replace(d, claim=renewed(d.claim)) for d in completer.unsaved
        ]
        completer.stuck = [dataclasses.replace(d, claim=renewed(d.claim)) for d in completer.stuck]
        for ready in producer.ready:
            ready.claim = renewed(ready.claim)
        for claim in due:
            if (claim.id, claim.claim_token) not in kept:
                _log.warning("lease lost", extra={"action": "lease_lost", "message_id": claim.id})
