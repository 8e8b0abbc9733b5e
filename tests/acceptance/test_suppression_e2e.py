"""Suppression end to end, on PostgreSQL and MariaDB: two real ``outbox-relay run --sender ses``
processes with the event intake on (``--events-queue-url``), boto3 against moto behind the fault
server, which publishes the events SES would for every send it took through SNS into SQS. The
mailbox simulator's ``bounce@simulator.amazonses.com`` bounces permanently: after its Bounce
event, no relay mails that address again, whatever case or display name the next email gives
it, and a message to it and someone else goes to the someone else only.
"""

from __future__ import annotations

import signal

import sqlalchemy as sa

from outbox import Email
from outbox.schema import messages, suppressions
from tests.support.db import attempt_rows
from tests.support.factories import SENDER, enqueue
from tests.support.relays import clean_env, message_rows, relay_rows, spawn
from tests.support.ses import FaultPlan, FaultServer, aws_env
from tests.support.waiting import wait_for

BOUNCE = "bounce@simulator.amazonses.com"
SUCCESS = "success@simulator.amazonses.com"


def mail(key: str, *to: str) -> Email:
    return Email(sender=SENDER, to=list(to), subject=f"suppression {key}", text="Hello.")


def addressed_to(send, address: str) -> bool:
    destination = send.request.get("Destination", {})
    named = [
        a
        for field in ("ToAddresses", "CcAddresses", "BccAddresses")
        for a in destination.get(field, [])
    ]
    return any(address in a.lower() for a in named)


def test_a_bounced_address_gets_no_second_email(server_backend, moto, event_queue, tmp_path):
    engine = server_backend.engine
    with FaultServer(moto.url, FaultPlan(), events=event_queue) as ses:
        env = {k: v for k, v in clean_env().items() if not k.startswith("AWS_")}
        env.update(aws_env(ses.url, events_url=moto.url))
        args = ("--events-queue-url", event_queue.url, "--events-wait-seconds", "1")
        args += ("--poll-interval", "0.1", "--log-level", "WARNING")
        procs = [
            spawn(server_backend.url, "ses", f"suppress-{n}", tmp_path / f"r{n}.log", env, *args)
            for n in (1, 2)
        ]
        try:
            # registered: signal handlers installed, so the SIGTERM at the end is a drain
            wait_for(
                lambda: len(relay_rows(engine)) == 2, timeout=30, what="both relays registered"
            )
            [first] = enqueue(engine, [mail("first", BOUNCE)], key="suppression:first")

            def bounced():
                with engine.connect() as conn:
                    return conn.execute(
                        sa.select(suppressions).where(suppressions.c.address == BOUNCE)
                    ).first()

            held = wait_for(bounced, timeout=60, interval=0.1, what="the Bounce event applied")
            [second, both] = enqueue(
                engine,
                [
                    mail("second", f"Bounced Customer <{BOUNCE.upper()}>"),
                    mail("both", BOUNCE, SUCCESS),
                ],
                prefix="suppression",
            )

            def settled():
                rows = message_rows(engine)
                return all(rows[i].status in ("sent", "failed") for i in (second, both))

            wait_for(settled, timeout=60, interval=0.1, what="both later messages settled")
        finally:
            for proc in procs:
                proc.popen.send_signal(signal.SIGTERM)
            codes = [proc.wait(30) for proc in procs]
        ses.events.flush()
        to_bounce = [s for s in ses.sends if addressed_to(s, BOUNCE)]
        to_success = [s for s in ses.ledger if addressed_to(s, SUCCESS)]

    assert codes == [0, 0], [p.output()[-2000:] for p in procs]
    rows = message_rows(engine)
    # SES took exactly one email to the bounced address: the first
    assert [(s.outbox_id, s.accepted) for s in to_bounce] == [(first, True)]
    moto_held = [
        m
        for m in moto.messages()
        if BOUNCE in [d.lower() for d in m["destinations"]["ToAddresses"]]
    ]
    assert len(moto_held) == 1
    assert (rows[first].status, rows[first].delivery_status) == ("sent", "bounced")
    assert (held.reason, held.actor) == ("bounce", "ses-events")
    assert held.event_id is not None
    # the second, to nobody else: failed as suppressed, never sent
    assert (rows[second].status, rows[second].last_error_code) == ("failed", "suppressed")
    assert [a.outcome for a in attempt_rows(engine, second)] == ["suppressed"]
    assert not [s for s in ses.sends if s.outbox_id == second]
    # the third: sent to the other recipient only, the attempt naming whom it dropped
    assert rows[both].status == "sent"
    [request] = [s for s in to_success if s.outbox_id == both]
    assert request.request["Destination"]["ToAddresses"] == [SUCCESS]
    [accepted] = [a for a in attempt_rows(engine, both) if a.outcome == "accepted"]
    assert BOUNCE in (accepted.dropped_recipients or "")
    with engine.connect() as conn:
        suppressed = conn.execute(sa.select(suppressions.c.address)).scalars().all()
        statuses = dict(conn.execute(sa.select(messages.c.id, messages.c.status)).all())
    assert suppressed == [BOUNCE]
    assert statuses == {first: "sent", second: "failed", both: "sent"}
