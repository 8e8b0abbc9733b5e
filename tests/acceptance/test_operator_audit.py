"""An operator closes what the relays could not know, with real processes, and the operators'
log says who did what, when and why: a relay dies mid-send and leaves ambiguous rows; one whose
finalize was lost is resolved as delivered, one that never went out as not delivered, an
address is suppressed, an old message is pruned. Every action is in ``outbox_operator_log``,
by the OS user or the given ``--actor``, and each message went out exactly once."""

from __future__ import annotations

import json
import signal
import subprocess
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from outbox.schema import messages
from tests.support.factories import enqueue
from tests.support.relays import RELAY, clean_env, in_flight_ids, message_rows, sleep_until
from tests.support.waiting import wait_for

FAST = ("--poll-interval", "0.2", "--log-level", "WARNING")
SHORT_LEASE = ("--lease-seconds", "3", "--send-timeout", "1")


def operator(url: str, *args: str, user: str = "olivia") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [RELAY, *args],
        env=clean_env(OUTBOX_DATABASE_URL=url, LOGNAME=user, USER=user),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def operator_log(engine: sa.Engine) -> list[sa.Row]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT * FROM outbox_operator_log ORDER BY id")))


def test_every_operator_action_is_in_the_log_and_each_message_goes_out_once(server_backend, relays):
    engine, url = server_backend.engine, server_backend.url
    enqueue(engine, 12, prefix="audit")
    victim = relays.start("--concurrency", "4", "--batch-size", "4", *SHORT_LEASE, *FAST, latency=2)
    wait_for(lambda: in_flight_ids(engine), timeout=30, what="sends in flight")
    victim.popen.send_signal(signal.SIGKILL)
    victim.wait(10)
    with engine.connect() as conn:
        last_lease = conn.execute(sa.select(sa.func.max(messages.c.lease_expires_at))).scalar()
    sleep_until(last_lease + timedelta(seconds=0.2))
    assert relays.start("--exit-when-idle", *SHORT_LEASE, *FAST).wait(60) == 0
    rows = message_rows(engine)
    unknown = sorted(i for i, r in rows.items() if r.status == "unknown_outcome")
    assert unknown, "the killed relay had sends in flight"
    never_sent = unknown[0]
    assert relays.deliveries()[never_sent] == 0  # the provider's record: it never went out

    # A send that went out but whose finalize was lost: the provider has it, the row does not.
    lost = next(i for i, r in rows.items() if r.status == "sent")
    assert relays.deliveries()[lost] == 1
    with engine.begin() as conn:
        conn.execute(
            messages.update()
            .where(messages.c.id == lost)
            .values(status="unknown_outcome", provider_message_id=None, sent_at=None)
        )

    delivered = operator(
        url, "resolve", str(lost), "--delivered", "--provider-message-id", "fake-lost",
        "--reason", "in the provider's log",
    )  # fmt: skip
    assert delivered.returncode == 0, delivered.stderr
    requeued = operator(
        url, "resolve", str(never_sent), "--not-delivered", "--reason", "not in the provider's log",
        "--actor", "pat",
    )  # fmt: skip
    assert requeued.returncode == 0, requeued.stderr
    refused = operator(url, "resolve", str(lost), "--delivered")
    assert refused.returncode == 1
    assert "already sent" in refused.stderr
    suppressed = operator(url, "suppressions", "add", "Nobody@Example.com", "--reason", "left")
    assert suppressed.returncode == 0, suppressed.stderr

    assert relays.start("--exit-when-idle", *FAST).wait(60) == 0
    rows = message_rows(engine)
    assert (rows[lost].status, rows[lost].provider_message_id) == ("sent", "fake-lost")
    assert rows[never_sent].status == "sent"
    assert relays.deliveries()[lost] == 1  # resolved, never sent again
    assert relays.deliveries()[never_sent] == 1  # requeued, sent once

    with engine.begin() as conn:  # an old finished message, for the prune
        old = datetime.now(UTC) - timedelta(days=40)
        conn.execute(
            messages.update().where(messages.c.id == lost).values(created_at=old, updated_at=old)
        )
    pruned = operator(url, "prune", "--older-than", "30d", "--actor", "cron", "--json")
    assert pruned.returncode == 0, pruned.stderr
    assert json.loads(pruned.stdout)["deleted"] == 1

    log = operator_log(engine)
    assert [(r.action, r.actor, r.message_id, r.address) for r in log] == [
        ("resolve_delivered", "olivia", lost, None),
        ("resolve_not_delivered", "pat", never_sent, None),
        ("suppress", "olivia", None, "nobody@example.com"),
        ("prune", "cron", None, None),
    ]
    assert [r.reason for r in log[:3]] == [
        "in the provider's log",
        "not in the provider's log",
        "left",
    ]
    assert json.loads(log[0].detail) == {
        "previous_status": "unknown_outcome",
        "provider_message_id": "fake-lost",
    }
    assert json.loads(log[3].detail)["deleted"] == 1
    moments = [r.at for r in log]
    assert moments == sorted(moments)
    assert datetime.now(UTC) - moments[0].replace(tzinfo=moments[0].tzinfo or UTC) < timedelta(
        minutes=5
    )
    shown = json.loads(operator(url, "show", str(never_sent), "--json").stdout)
    assert [a["action"] for a in shown["operator_actions"]] == ["resolve_not_delivered"]
    assert all(n == 1 for n in relays.deliveries().values())
