"""Attack review of the two-step claim on PostgreSQL (``lock_batch`` reads and locks, the
admission filters run, ``take_batch`` writes the claim with the wave's mark).

The budget filter takes the wave's send slots (``take_send_slots``) and, once a second, prunes
the slots that no longer count (``prune_send_slots``: no row ``processing`` under the slot's
claim token) in the same transaction, *before* ``take_batch`` has written the new claims. The
pass's fresh claims are still ``pending`` under no token there, so their own slots are deleted
as they are taken, and a key's ``inflight:N`` limit no longer holds: another relay (or the
next pass) sees no send of the key in flight. Before the change the claim was written first,
the slots were held, and this passed; MariaDB (claim written first still) passes.
"""

from __future__ import annotations

import time

import sqlalchemy as sa

from outbox.schema import send_slots
from tests.support.factories import enqueue
from tests.support.hand_clocks import Clock
from tests.support.inprocess import HeldSender, closing, relay_for
from tests.support.waiting import wait_for


def test_a_fresh_claims_send_slot_survives_its_own_pass_and_holds_the_keys_inflight_limit(
    postgres_backend,
):
    """``K=inflight:1``: relay a claims and starts K's first message (held open). Its slot must
    be in the table after the pass, and relay b, seeing it, must keep K's second message back
    while the first is in flight."""
    engine = postgres_backend.engine
    clock = Clock()
    (first,) = enqueue(engine, 1, prefix="a", fairness_key="K")
    sender = HeldSender()
    gate = sender.hold(first)
    limits = ("K=inflight:1",)
    a = relay_for(postgres_backend, sender, clock, relay_id="a", key_limits=limits, concurrency=4)
    b = relay_for(postgres_backend, sender, clock, relay_id="b", key_limits=limits, concurrency=4)
    try:
        with closing(a), closing(b):
            clock.advance(1)
            a.step()  # the first pass: the budget's prune is due at once
            wait_for(lambda: len(sender.calls) == 1, what="K's first send in flight")
            with engine.connect() as conn:
                held = conn.execute(sa.select(send_slots.c.message_id, send_slots.c.scope)).all()
            (second,) = enqueue(engine, 1, prefix="b", fairness_key="K")
            clock.advance(1)
            b.step()
            time.sleep(0.3)  # time for a wrongly started send to reach the sender
            calls = [mid for mid, _attempt in sender.calls]
    finally:
        gate.set()
        sender.release_all()
    assert held == [(first, "key:K")], "the in-flight send's slot was pruned by its own pass"
    assert calls == [first], f"K=inflight:1, yet {second} started beside {first}"
