"""Each intake replica's ``outbox_intakes`` row on SQLite, PostgreSQL and MariaDB: the
conditional upsert of each dialect (the process that started last owns the row, heartbeat and
caught-up time never move back, a new process starts without a proof), and what the loop
writes: a heartbeat every pass, ``caught_up_at`` (the database's clock) only after a long poll
came back empty while nothing this process was handed can still be hidden in the queue. Against
a scripted client and moto's SQS server."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from outbox.schema import intakes
from relay.clock import read_database_time
from relay.intake import Intake, build_client, record_intake
from tests.support.db import Backend
from tests.support.ses import MotoSes, aws_env
from tests.support.sqs import EventQueue, ses_event, sns_body

T = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def s(seconds: float) -> datetime:
    return T + timedelta(seconds=seconds)


def the_row(engine: sa.Engine, intake_id: str = "i-1") -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.select(intakes).where(intakes.c.intake_id == intake_id)).one()


def write(engine: sa.Engine, **kw: Any) -> None:
    values: dict[str, Any] = {
        "intake_id": "i-1",
        "queue_url": "https://sqs.eu-west-1.amazonaws.com/1/events",
        "visibility_timeout": 30.0,
        "started_at": T,
        "caught_up": False,
        **kw,
    }
    with engine.begin() as conn:
        record_intake(conn, **values)


def test_the_upsert_keeps_each_column_moving_with_the_clock(backend: Backend) -> None:
    engine = backend.engine
    write(engine, now=s(1))
    first = the_row(engine)
    assert (first.started_at, first.heartbeat_at, first.caught_up_at) == (T, s(1), None)
    assert first.visibility_timeout == 30.0
    write(engine, now=s(5), caught_up=True)
    write(engine, now=s(8))  # a heartbeat with messages in hand keeps the last proof
    assert (the_row(engine).heartbeat_at, the_row(engine).caught_up_at) == (s(8), s(5))
    write(engine, now=s(9), caught_up=True, empty_since=s(2))  # an older emptiness: kept
    assert (the_row(engine).heartbeat_at, the_row(engine).caught_up_at) == (s(9), s(5))
    # the database's clock was stepped back: nothing stays later than the clock says now
    write(engine, now=s(4))
    assert (the_row(engine).heartbeat_at, the_row(engine).caught_up_at) == (s(4), None)
    write(engine, now=s(6), caught_up=True)
    write(engine, now=s(3), caught_up=True)
    assert (the_row(engine).heartbeat_at, the_row(engine).caught_up_at) == (s(3), s(3))
    write(engine, now=s(9), caught_up=True)
    assert the_row(engine).caught_up_at == s(9)


def test_a_row_from_before_the_clock_was_stepped_back_proves_nothing_after(
    backend: Backend,
) -> None:
    """A process that started "later" than the clock now reads (its start was written while
    the clock ran ahead) no longer owns the row against one that writes now; an older
    process's write clears a caught_up_at ahead of its clock."""
    engine = backend.engine
    write(engine, started_at=s(100), now=s(101), caught_up=True)
    write(engine, started_at=s(10), now=s(11))  # a process started after the step back
    taken = the_row(engine)
    assert (taken.started_at, taken.heartbeat_at, taken.caught_up_at) == (s(10), s(11), None)
    write(engine, started_at=s(20), now=s(200), caught_up=True)
    write(engine, started_at=s(5), now=s(30))  # an older process, after another step back
    kept = the_row(engine)
    assert (kept.started_at, kept.heartbeat_at, kept.caught_up_at) == (s(20), s(200), None)


def test_a_new_process_under_the_id_owns_the_row_and_starts_without_a_proof(
    backend: Backend,
) -> None:
    engine = backend.engine
    write(engine, now=s(1), caught_up=True)
    write(engine, started_at=s(60), now=s(61), queue_url="https://q/2", visibility_timeout=45.0)
    new = the_row(engine)
    assert (new.started_at, new.heartbeat_at, new.caught_up_at) == (s(60), s(61), None)
    assert (new.queue_url, new.visibility_timeout) == ("https://q/2", 45.0)
    # the old process, still running somewhere, changes nothing any more
    write(engine, started_at=T, now=s(70), caught_up=True)
    assert the_row(engine) == new
    write(engine, started_at=s(60), now=s(72), caught_up=True)
    assert the_row(engine).caught_up_at == s(72)


class Scripted:
    """An SQS client: the queue's attributes, then the given receives in turn (a list of
    bodies, or an exception to raise), then empty ones; the wait of each receive recorded."""

    def __init__(self, *receives: list[str] | Exception, visibility: int = 1) -> None:
        self.receives = list(receives)
        self.visibility = visibility
        self.waits: list[int] = []

    def get_queue_attributes(self, **_kw: object) -> dict[str, Any]:
        return {"Attributes": {"VisibilityTimeout": str(self.visibility)}}

    def receive_message(self, **kw: Any) -> dict[str, Any]:
        self.waits.append(int(kw["WaitTimeSeconds"]))
        if not self.receives:
            return {}
        answer = self.receives.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return {"Messages": [{"Body": b, "ReceiptHandle": f"h{n}"} for n, b in enumerate(answer)]}

    def delete_message_batch(self, **_kw: object) -> dict[str, Any]:
        return {}


def scripted_intake(engine: sa.Engine, client: Scripted, *, wait: int = 1) -> Intake:
    intake = Intake(
        engine=engine, client=client, queue_url="https://q/1", wait_seconds=wait, intake_id="i-1"
    )
    intake.check_queue()
    return intake


def now_of(engine: sa.Engine) -> datetime:
    with engine.connect() as conn:
        return read_database_time(conn)


def wait_out_the_start(client: Scripted) -> None:
    """Past the visibility timeout since the process started: what a predecessor under this
    id was handed has come back by now."""
    time.sleep(client.visibility + 0.1)


def test_an_empty_long_poll_writes_caught_up_at_on_the_databases_clock(backend: Backend) -> None:
    engine = backend.engine
    client = Scripted()
    intake = scripted_intake(engine, client)
    assert intake.step() == 0  # at start: its predecessor's messages may still be hidden
    assert the_row(engine).caught_up_at is None
    wait_out_the_start(client)
    before = now_of(engine)
    assert intake.step() == 0
    after = now_of(engine)
    found = the_row(engine)
    assert found.caught_up_at is not None
    assert before <= found.caught_up_at <= after
    assert found.heartbeat_at == found.caught_up_at
    assert (found.queue_url, found.visibility_timeout) == ("https://q/1", 1.0)
    assert client.waits == [1, 1]


def test_a_short_poll_proves_nothing(backend: Backend) -> None:
    engine = backend.engine
    client = Scripted()
    intake = scripted_intake(engine, client, wait=0)
    wait_out_the_start(client)
    assert intake.step() == 0
    found = the_row(engine)
    assert (found.heartbeat_at is not None, found.caught_up_at) == (True, None)


def test_a_pass_with_messages_beats_without_proving_the_queue_empty(backend: Backend) -> None:
    engine = backend.engine
    client = Scripted([sns_body(ses_event("delivery", provider_id="ses-x"))])
    intake = scripted_intake(engine, client)
    wait_out_the_start(client)
    before = now_of(engine)
    assert intake.step() == 1
    found = the_row(engine)
    assert found.heartbeat_at >= before
    assert found.caught_up_at is None


@pytest.mark.parametrize(
    "failure", ["receive", "database"], ids=["lost-receive-answer", "failed-batch"]
)
def test_no_proof_while_messages_this_process_was_handed_may_be_hidden(
    backend: Backend, failure: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that did not commit, or a receive whose answer was lost, leaves messages
    hidden in SQS unapplied for the visibility timeout: an empty receive meanwhile proves
    nothing."""
    from botocore.exceptions import ReadTimeoutError

    engine = backend.engine
    body = sns_body(ses_event("delivery", provider_id="ses-x"))
    first: list[str] | Exception = (
        ReadTimeoutError(endpoint_url="https://q/1") if failure == "receive" else [body]
    )
    client = Scripted(first)
    intake = scripted_intake(engine, client)
    wait_out_the_start(client)
    if failure == "database":
        import relay.intake.loop as module

        def refuse(*_a: Any, **_kw: Any) -> Any:
            raise sa.exc.OperationalError("apply", {}, Exception("server closed the connection"))

        monkeypatch.setattr(module, "apply_events", refuse)
        with pytest.raises(sa.exc.OperationalError):
            intake.step()
        monkeypatch.undo()
    else:
        with pytest.raises(ReadTimeoutError):
            intake.step()
    assert intake.step() == 0
    assert the_row(engine).caught_up_at is None
    time.sleep(client.visibility + 0.1)
    assert intake.step() == 0
    assert the_row(engine).caught_up_at is not None


def test_without_the_queues_visibility_timeout_nothing_is_written(backend: Backend) -> None:
    intake = Intake(
        engine=backend.engine, client=Scripted(), queue_url="https://q/1", wait_seconds=1
    )
    assert intake.step() == 0  # check_queue never ran
    with backend.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(intakes)).scalar() == 0


def test_against_sqs_the_queue_is_read_and_found_empty(
    backend: Backend, moto: MotoSes, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {**aws_env(moto.url), "AWS_ENDPOINT_URL_SQS": moto.url}.items():
        monkeypatch.setenv(name, value)
    queue = EventQueue(moto)
    queue.send(sns_body(ses_event("delivery", provider_id="ses-y")))
    intake = Intake(
        engine=backend.engine,
        client=build_client(queue.url, wait_seconds=1),
        queue_url=queue.url,
        wait_seconds=1,
    )
    intake.check_queue()
    assert intake.step() == 1
    assert the_row(backend.engine, intake.intake_id).caught_up_at is None
    time.sleep(1.1)  # the queue's visibility timeout, since the process started
    assert intake.step() == 0
    found = the_row(backend.engine, intake.intake_id)
    assert found.caught_up_at is not None
    assert (found.queue_url, found.visibility_timeout) == (queue.url, 1.0)
    assert intake.intake_id.endswith(f"-{os.getpid()}")  # host and pid: the events command


class Counted(Scripted):
    """A scripted client whose queue reports the given counts of waiting messages."""

    def __init__(self, *receives: list[str] | Exception, waiting: tuple[int, int]) -> None:
        super().__init__(*receives)
        self.waiting = waiting
        self.count_reads = 0

    def get_queue_attributes(self, **kw: Any) -> dict[str, Any]:
        if "ApproximateNumberOfMessages" not in kw.get("AttributeNames", ()):
            return super().get_queue_attributes(**kw)
        self.count_reads += 1
        visible, delayed = self.waiting
        return {
            "Attributes": {
                "ApproximateNumberOfMessages": str(visible),
                "ApproximateNumberOfMessagesDelayed": str(delayed),
            }
        }


def busy(n: int) -> list[list[str]]:
    return [[sns_body(ses_event("delivery", provider_id=f"ses-busy-{i}"))] for i in range(n)]


def test_under_steady_traffic_an_empty_count_proves_the_queue_empty_of_older_events(
    backend: Backend,
) -> None:
    """Every receive returns a message, so no long poll ever comes back empty: the queue's
    own counts, when they show nothing waiting, prove it empty of everything older than
    SQS's counting lag."""
    from relay.intake import COUNT_LAG

    engine = backend.engine
    client = Counted(*busy(3), waiting=(0, 0))
    intake = scripted_intake(engine, client)
    wait_out_the_start(client)
    before = now_of(engine)
    assert intake.step() == 1
    after = now_of(engine)
    found = the_row(engine)
    lag = timedelta(seconds=COUNT_LAG)
    assert found.caught_up_at is not None
    assert before - lag <= found.caught_up_at <= after - lag
    assert intake.step() == 1  # within COUNT_INTERVAL: the counts are not read again
    assert client.count_reads == 1


@pytest.mark.parametrize("waiting", [(3, 0), (0, 2)], ids=["visible", "delayed"])
def test_a_count_of_waiting_messages_proves_nothing(
    backend: Backend, waiting: tuple[int, int]
) -> None:
    engine = backend.engine
    client = Counted(*busy(1), waiting=waiting)
    intake = scripted_intake(engine, client)
    wait_out_the_start(client)
    assert intake.step() == 1
    assert client.count_reads == 1
    assert the_row(engine).caught_up_at is None


def test_no_count_is_read_while_messages_this_process_was_handed_may_be_hidden(
    backend: Backend,
) -> None:
    engine = backend.engine
    client = Counted(*busy(1), waiting=(0, 0))
    intake = scripted_intake(engine, client)  # just started: a predecessor's may be hidden
    assert intake.step() == 1
    assert client.count_reads == 0
    assert the_row(engine).caught_up_at is None
