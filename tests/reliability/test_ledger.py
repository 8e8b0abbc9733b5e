"""The delivery ledger (:mod:`tests.reliability.ledger`) per fault scenario, on PostgreSQL and
MariaDB: real relay processes, real boto3 against moto behind the fault server, and a
reconciliation of every row against what SES accepted.

N is kept small for CI (the whole file runs in a few minutes for both backends); the
harness runs any N from the command line (``--messages 3000`` by default).
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from outbox.exceptions import InvalidEmail
from outbox.schema import messages
from tests.conftest import Order, _emptied
from tests.reliability.ledger import OUTBOX, Summary, run
from tests.ses_emulator import MotoSes
from tests.unit.test_message import INVALID, make

RELAYS = 3


@pytest.fixture(scope="module")
def moto():
    server = MotoSes()
    yield server
    server.stop()


def ledger(server_backend, moto, tmp_path, scenario: str, count: int) -> Summary:
    summary = run(
        server_backend.url,
        scenario=scenario,
        count=count,
        replicas=RELAYS,
        workdir=tmp_path,
        moto=moto,
    )
    print("\n" + summary.line())
    assert summary.problems == []
    assert summary.duplicates == 0
    assert summary.lost == 0
    assert summary.unknown <= summary.unknown_bound
    # every row is accounted for, each in exactly one way
    assert (
        summary.sent + summary.unknown + summary.failed + summary.expired + summary.cancelled
        == count
    )
    return summary


def test_sigkill_of_relays_mid_run_loses_nothing_and_parks_only_sends_in_flight(
    server_backend, moto, tmp_path
):
    summary = ledger(server_backend, moto, tmp_path, "sigkill", 600)

    assert len(summary.in_flight_at_faults) >= 3
    assert summary.restarts == len(summary.in_flight_at_faults)
    assert summary.ambiguous_faults == 0  # SES answered everything: only the kills are ambiguous
    assert summary.failed == 0


def test_sigterm_drains_mid_run_leave_no_unknown_outcome(server_backend, moto, tmp_path):
    summary = ledger(server_backend, moto, tmp_path, "sigterm", 600)

    assert len(summary.in_flight_at_faults) >= 3
    assert summary.unknown == 0
    assert summary.resend_duplicates == 0  # a drain finishes its sends: nothing is resent
    assert summary.failed == 0


def test_ses_fault_mix_and_a_pause_window_lose_nothing(server_backend, moto, tmp_path):
    summary = ledger(server_backend, moto, tmp_path, "ses_faults", 600)

    for kind in ("throttle", "server_error", "hang", "sending_paused"):
        assert summary.requests[kind], f"the plan drew no {kind}: {summary.requests}"
    assert summary.in_flight_at_faults == []
    assert summary.failed == 0


def test_database_connection_kills_mid_run_lose_nothing(server_backend, moto, tmp_path):
    """``pg_terminate_backend`` / MariaDB ``KILL`` of every relay connection a few times: the
    stand-in for a database restart (the servers are shared, so they are not restarted)."""
    summary = ledger(server_backend, moto, tmp_path, "db_kill", 600)

    assert len(summary.in_flight_at_faults) >= 3
    assert summary.failed == 0


def test_a_relay_stopped_past_its_lease_finalizes_stale_and_duplicates_nothing(
    server_backend, moto, tmp_path
):
    summary = ledger(server_backend, moto, tmp_path, "slow_sender", 450)

    [frozen] = summary.in_flight_at_faults
    assert frozen >= 1, "the relay was never caught mid-send: this run proves nothing"
    assert summary.failed == 0


def test_a_poisoned_payload_fails_as_invalid_payload_and_the_rest_is_delivered(
    server_backend, moto, tmp_path
):
    summary = ledger(server_backend, moto, tmp_path, "poison", 300)

    assert summary.failed == 3  # exactly the poisoned rows (checked per row by the harness)
    assert summary.unknown == 0
    assert summary.sent + summary.expired == 300 - 3


def test_every_invalid_email_field_fails_before_commit_and_the_business_rows_still_commit(
    backend,
):
    """Table-driven over every invalid field of ``tests/unit/test_message.py``'s ``INVALID``:
    the precise error (type and field) reaches the caller inside its transaction, before
    anything is written to the outbox, and the caller's own rows still commit. (Each invalid
    relay setting refusing to start with one line naming it is covered by
    ``tests/acceptance/test_run_cli.py``.)"""
    Sessions = sessionmaker(backend.engine)
    for case in INVALID:
        overrides, error, field = case.values
        with Sessions.begin() as session:
            session.add(Order(customer=f"bad-input {case.id}"))
            with pytest.raises(InvalidEmail) as info:
                OUTBOX.enqueue(session, make(**overrides), key=f"bad-input:{case.id}")
            assert (type(info.value), info.value.field) == (error, field), case.id
            assert str(info.value).startswith(f"{field}: ")

    with backend.engine.connect() as conn:
        customers = set(conn.execute(sa.select(Order.customer)).scalars())
        outboxed = conn.execute(sa.select(sa.func.count()).select_from(messages)).scalar_one()
    assert customers == {f"bad-input {case.id}" for case in INVALID}
    assert outboxed == 0
    assert len(INVALID) >= 20


def workdir(path):
    path.mkdir()
    return path


@pytest.fixture
def postgresql(_backends):
    yield from _emptied(_backends["postgresql"])


def test_a_transaction_holding_back_xmin_slows_postgresql_but_loses_nothing(
    postgresql, moto, tmp_path
):
    """PostgreSQL only: a REPEATABLE READ transaction that read a row stays open for the whole
    run, so no dead tuple the relays make can be vacuumed. The same run without it is the
    baseline; the factor between them is reported."""
    runs = {
        scenario: run(
            postgresql.url,
            scenario=scenario,
            count=600,
            replicas=RELAYS,
            workdir=workdir(tmp_path / scenario),
            moto=moto,
        )
        for scenario in ("clean", "xmin")
    }
    for summary in runs.values():
        print("\n" + summary.line())
        assert summary.problems == []
        assert (summary.duplicates, summary.lost, summary.unknown, summary.failed) == (0, 0, 0, 0)
        assert summary.resend_duplicates == 0
    assert runs["xmin"].xmin_held is True
    factor = runs["clean"].throughput / runs["xmin"].throughput
    print(
        f"[postgresql] xmin held back: {runs['xmin'].throughput:.0f} requests/s against "
        f"{runs['clean'].throughput:.0f}/s without it: factor {factor:.2f}"
    )
