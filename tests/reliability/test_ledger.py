"""The delivery ledger (:mod:`tests.reliability.ledger`) per fault scenario, on PostgreSQL and
MariaDB: real relay processes, real boto3 against moto behind the fault server, and a
reconciliation of every row against what SES accepted.

N is kept small for CI (the whole file runs in a few minutes for both backends): 600 per run,
900 where faults take seconds of the run (database restarts, CLI cancels, the combined run),
1,200 for the clock skew run (so it lasts a few leases), 10,000 for the xmin throughput pair
(no-latency sender); the two delivery-truth runs (the SES event intake on) add a reconcile
window of a few seconds and a trickle of mail after the chaos. ``pytest --ledger-messages
3000`` runs every ledger test at that N; the harness runs any N from the command line.

The database restart tests restart the server for real with the shell command in
``OUTBOX_TEST_POSTGRES_RESTART`` / ``OUTBOX_TEST_MYSQL_RESTART`` (``.ci/run`` sets both to
``.ci/restart-db``). Without it they skip, and fail when CI=true. No other test here restarts
a server: the database outage is a proxy between the relays and the server that drops and
refuses their connections, the clock skew is libfaketime on two of the relays, the TLS fault
and the paused configuration set are the fault server's.
"""

from __future__ import annotations

import os

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from outbox.exceptions import InvalidEmail
from outbox.schema import messages
from tests.reliability.ledger import (
    LEASE,
    OUTBOX,
    PAUSED_SET,
    PAUSED_SET_WINDOW,
    Summary,
    run,
)
from tests.support.db import CI, Backend, Order, emptied
from tests.support.factories import INVALID, make

RELAYS = 3
RESTART_ENV = {"postgresql": "OUTBOX_TEST_POSTGRES_RESTART", "mysql": "OUTBOX_TEST_MYSQL_RESTART"}
# the relays' throughput with PostgreSQL's xmin horizon held back for the whole run, as a
# share of the same run without: never below this
XMIN_FACTOR = 0.5
XMIN_MESSAGES = 10_000


@pytest.fixture
def size(request):
    """N for a ledger run: the test's CI size, unless ``--ledger-messages`` says otherwise."""
    chosen = request.config.getoption("--ledger-messages")
    return lambda default: default if chosen is None else chosen


def restart_command(backend: Backend) -> str | None:
    """The shell command that restarts this backend's server; skips (fails in CI) without."""
    variable = RESTART_ENV[backend.name]
    command = os.environ.get(variable)
    if command:
        return command
    reason = f"{variable} is not set: no command to restart the {backend.name} server"
    if CI:
        pytest.fail(f"{reason} (CI=true: this test must run, not skip)", pytrace=False)
    return None


def ledger_run(server_backend, moto, tmp_path, scenario: str, count: int, **options) -> Summary:
    summary = run(
        server_backend.url,
        scenario=scenario,
        count=count,
        replicas=RELAYS,
        workdir=tmp_path,
        moto=moto,
        **options,
    )
    print("\n" + summary.line())
    for problem in summary.problems[:20]:
        print("  PROBLEM", problem)
    return summary


def ledger(server_backend, moto, tmp_path, scenario: str, count: int, **options) -> Summary:
    summary = ledger_run(server_backend, moto, tmp_path, scenario, count, **options)
    return reconciled(summary, count)


def reconciled(summary: Summary, count: int) -> Summary:
    """What every ledger run must show, whatever its faults."""
    assert summary.problems == []
    assert summary.duplicates == 0
    assert summary.lost == 0
    assert summary.unknown <= summary.unknown_bound
    # every row is accounted for, each in exactly one way (the trickle after the chaos too)
    assert (
        summary.sent + summary.unknown + summary.failed + summary.expired + summary.cancelled
        == count + summary.ticks
    )
    return summary


def truth(summary: Summary, count: int) -> Summary:
    """What every run with the event intake on must show, on top of :func:`reconciled` (the
    harness checks each ambiguous send per row; these are its totals)."""
    reconciled(summary, count)
    assert summary.reconcile_left == 0  # reconcile mail never waits for a human
    assert summary.ambiguous_reached >= 1, "no ambiguous send reached SES: this run proves little"
    assert summary.requeued >= 1, "no ambiguous send missed SES: reconcile requeued nothing"
    # each ambiguous send SES took ends sent with its id (or, its events lost, left for a human)
    assert summary.resolved_by_events + summary.events_lost_ambiguous == summary.ambiguous_reached
    assert summary.requeued_delivered == summary.requeued  # each requeue delivered exactly once
    # a human is left exactly the hold mail no event could speak for
    assert summary.left_for_human == summary.unknown
    assert summary.events_recorded == summary.events_published  # a duplicate is recorded once
    assert summary.event_effects["malformed"] == summary.dead_letters == 0
    # (that each requeue waited out its window is the reconcile tests' to prove, per row: the
    # window starts at each ambiguous send, during the chaos, not when the harness's wait does)
    return summary


def test_sigkill_of_relays_mid_run_loses_nothing_and_parks_only_sends_in_flight(
    server_backend, moto, tmp_path, size
):
    summary = ledger(server_backend, moto, tmp_path, "sigkill", size(600))

    assert len(summary.in_flight_at_faults) >= 3
    assert summary.restarts == len(summary.in_flight_at_faults)
    assert summary.ambiguous_faults == 0  # SES answered everything: only the kills are ambiguous
    assert summary.failed == 0


def test_sigterm_drains_mid_run_leave_no_unknown_outcome(server_backend, moto, tmp_path, size):
    summary = ledger(server_backend, moto, tmp_path, "sigterm", size(600))

    assert len(summary.in_flight_at_faults) >= 3
    assert summary.unknown == 0
    assert summary.resend_duplicates == 0  # a drain finishes its sends: nothing is resent
    assert summary.failed == 0


def test_ses_fault_mix_and_a_pause_window_lose_nothing(server_backend, moto, tmp_path, size):
    summary = ledger(server_backend, moto, tmp_path, "ses_faults", size(600))

    for kind in ("throttle", "server_error", "hang", "sending_paused"):
        assert summary.requests[kind], f"the plan drew no {kind}: {summary.requests}"
    assert summary.in_flight_at_faults == []
    assert summary.failed == 0


def test_with_the_event_intake_each_ambiguous_send_is_resolved_requeued_once_or_held(
    server_backend, moto, tmp_path, size
):
    """The delivery truth: the SES fault mix with resets before forwarding and a SIGKILL, the
    emulator publishing every accepted send's events through SNS into SQS, every relay reading
    them (``run --events-queue-url``), a ``reconcile`` category with a window of a few seconds.
    After the chaos and the window: reconcile mail has 0 rows in unknown_outcome; each
    ambiguous send that reached SES is sent with the MessageId moto gave it (hold mail too);
    each that did not was requeued once (reconcile mail) and delivered exactly once, or is
    still unknown_outcome (hold mail, for a human); 0 duplicates, 0 lost; every sent row is
    ``delivered``. The figures (ambiguous, resolved by events, requeued, left) are printed."""
    count = size(600)
    summary = truth(ledger_run(server_backend, moto, tmp_path, "reconcile", count), count)

    assert summary.events == "run"
    for kind in ("hang", "reset", "reset_before"):
        assert summary.requests[kind], f"the plan drew no {kind}: {summary.requests}"
    assert summary.restarts == 1
    assert summary.events_dropped == summary.events_duplicated == 0
    assert summary.events_lost_ambiguous == 0
    assert summary.delivered_status == summary.sent  # every sent row's Delivery event counted
    assert summary.failed == 0


def test_late_duplicated_reordered_and_lost_events_resolve_nothing_wrongly(
    server_backend, moto, tmp_path, size
):
    """The same run with the event stream broken and the intake as its own process
    (``outbox-relay events``): every event published a second late, a tenth twice, a tenth of
    the sends with their Send event last, and every event of a share of the sends SES answered
    lost (hold and resend mail only: a lost event of an ambiguous reconcile send is the one
    case reconcile cannot tell from a send SES never took, and would resend; see the harness).
    Nothing is resolved wrongly: the same totals hold, a duplicate event changes nothing, a
    send whose events were lost keeps what the relay knew (sent, no delivery status; hold mail
    whose answer was lost too stays unknown_outcome)."""
    count = size(600)
    summary = truth(
        ledger_run(
            server_backend,
            moto,
            tmp_path,
            "reconcile",
            count,
            events="process",
            event_faults=True,
        ),
        count,
    )

    assert summary.events == "process"
    assert summary.events_duplicated >= 1
    assert summary.events_dropped >= 1
    assert summary.delivered_status < summary.sent  # the lost events' rows have no status
    assert summary.failed == 0


def test_database_connection_kills_mid_run_lose_nothing(server_backend, moto, tmp_path, size):
    """``pg_terminate_backend`` / MariaDB ``KILL`` of every relay connection a few times."""
    summary = ledger(server_backend, moto, tmp_path, "db_kill", size(600))

    assert len(summary.in_flight_at_faults) >= 3
    assert summary.failed == 0


@pytest.mark.serial  # restarts the database server: nothing else may run
def test_database_server_restarts_mid_run_lose_nothing(server_backend, moto, tmp_path, size):
    """The server itself stopped and started three times while the relays run (a real restart:
    its start time changes). Every relay survives it, reconnects and finishes; unknown_outcome
    stays within the sends in flight at the restarts."""
    command = restart_command(server_backend)
    if command is None:
        reason = (
            f"{RESTART_ENV[server_backend.name]} is not set: no command to restart the "
            f"{server_backend.name} server"
        )
        if CI:  # .ci/run sets it: a restart test that cannot restart must not pass as a skip
            pytest.fail(f"{reason} (CI=true: it must run, not skip)", pytrace=False)
        pytest.skip(reason)
    try:
        summary = ledger(
            server_backend, moto, tmp_path, "db_restart", size(900), restart_command=command
        )
    finally:
        server_backend.engine.dispose()  # the suite's pooled connections died with the server

    assert summary.db_restarts == 3
    assert len(summary.in_flight_at_faults) == 3
    assert summary.ambiguous_faults == 0  # SES answered everything: only restarts are faults
    assert summary.failed == 0
    assert summary.resend_duplicates <= sum(summary.in_flight_at_faults)


def test_operator_cancels_mid_run_are_never_sent_and_lost_races_are_reported(
    server_backend, moto, tmp_path, size
):
    """``outbox-relay cancel ID --yes`` as a subprocess while the relays run, twice, for rows at
    the tail of the queue, at its head and already claimed or sent: what the CLI reported as
    cancelled is ``cancelled`` and never reached SES; what it refused was not cancelled."""
    summary = ledger(server_backend, moto, tmp_path, "cancel", size(900))

    assert summary.cancel_confirmed >= 1, summary.cancels
    assert summary.cancel_lost >= 1, summary.cancels  # at least the rows already sent
    assert summary.cancelled == summary.cancel_confirmed
    # No fault: a send is ambiguous only when SES accepted it and answered after the read
    # timeout (a loaded machine), which the harness counts from the fault server's record.
    # Each such answer ends as at most one of: an unknown_outcome (hold), a second delivery of
    # resend mail, or resend mail cancelled after SES had it (documented in Guarantees).
    ambiguous = summary.unknown + summary.resend_duplicates + summary.ended_after_unanswered
    assert ambiguous <= summary.slow_answers
    assert summary.failed == 0


@pytest.mark.serial  # restarts the database server: nothing else may run
def test_every_fault_in_one_run_loses_nothing(server_backend, moto, tmp_path, size):
    """One run with all of it: the SES fault mix (throttles, 5xx, hangs, resets) throughout,
    operator cancels, two SIGKILLs, killed database connections, a SIGTERM drain, a database
    server restart and a pause window. Without a restart command (outside CI) it runs without
    the restart and says so."""
    command = restart_command(server_backend)
    try:
        summary = ledger(
            server_backend, moto, tmp_path, "combined", size(900), restart_command=command
        )
    finally:
        server_backend.engine.dispose()

    assert summary.restarts == 3  # two SIGKILLs and a SIGTERM, each relay replaced
    assert summary.db_restarts == (1 if command else 0)
    assert len(summary.in_flight_at_faults) == 4 + summary.db_restarts
    if command is None:
        assert "no database restart: no restart command configured" in summary.notes
    for kind in ("throttle", "server_error", "hang", "reset", "sending_paused"):
        assert summary.requests[kind], f"the plan drew no {kind}: {summary.requests}"
    assert summary.cancel_confirmed >= 1, summary.cancels
    assert summary.cancel_lost >= 1, summary.cancels
    assert summary.cancelled == summary.cancel_confirmed
    assert summary.failed == 0


def test_a_database_outage_longer_than_the_lease_loses_no_send_ses_accepted(
    server_backend, moto, tmp_path, size
):
    """The relays reach the database through a proxy that, while sends are in flight, drops
    every connection and refuses new ones for longer than the lease; the server runs on. SES
    accepts the sends in flight meanwhile. When the database is back every relay saves what
    it finished before any relay sweeps it: no send SES accepted ends unknown_outcome or is
    swept as lease_expired (and so none is sent again), each ends sent with SES's id."""
    count = size(600)
    summary = ledger_run(server_backend, moto, tmp_path, "db_outage", count)

    assert summary.outage is not None
    assert summary.outage[1] - summary.outage[0] > LEASE
    assert summary.dropped_connections >= RELAYS  # every relay's loop connection at least
    [frozen] = summary.in_flight_at_faults
    assert frozen >= 1, "no send was in flight at the cut: this run proves nothing"
    assert summary.outage_in_flight_accepted >= 1
    assert summary.accepted_unknown == 0, summary.problems[:10]
    assert summary.delivered == summary.sent  # every row SES accepted is sent
    assert summary.resend_duplicates == 0
    reconciled(summary, count)
    assert summary.failed == 0


# serial: a read timeout beside other workers' load made one resend duplicate (a timing bound)
@pytest.mark.serial
def test_relays_with_clocks_two_minutes_ahead_and_behind_expire_no_lease(
    server_backend, moto, tmp_path, size
):
    """One relay's wall clock runs two minutes ahead, another's two minutes behind
    (libfaketime; SES sees it in the requests' signing dates), the third is right. Leases,
    sweeps and heartbeats are on the database's clock: no lease expires, nothing is
    ambiguous, nothing is sent twice."""
    summary = ledger(server_backend, moto, tmp_path, "clock_skew", size(1200))

    offsets = summary.signing_offsets
    assert set(offsets) == {-2, 0, 2}, f"not every relay sent on its own clock: {offsets}"
    assert summary.lease_expired == 0
    assert summary.unknown == 0
    assert (summary.failed, summary.resend_duplicates) == (0, 0)


def test_a_tls_error_after_ses_took_the_request_is_ambiguous_and_never_resent(
    server_backend, moto, tmp_path, size
):
    """The relays talk TLS to the fault server, which answers a share of the sends, once
    moto took them, with a corrupt TLS record. Each is ambiguous (an SSLError attempt): hold
    mail is parked as unknown_outcome, received exactly once and never sent again (checked
    per row by the harness); resend mail is sent again."""
    summary = ledger(server_backend, moto, tmp_path, "tls_fault", size(600))

    assert summary.tls_faults >= 5, summary.requests
    assert summary.tls_held >= 1
    assert summary.unknown >= summary.tls_held
    assert summary.ambiguous_faults == summary.tls_faults
    assert summary.failed == 0


def test_a_paused_configuration_set_holds_only_its_own_mail(server_backend, moto, tmp_path, size):
    """Mail of the configuration set ``marketing`` is paused by SES for a window while the
    rest flows: other mail keeps being accepted during the window, no marketing mail is, and
    afterwards each marketing message is delivered once, on its first attempt (the pause used
    none). No relay ever shows ``paused``: the account never was."""
    summary = ledger(server_backend, moto, tmp_path, "paused_set", size(600))

    assert summary.window is not None
    assert summary.window_other_sends >= 5 * PAUSED_SET_WINDOW, "other mail stopped too"
    assert summary.window_marketing_accepted == 0
    assert summary.marketing_refused >= 1, f"no send met the {PAUSED_SET} pause"
    assert summary.marketing_after >= len(summary.marketing) // 2, "the window held little"
    assert summary.marketing_before + summary.marketing_after == len(summary.marketing)
    assert summary.relay_states["running"]
    assert summary.relay_states["paused"] == 0
    assert (summary.unknown, summary.failed) == (0, 0)


def test_a_relay_stopped_past_its_lease_finalizes_stale_and_duplicates_nothing(
    server_backend, moto, tmp_path, size
):
    summary = ledger(server_backend, moto, tmp_path, "slow_sender", size(450))

    [frozen] = summary.in_flight_at_faults
    assert frozen >= 1, "the relay was never caught mid-send: this run proves nothing"
    assert summary.failed == 0


def test_a_poisoned_payload_fails_as_invalid_payload_and_the_rest_is_delivered(
    server_backend, moto, tmp_path, size
):
    count = size(300)
    summary = ledger(server_backend, moto, tmp_path, "poison", count)

    assert summary.failed == 3  # exactly the poisoned rows (checked per row by the harness)
    assert summary.unknown == 0
    assert summary.sent + summary.expired == count - 3


def test_every_invalid_email_field_fails_before_commit_and_the_business_rows_still_commit(
    backend,
):
    """Table-driven over every invalid field of ``INVALID`` (:mod:`tests.support.factories`):
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
    yield from emptied(_backends["postgresql"])


def test_a_transaction_holding_back_xmin_keeps_half_the_throughput_and_loses_nothing(
    postgresql, moto, tmp_path, size
):
    """PostgreSQL only: a REPEATABLE READ transaction that read a row stays open for the whole
    run, so no dead tuple the relays make can be vacuumed. The same run without it is the
    baseline. Both runs use the no-latency fake sender (SES through moto, ~130 requests/s,
    would be the bottleneck of both), so the relays and the database are what is measured,
    and every row is still reconciled against the sender's record. Stated: with xmin held
    back the relays keep at least XMIN_FACTOR of the clean run's throughput."""
    count = max(size(XMIN_MESSAGES), XMIN_MESSAGES)
    runs = {
        scenario: run(
            postgresql.url,
            scenario=scenario,
            count=count,
            replicas=RELAYS,
            workdir=workdir(tmp_path / scenario),
            moto=moto,
            sender="fake",
        )
        for scenario in ("clean", "xmin")
    }
    for summary in runs.values():
        print("\n" + summary.line())
        assert summary.problems == []
        assert (summary.duplicates, summary.lost, summary.unknown, summary.failed) == (0, 0, 0, 0)
        assert summary.resend_duplicates == 0
        assert summary.sent + summary.expired == count
        assert summary.delivered == summary.sent
    assert runs["xmin"].xmin_held is True
    clean, held = runs["clean"].throughput, runs["xmin"].throughput
    factor = held / clean
    print(
        f"[postgresql] N={count}: {held:.0f} sends/s with xmin held back, {clean:.0f}/s "
        f"without: factor {factor:.2f} (stated: >= {XMIN_FACTOR})"
    )
    assert factor >= XMIN_FACTOR
