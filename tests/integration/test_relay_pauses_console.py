"""A relay's scoped pauses in its ``outbox_relays`` row and on the console, on SQLite,
PostgreSQL and MariaDB.

A relay runs in this process; the SES one sends through the real ``SesSender`` to moto behind
the fault server, which denies one sending identity (``AccessDeniedException`` naming its
resource, as SES does) until the test lets it send. The row shows the pause with the next
heartbeat (the heartbeat's own UPDATE writes it) and drops it once a probe goes through; the
console's pages read it over HTTP, an address masked for a viewer.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from starlette.testclient import TestClient

from outbox.schema import RelayState, relays
from relay import store
from relay.clock import read_database_time
from relay.config import RelayConfig
from relay.console import Auth, Role, UsersFile, add_user, create_app
from relay.pause import Scope, ScopeKind, identity
from relay.senders import Disabled, Outcome, OutgoingMessage
from relay.senders.ses import SesSender, build_client
from relay.store.relays import PAUSES_CHARS, PAUSES_SHOWN
from relay.testing import FakeSender
from relay.worker import Relay
from tests.support.factories import email, enqueue
from tests.support.relays import message_rows
from tests.support.ses import FaultServer, aws_env
from tests.support.waiting import wait_for

PASSWORD = "correct horse battery"
NONCE = re.compile(r'name="nonce" value="([^"]+)"')
PROMO = "promo@example.com"
MASKED = "p\u2022\u2022\u2022@example.com"  # PROMO as a viewer sees it


@pytest.fixture
def users(tmp_path: Path) -> Path:
    path = tmp_path / "users"
    add_user(path, "olga", Role.OPERATOR, PASSWORD)
    add_user(path, "vic", Role.VIEWER, PASSWORD)
    return path


def signed_in(engine: sa.Engine, users: Path, name: str) -> TestClient:
    """The console over HTTP, signed in as ``name``."""
    app = create_app(engine, auth=Auth(users_file=UsersFile(users)), secure_cookies=False)
    c = TestClient(app, base_url="http://console.test", follow_redirects=False)
    nonce = NONCE.search(c.get("/login").text)
    assert nonce is not None
    done = c.post(
        "/login",
        data={"name": name, "password": PASSWORD, "nonce": nonce.group(1)},
        headers={"Sec-Fetch-Site": "same-origin"},
    )
    assert done.status_code == 303
    return c


def row_pauses(engine: sa.Engine, relay_id: str) -> store.RelayPauses | None:
    """The relay's scoped pauses as its row has them (None: no row yet)."""
    with engine.connect() as conn:
        text = conn.execute(
            sa.select(relays.c.paused_scopes).where(relays.c.relay_id == relay_id)
        ).one_or_none()
    return None if text is None else store.read_pauses(text[0])


def paused_count_cells(page: str) -> list[str]:
    return re.findall(r'<td class="paused-count">([^<]*)</td>', page)


@contextlib.contextmanager
def running(relay: Relay) -> Iterator[threading.Thread]:
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        relay.request_stop()
        thread.join(15)
    assert not thread.is_alive()


class RelayWrites:
    """The UPDATE statements the relay's engine sends to ``outbox_relays``."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.updates: list[str] = []

    def __call__(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("UPDATE OUTBOX_RELAYS"):
            self.updates.append(" ".join(statement.split()))

    def __enter__(self) -> RelayWrites:
        sa.event.listen(self.engine, "before_cursor_execute", self)
        return self

    def __exit__(self, *exc: object) -> None:
        sa.event.remove(self.engine, "before_cursor_execute", self)


def test_a_paused_identity_shows_in_the_relays_row_and_on_the_console_until_it_ends(
    backend, moto, monkeypatch, users
):
    """SES denies promo@: the relay pauses that identity, and its next heartbeat writes the
    pause to its row (kind, name, SES's code, since, next probe), in the heartbeat's own
    UPDATE. The relays page lists it (the address masked for a viewer), the overview counts
    it; once promo@ may send, the probe goes through and the next heartbeat clears the row."""
    moto.verify("shop@example.com")
    moto.verify(PROMO)
    reader = sa.create_engine(backend.url)  # the test's reads are not the relay's
    with FaultServer(moto.url) as ses:
        for name, value in aws_env(ses.url).items():
            monkeypatch.setenv(name, value)
        ses.plan.denied_identities.add(PROMO)
        promo = enqueue(backend.engine, [email(n, short=True, sender=PROMO) for n in range(2)])
        shop = enqueue(backend.engine, [email(n, short=True) for n in range(2, 6)])
        config = RelayConfig(
            database_url=backend.url,
            sender="ses",
            relay_id="pauser",
            poll_interval=0.05,
            send_timeout=3.0,
            lease_seconds=8.0,  # a heartbeat every 2 s
            drain_seconds=5.0,
            pause_seconds=0.5,
        )
        relay = Relay(
            engine=backend.engine,
            sender=SesSender(build_client(send_timeout=3.0, concurrency=4)),
            config=config,
        )
        operator = signed_in(reader, users, "olga")
        viewer = signed_in(reader, users, "vic")
        with RelayWrites(backend.engine) as writes, running(relay):
            shown = wait_for(
                lambda: (p := row_pauses(reader, "pauser")) is not None and p.count and p,
                timeout=15,
                what="the pause in the relay's row",
            )
            assert relay.pauses.paused(Scope(ScopeKind.IDENTITY, PROMO))
            with reader.connect() as conn:
                now = read_database_time(conn)
            assert not shown.unreadable
            (pause,) = shown.scopes
            assert (pause.kind, pause.name, pause.via, pause.code) == (
                "identity",
                PROMO,
                "",
                "AccessDeniedException",
            )
            assert pause.since is not None
            assert now - timedelta(seconds=15) < pause.since <= now + timedelta(seconds=1)
            assert pause.until is None or pause.until < now + timedelta(seconds=3)
            assert wait_for(
                lambda: all(message_rows(reader)[i].status == "sent" for i in shop), timeout=15
            )

            page = operator.get("/relays")
            assert page.status_code == 200
            assert 'id="paused-scopes"' in page.text
            assert PROMO in page.text
            assert "AccessDeniedException" in page.text
            seen = viewer.get("/relays")
            assert seen.status_code == 200
            assert MASKED in seen.text
            assert PROMO not in seen.text
            assert "AccessDeniedException" in seen.text
            overview = viewer.get("/")
            assert overview.status_code == 200
            assert paused_count_cells(overview.text) == ["1"]
            assert PROMO not in overview.text

            ses.plan.denied_identities.clear()  # promo@ may send: the next probe goes through
            wait_for(
                lambda: (p := row_pauses(reader, "pauser")) is not None and p.count == 0,
                timeout=15,
                what="the row without the pause",
            )
            assert not relay.pauses.scopes
            assert wait_for(
                lambda: all(message_rows(reader)[i].status == "sent" for i in promo), timeout=15
            )
            page = operator.get("/relays")
            assert "No relay has a scope paused." in page.text
            assert paused_count_cells(page.text) == ["none"]
        # the pauses ride in the heartbeat's own statement: no UPDATE of the row but the
        # register, the heartbeats and the stop, each writing them
        assert writes.updates
        for statement in writes.updates:
            assert "paused_scopes" in statement, statement
            assert "heartbeat_at" in statement, statement
    assert row_pauses(reader, "pauser") == store.RelayPauses()  # stopped: none
    reader.dispose()


def test_a_storm_of_paused_identities_is_bounded_in_the_row_and_counted_on_the_console(
    backend, users
):
    """A sender denied for every one of 130 From addresses: the relay holds 130 scoped
    pauses; its row lists the first hundred and counts the rest, within its size bound, and
    the console says 130."""
    count = PAUSES_SHOWN + 30

    def answer(m: OutgoingMessage) -> Outcome:
        scope = Scope(ScopeKind.IDENTITY, identity(m.email.sender))
        return Disabled(code="identity_denied", pause=True, scope=scope)

    enqueue(
        backend.engine,
        [email(n, short=True, sender=f"s{n}@storm{n}.example") for n in range(count)],
    )
    config = RelayConfig(
        database_url=backend.url,
        sender="fake",
        relay_id="stormy",
        poll_interval=0.05,
        pause_seconds=60.0,
        send_timeout=2.0,
        lease_seconds=8.0,
        drain_seconds=2.0,
        batch_size=50,
    )
    relay = Relay(engine=backend.engine, sender=FakeSender(answer), config=config)
    with running(relay):
        wait_for(lambda: len(relay.pauses.scopes) == count, timeout=20, what="every pause")
        shown = wait_for(
            lambda: (
                (p := row_pauses(backend.engine, "stormy")) is not None and p.count == count and p
            ),
            timeout=15,
            what="every pause in the row",
        )
        with backend.engine.connect() as conn:
            text = conn.execute(
                sa.select(relays.c.paused_scopes).where(relays.c.relay_id == "stormy")
            ).scalar_one()
        assert len(text) <= PAUSES_CHARS
        assert len(shown.scopes) == PAUSES_SHOWN
        assert shown.more == count - PAUSES_SHOWN
        page = signed_in(backend.engine, users, "olga").get("/relays")
        assert paused_count_cells(page.text) == [str(count)]
        assert f"and {count - PAUSES_SHOWN} more" in page.text


def test_a_row_whose_pauses_cannot_be_read_shows_unreadable_and_the_pages_still_answer(
    backend, users
):
    with backend.engine.begin() as conn:
        now = read_database_time(conn)
        for relay_id, value in (("garbled", '{"scopes": [{"kind'), ("fine", None)):
            conn.execute(
                sa.insert(relays).values(
                    relay_id=relay_id,
                    host="h",
                    pid=1,
                    started_at=now,
                    heartbeat_at=now,
                    state="running",
                    paused_scopes=value,
                )
            )
    for name in ("olga", "vic"):
        c = signed_in(backend.engine, users, name)
        page = c.get("/relays")
        assert page.status_code == 200
        assert sorted(paused_count_cells(page.text)) == ["none", "unreadable"]
        assert '<td>garbled</td><td colspan="6">unreadable</td>' in page.text
        overview = c.get("/")
        assert overview.status_code == 200
        assert sorted(paused_count_cells(overview.text)) == ["none", "unreadable"]


def test_a_relay_taking_over_a_dead_relays_row_starts_without_its_pauses(backend):
    """A relay died with a scope paused (its row keeps them beside its aging heartbeat); the
    relay that takes its id over starts with none, and a clean stop clears its own."""
    text = store.pauses_text([store.PausedScope(kind="identity", name=PROMO, code="denied")])
    with backend.engine.begin() as conn:
        now = read_database_time(conn)
        assert store.register(conn, relay_id="r", host="h1", pid=1, now=now, dead_after=30) is None
        assert store.heartbeat_held(
            conn,
            relay_id="r",
            host="h1",
            pid=1,
            started_at=now,
            now=now,
            state=RelayState.RUNNING,
            pauses=text,
        )
    assert row_pauses(backend.engine, "r") == store.read_pauses(text)
    later = now + timedelta(seconds=60)  # h1 is dead by then
    with backend.engine.begin() as conn:
        taken = store.register(conn, relay_id="r", host="h2", pid=2, now=later, dead_after=30)
        assert taken is None
    assert row_pauses(backend.engine, "r") == store.RelayPauses()
    with backend.engine.begin() as conn:
        assert store.heartbeat_held(
            conn,
            relay_id="r",
            host="h2",
            pid=2,
            started_at=later,
            now=later,
            state=RelayState.RUNNING,
            pauses=text,
        )
        store.stop_held(conn, relay_id="r", host="h2", pid=2, started_at=later, now=later)
    assert row_pauses(backend.engine, "r") == store.RelayPauses()
