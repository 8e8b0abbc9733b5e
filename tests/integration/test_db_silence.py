"""A MariaDB connection that goes silent: the server (or the network, or a proxy) keeps the TCP
connection open and never answers. The MySQL drivers bound only the TCP connect, so without
``relay.db.make_engine``'s read timeout a relay waits on such a connection forever: its loop
stops (no sweep, no heartbeat, no saving of finished sends) and a SIGTERM never drains.

The silence comes from :class:`SilentProxy`, a TCP proxy in front of the real server; the
tests read and write the database directly, never through it."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox.schema import relays
from relay import cli, store
from relay.cli_options import open_database, open_engine
from relay.db import READ_TIMEOUT, make_engine
from relay.testing import FakeSender
from tests.support.db import Backend, emptied, statuses
from tests.support.factories import enqueue
from tests.support.inprocess import relay_for, running
from tests.support.relays import Relays
from tests.support.waiting import wait_for


@pytest.fixture
def mysql_backend(_backends: dict[str, Backend]) -> Iterator[Backend]:
    """MariaDB only: the read timeout is what its drivers lack."""
    yield from emptied(_backends["mysql"])


class SilentProxy:
    """Forwards 127.0.0.1:``port`` to the database server until :meth:`silence`: from then on
    every open connection stays open and is never answered (what the client sends is read
    and dropped), and a new one is accepted and never answered (no handshake). :meth:`speak`
    resets the silenced connections (their stream is broken) and forwards new ones again."""

    def __init__(self, url: str) -> None:
        target = sa.make_url(url)
        self.target = target
        self._upstream = (target.host or "127.0.0.1", target.port or 3306)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.port = self._listener.getsockname()[1]
        self._silent = threading.Event()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.accepted_silently = 0
        self._thread = threading.Thread(target=self._accept, name="silent-proxy", daemon=True)

    def url(self, **query: str) -> str:
        return (
            self.target.set(host="127.0.0.1", port=self.port)
            .update_query_dict(query)
            .render_as_string(hide_password=False)
        )

    def __enter__(self) -> SilentProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self._thread.join(5)
        self._listener.close()
        self._reset_all()

    def silence(self) -> None:
        self._silent.set()

    def speak(self) -> None:
        with self._lock:
            self._silent.clear()
        self._reset_all()

    def _reset_all(self) -> None:
        with self._lock:
            doomed, self._sockets = self._sockets, []
        for sock in doomed:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                continue
            client.settimeout(None)
            with self._lock:
                self._sockets.append(client)
                silent = self._silent.is_set()
            if silent:  # accepted, never answered
                self.accepted_silently += 1
                threading.Thread(target=self._drain, args=(client,), daemon=True).start()
                continue
            try:
                server = socket.create_connection(self._upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._sockets.append(server)
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if not self._silent.is_set():
                    dst.sendall(data)

    @staticmethod
    def _drain(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while sock.recv(65536):
                pass


def cparams_of(engine: sa.Engine) -> dict[str, object]:
    """The keyword arguments ``engine`` hands its driver, read as it connects for real."""
    seen: dict[str, object] = {}

    @sa.event.listens_for(engine, "do_connect")
    def capture(dialect, conn_rec, cargs, cparams):
        seen.update(cparams)

    with engine.connect() as conn:
        conn.exec_driver_sql("SELECT 1")
    sa.event.remove(engine, "do_connect", capture)
    return seen


def test_the_relays_engine_bounds_every_read_and_an_operators_does_not(mysql_backend):
    """``make_engine`` (what ``outbox-relay run`` and ``events`` open) gives PyMySQL a read and
    a write timeout; the engine of an operator's command and of ``migrate`` none (a long
    prune or ALTER is not a silent server); a URL's own values win."""
    url = mysql_backend.url
    relay_engine = make_engine(url)
    operator = open_database(url)
    own = sa.make_url(url).update_query_dict({"read_timeout": "7"})
    tuned = open_engine(own.render_as_string(hide_password=False), read_timeout=READ_TIMEOUT)
    try:
        relay_params = cparams_of(relay_engine)
        assert (relay_params["read_timeout"], relay_params["write_timeout"]) == (
            READ_TIMEOUT,
            READ_TIMEOUT,
        )
        with relay_engine.connect() as conn:
            assert conn.connection.dbapi_connection._read_timeout == READ_TIMEOUT
        operator_params = cparams_of(operator)
        assert "read_timeout" not in operator_params
        assert "write_timeout" not in operator_params
        tuned_params = cparams_of(tuned)
        assert (tuned_params["read_timeout"], tuned_params["write_timeout"]) == (7, READ_TIMEOUT)
    finally:
        for engine in (relay_engine, operator, tuned):
            engine.dispose()


def test_the_run_command_opens_the_relays_engine(mysql_backend, monkeypatch):
    """``outbox-relay run`` opens its engine with the read timeout (an operator's command, as
    above, without)."""
    opened: list[sa.Engine] = []

    def recording(url: str, *, read_timeout: float | None = None) -> sa.Engine:
        engine = open_engine(url, read_timeout=read_timeout)
        opened.append(engine)
        return engine

    monkeypatch.setattr(cli, "open_engine", recording)
    result = CliRunner().invoke(
        cli.main,
        ["run", "--database-url", mysql_backend.url, "--sender", "console", "--exit-when-idle"],
    )
    assert result.exit_code == 0, result.output
    (engine,) = opened
    try:
        assert cparams_of(engine)["read_timeout"] == READ_TIMEOUT
    finally:
        engine.dispose()


def test_a_server_that_accepts_and_never_sends_its_handshake_does_not_hold_the_loop(
    mysql_backend,
):
    """Each connection attempt to a server that accepts and never answers gives up after the
    read timeout, and the loop goes on backing off (and stops when asked)."""
    with SilentProxy(mysql_backend.url) as proxy:
        proxy.silence()
        engine = make_engine(proxy.url(), read_timeout=1.0)
        relay = relay_for(None, FakeSender(), engine=engine, url=proxy.url())
        thread = threading.Thread(target=relay.run, name="relay-db-silent", daemon=True)
        thread.start()
        try:
            wait_for(
                lambda: proxy.accepted_silently >= 3,
                timeout=15,
                what="three connection attempts, each given up after the read timeout",
            )
        finally:
            relay.request_stop()
            thread.join(10)
            engine.dispose()
        assert not thread.is_alive(), "the relay never stopped: stuck on the silent server"


def test_a_connection_that_goes_silent_mid_run_costs_a_reconnect_and_sends_nothing_twice(
    mysql_backend,
):
    """The relay's loop connection goes silent while mail flows: its statement gives up after
    the read timeout, the loop backs off and keeps trying (never stuck: ``loop_at`` moves),
    and once the database answers again every message is sent, once."""
    backend = mysql_backend
    first = enqueue(backend.engine, 5)
    with SilentProxy(backend.url) as proxy:
        engine = make_engine(proxy.url(), read_timeout=1.0)
        sender = FakeSender()
        relay = relay_for(None, sender, engine=engine, url=proxy.url(), relay_id="silenced")
        try:
            with running(relay):
                wait_for(
                    lambda: Counter(statuses(backend.engine).values()) == {"sent": 5},
                    what="the first five",
                )
                proxy.silence()
                failures_before = relay.connection.failures
                second = enqueue(backend.engine, 5)  # written directly, not through the proxy
                wait_for(
                    lambda: relay.connection.failures >= failures_before + 2,
                    timeout=10,
                    what="the silent connection given up, twice",
                )
                loop_at = relay.loop_at
                wait_for(
                    lambda: relay.loop_at is not None and relay.loop_at != loop_at,
                    timeout=10,
                    what="the loop to go on while the database is silent",
                )
                proxy.speak()
                wait_for(
                    lambda: Counter(statuses(backend.engine).values()) == {"sent": 10},
                    timeout=20,
                    what="every message sent once the database answers",
                )
        finally:
            engine.dispose()
    sends = Counter(sender.called_ids)
    assert sorted(sends) == sorted([*first, *second])
    assert set(sends.values()) == {1}


def test_a_sigterm_while_the_database_is_silent_drains_and_exits(mysql_backend, tmp_path: Path):
    """``outbox-relay run`` whose database goes silent is asked to stop: it exits 0 within its
    drain bound plus a few read timeouts, instead of waiting for an answer forever. The URL's
    ``read_timeout`` and ``write_timeout`` set the bound (2 s here, against 30 s unset)."""
    backend = mysql_backend
    enqueue(backend.engine, 3)
    with SilentProxy(backend.url) as proxy:
        url = proxy.url(read_timeout="2", write_timeout="2")
        fleet = Relays(url=url, workdir=tmp_path, record=tmp_path / "sent.log")
        try:
            proc = fleet.start(
                *("--poll-interval", "0.2", "--send-timeout", "1", "--lease-seconds", "5"),
                *("--drain-seconds", "3"),
                name="silenced",
            )
            wait_for(
                lambda: Counter(statuses(backend.engine).values()) == {"sent": 3},
                timeout=30,
                what="three sent",
            )
            proxy.silence()
            time.sleep(0.5)  # its next statement is under way, unanswered
            began = time.monotonic()
            proc.popen.terminate()
            code = proc.wait(3 + 4 * 2 + 5)
            took = time.monotonic() - began
        finally:
            fleet.kill_all()
    assert code == 0, proc.output()[-3000:]
    assert took < 3 + 4 * 2 + 5
    assert set(fleet.deliveries().values()) == {1}
    assert len(fleet.deliveries()) == 3


def test_a_register_whose_commit_the_relay_did_not_see_is_taken_as_its_own(
    server_backend, monkeypatch
):
    """The COMMIT of the relay's register applies, but the relay sees an error (a read timeout
    or a lost connection at COMMIT). Its next heartbeat finds a live row under its id, with its
    own host and pid: that row is its own (the started_at it wrote), taken over, not another
    relay's. Before, the relay stopped itself ("taken over by a relay on host ... (pid <its
    own>)") and left the row marked running, so a restart was refused for three heartbeats."""
    backend = server_backend
    ids = enqueue(backend.engine, 3)
    engine = make_engine(backend.url)
    armed: set[int] = set()
    fired: list[str] = []
    register = store.register

    def registering(conn: sa.Connection, **kw: Any) -> Any:
        holder = register(conn, **kw)
        if not fired and holder is None:
            armed.add(id(conn.connection))  # what do_commit is handed
        return holder

    commit = engine.dialect.do_commit

    def lost_after_commit(dbapi_connection: Any) -> None:
        commit(dbapi_connection)
        if id(dbapi_connection) in armed:
            armed.clear()
            fired.append("register")
            raise engine.dialect.loaded_dbapi.OperationalError("lost at COMMIT (test)")

    monkeypatch.setattr(store, "register", registering)
    monkeypatch.setattr(engine.dialect, "do_commit", lost_after_commit)
    sender = FakeSender()
    relay = relay_for(None, sender, engine=engine, url=backend.url, relay_id="unseen-register")
    try:
        with running(relay):
            wait_for(
                lambda: Counter(statuses(backend.engine).values()) == {"sent": 3},
                what="every message sent",
            )
            time.sleep(3 * relay.config.heartbeat_interval)  # heartbeats after the register
            assert fired == ["register"]
            assert not relay._stopping.is_set(), "the relay took its own row for another's"
            with backend.engine.connect() as conn:
                row = conn.execute(
                    sa.select(relays.c.host, relays.c.pid, relays.c.state).where(
                        relays.c.relay_id == "unseen-register"
                    )
                ).one()
            assert (row.host, row.pid, row.state) == (socket.gethostname(), os.getpid(), "running")
    finally:
        engine.dispose()
    assert sorted(sender.called_ids) == sorted(ids)
    with backend.engine.connect() as conn:
        state = conn.execute(
            sa.select(relays.c.state).where(relays.c.relay_id == "unseen-register")
        ).scalar_one()
    assert state == "stopped"
