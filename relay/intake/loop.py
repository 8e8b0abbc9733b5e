"""The SQS loop of one intake replica (:class:`Intake`): receive (long poll) -> parse ->
apply -> commit -> delete what committed, then the deferred events. A database error deletes
nothing (the messages come back after their visibility timeout); an SQS error is logged and
retried after a jittered backoff. Each pass also writes the replica's heartbeat, and the proof
that it found its queue empty, to ``outbox_intakes``: the reconcile sweep reads them."""

from __future__ import annotations

import collections
import logging
import os
import random
import socket
import threading
import time
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from outbox.exceptions import ConfigurationError
from outbox.schema import RelayState
from relay.clock import read_database_time
from relay.db import retry_delay
from relay.events import parse
from relay.intake.apply import ACTOR, apply_events, check_topic_arn
from relay.intake.deferred import apply_deferred
from relay.intake.outcome import announce
from relay.intake.queue import QueueInfo, count_waiting, delete_messages, read_queue
from relay.store import BEAT_BEFORE_RECEIVE
from relay.store import events as event_sql
from relay.store.events import Effect

__all__ = [
    "COUNT_INTERVAL",
    "COUNT_LAG",
    "DEFERRED_INTERVAL",
    "MAX_MESSAGES",
    "Intake",
    "default_intake_id",
]

_log = logging.getLogger("relay.intake")

MAX_MESSAGES = 10  # per ReceiveMessage: SQS's most
COUNT_INTERVAL = 10.0  # seconds: while receives return messages, how often the counts are read
# SQS's message counts are approximate and may lag what the queue holds by a minute; a count
# of none proves the queue empty of everything older than this (seconds, with a margin).
COUNT_LAG = 300.0
DEFERRED_INTERVAL = 5.0  # seconds: while batches keep coming, the deferred pass's least gap


def default_intake_id() -> str:
    """An ``outbox-relay events`` process's id in ``outbox_intakes``: its host and pid."""
    return f"{socket.gethostname()}-{os.getpid()}"


class Intake:
    """The loop of one intake replica: ``run()`` until :meth:`request_stop` (or, with
    ``exit_when_idle``, until a receive comes back empty). Any number of replicas may share a
    queue and a database.

    ``client`` is a boto3 SQS client (:func:`relay.intake.queue.build_client`). ``intake_id``
    names the replica's ``outbox_intakes`` row (the relay's id when it runs in a relay; by
    default the host and pid): each pass writes its heartbeat there, and ``caught_up_at``
    when a long poll found the queue empty (see :meth:`step`); nothing is written before the
    queue's visibility timeout is known (:meth:`check_queue`). Counters for the metrics:
    :attr:`counts` (``(type, effect)``: events, a deferred one counted again with the effect
    it had once applied), :attr:`errors` (``sqs``, ``database``). With ``topic_arn``, only
    that SNS topic's events (or its account's, through EventBridge) are applied
    (:func:`relay.intake.apply.foreign_origin`); without, every event is."""

    def __init__(
        self,
        *,
        engine: sa.Engine,
        client: Any,
        queue_url: str,
        wait_seconds: int = 20,
        exit_when_idle: bool = False,
        actor: str = ACTOR,
        rng: random.Random | None = None,
        intake_id: str | None = None,
        topic_arn: str | None = None,
    ) -> None:
        self.engine = engine
        self.topic_arn = None if topic_arn is None else check_topic_arn(topic_arn)
        self.intake_id = intake_id if intake_id is not None else default_intake_id()
        self.client = client
        self.queue_url = queue_url
        self.wait_seconds = wait_seconds
        self.exit_when_idle = exit_when_idle
        self.actor = actor
        self._rng = rng if rng is not None else random.Random()
        self._stopping = threading.Event()
        self._failures = 0  # consecutive failed passes
        self.queue: QueueInfo | None = None  # read by check_queue
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.loop_at: float | None = None  # monotonic time of the loop's last pass
        self.waiting_at: float | None = None
        self.started_at: datetime | None = None  # the database's clock at the first heartbeat
        # monotonic time since which every message SQS handed this process was applied (or
        # left on the queue as not an event); until a visibility timeout after it, messages
        # this process (or the one before it under this id) took may still be hidden in SQS
        self._settled_since = time.monotonic()
        self._deferred_at = -float("inf")  # monotonic time of the last deferred pass
        self._counted_at = -float("inf")  # monotonic time the queue's counts were last read
        # monotonic time just before the database's clock was read for the last committed
        # heartbeat (None before the first)
        self._beat_at: float | None = None

    def request_stop(self) -> None:
        """Stop after the batch in hand (a long poll in progress ends within
        ``wait_seconds``). Thread/signal-safe."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    # what /healthz and /readyz read (the relay's names): the intake is never paused
    paused = False
    pause_code = None

    @property
    def state(self) -> RelayState:
        return RelayState.DRAINING if self._stopping.is_set() else RelayState.RUNNING

    def check_queue(self) -> QueueInfo:
        """Read the queue's redrive policy and visibility timeout
        (:func:`relay.intake.queue.read_queue`: a queue that does not exist or cannot be
        read is a :class:`ConfigurationError`, one without a redrive policy a warning)."""
        self.queue = read_queue(self.client, self.queue_url)
        return self.queue

    def run(self) -> None:
        """Receive and apply until stopped; never raises for SQS or database errors (they are
        logged and retried after a jittered backoff)."""
        from botocore.exceptions import BotoCoreError, ClientError

        _log.info(
            "event intake started", extra={"action": "intake_started", "queue": self.queue_url}
        )
        try:
            while not self._stopping.is_set():
                self.loop_at = time.monotonic()
                try:
                    if self.queue is None:
                        self.check_queue()
                    received = self.step()
                except (BotoCoreError, ClientError) as exc:
                    self._failed("sqs", exc)
                    continue
                except sa.exc.DBAPIError as exc:
                    self._failed("database", getattr(exc, "orig", None) or exc)
                    continue
                except ConfigurationError as exc:  # the queue was deleted while running
                    self._failed("sqs", exc)
                    continue
                self._failures = 0
                if received == 0 and self.exit_when_idle:
                    _log.info("queue empty, exiting", extra={"action": "idle_exit"})
                    break
        finally:
            self.loop_at = None
            _log.info("event intake stopped", extra={"action": "intake_stopped"})

    def _failed(self, kind: str, exc: BaseException) -> None:
        self._failures += 1
        self.errors[kind] += 1
        delay = self.backoff()
        _log.warning(
            "%s error: %s; retrying in %.1fs",
            "SQS" if kind == "sqs" else kind,
            exc,
            delay,
            extra={"action": f"intake_{kind}_error", "failures": self._failures},
        )
        self._stopping.wait(delay)

    def backoff(self) -> float:
        """Jittered exponential, 0.5 s to 30 s: replicas failing together do not retry in
        step."""
        return retry_delay(self._failures, self._rng)

    def step(self) -> int:
        """One pass: receive up to :data:`MAX_MESSAGES` (long poll), apply them in one
        transaction, commit, delete the ones whose effect committed, send the signals; then
        apply the deferred events whose row is no longer being sent (:func:`apply_deferred`,
        its own transaction). The number received. An SQS error on the receive or a database
        error raises, and nothing is deleted; a failed delete only means those messages come
        again (and are then duplicates).

        The replica's ``outbox_intakes`` row gets its heartbeat each pass and, after a long
        poll (``wait_seconds`` >= 1: a short poll samples only some of SQS's servers) that
        returned nothing, ``caught_up_at``: the database's clock right after it, so no event
        was visible in the queue until then. Not while messages this process was handed may
        still be hidden unapplied (a failed batch, an event the database refused, a receive
        whose answer was lost, the process's start): until the queue's visibility timeout
        has passed since.

        Each receive names the visibility timeout read at start (:meth:`check_queue`): a
        setting raised on the queue since cannot hide a message this replica took longer
        than its row says. And the reconcile sweep asks every replica of the queue, and
        bounds when a dead one may last have taken a message by its heartbeat: so a replica
        beats before its first receive, and before any that would start more than
        :data:`relay.store.BEAT_BEFORE_RECEIVE` seconds after its last heartbeat's reading."""
        visibility = None if self.queue is None else self.queue.visibility_timeout
        if visibility is not None and (
            self._beat_at is None or time.monotonic() - self._beat_at >= BEAT_BEFORE_RECEIVE
        ):
            self._beat(caught_up=False)
        request: dict[str, Any] = {
            "QueueUrl": self.queue_url,
            "MaxNumberOfMessages": MAX_MESSAGES,
            "WaitTimeSeconds": self.wait_seconds,
        }
        if visibility is not None:
            request["VisibilityTimeout"] = visibility
        try:
            answer = self.client.receive_message(**request)
        except BaseException:
            self._unsettled()  # SQS may have handed out messages on the lost answer
            raise
        received = answer.get("Messages") or []
        if received:
            self._apply_received(received)
            self._check_emptied()
        else:
            self._beat(caught_up=self._caught_up())
        if received and time.monotonic() - self._deferred_at < DEFERRED_INTERVAL:
            return len(received)  # busy: the deferred events wait a few seconds more
        self._deferred_at = time.monotonic()
        with self.engine.begin() as conn:
            deferred = apply_deferred(conn, now=read_database_time(conn), actor=self.actor)
        for result in deferred:
            self.counts[(result.event.type.value, result.effect.value)] += 1
        announce(self, deferred)
        return len(received)

    def _apply_received(self, received: list[dict[str, Any]]) -> None:
        parsed = [parse(str(m.get("Body", ""))) for m in received]
        try:
            with self.engine.begin() as conn:
                read_at = time.monotonic()
                now = read_database_time(conn)
                applied = apply_events(
                    conn,
                    parsed,
                    now=now,
                    actor=self.actor,
                    intake_id=self.intake_id,
                    topic_arn=self.topic_arn,
                )
                self._record(conn, now, caught_up=False)
        except BaseException:
            self._unsettled()
            raise
        self._beat_at = read_at
        if any(result.effect is Effect.REFUSED for result in applied):
            self._unsettled()
        for result in applied:
            self.counts[(result.event.type.value, result.effect.value)] += 1
        handles = [
            m["ReceiptHandle"] for m, result in zip(received, applied, strict=True) if result.delete
        ]
        if not delete_messages(self.client, self.queue_url, handles):
            self.errors["sqs"] += 1
        announce(self, applied)

    def _unsettled(self) -> None:
        self._settled_since = time.monotonic()

    def _caught_up(self) -> bool:
        """Whether an empty receive just now proves the queue held no event this replica
        could see: a long poll, and nothing handed to this process may still be hidden (each
        receive names this replica's visibility timeout, so the queue's setting, changed
        since, does not decide how long)."""
        visibility = None if self.queue is None else self.queue.visibility_timeout
        return (
            self.wait_seconds >= 1
            and visibility is not None
            and time.monotonic() - self._settled_since >= visibility
        )

    def _check_emptied(self) -> None:
        """Under steady traffic a long poll never comes back empty, and the reconcile sweep
        would never see a proof. So while receives keep returning messages, every
        :data:`COUNT_INTERVAL` seconds the queue's own counts are read: none visible and
        none delayed means no event older than SQS's counting lag was still waiting, and
        ``caught_up_at`` is set :data:`COUNT_LAG` seconds before the reading. A count that
        cannot be read proves nothing."""
        if time.monotonic() - self._counted_at < COUNT_INTERVAL or not self._caught_up():
            return
        self._counted_at = time.monotonic()
        waiting = count_waiting(self.client, self.queue_url)
        if waiting is None or waiting:
            return
        with self.engine.begin() as conn:
            read_at = time.monotonic()
            now = read_database_time(conn)
            lag = timedelta(seconds=COUNT_LAG)
            self._record(conn, now, caught_up=True, empty_since=now - lag)
        self._beat_at = read_at

    def _beat(self, *, caught_up: bool) -> None:
        with self.engine.begin() as conn:
            read_at = time.monotonic()
            self._record(conn, read_database_time(conn), caught_up=caught_up)
        self._beat_at = read_at

    def _record(
        self,
        conn: sa.Connection,
        now: datetime,
        *,
        caught_up: bool,
        empty_since: datetime | None = None,
    ) -> None:
        visibility = None if self.queue is None else self.queue.visibility_timeout
        if visibility is None:
            return  # check_queue has not read it: the row would prove nothing
        if self.started_at is None:
            self.started_at = now
        event_sql.record_intake(
            conn,
            intake_id=self.intake_id,
            queue_url=self.queue_url,
            visibility_timeout=visibility,
            started_at=self.started_at,
            now=now,
            caught_up=caught_up,
            empty_since=empty_since,
        )
