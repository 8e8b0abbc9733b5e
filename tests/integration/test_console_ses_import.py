"""The console's import of the SES account suppression list, over HTTP (Starlette's test
client) on SQLite, PostgreSQL and MariaDB: a dry run shown as a preview, the import on
confirmation logged under the signed-in operator, one-line refusals (no boto3, no region, no
credentials, SES unreachable or slow) within a bounded time, races with a manual add, and the
guards every action has (operators only, CSRF token, fetch-site check).

moto (5.2) implements neither ``ListSuppressedDestinations`` nor
``PutSuppressedDestination`` (both answer 404), so SES is a small HTTP stand-in answering
``GET /v2/email/suppression/addresses`` as SES documents it (restJson1, ``NextToken``
paging), reached by the console's own boto3 client through ``AWS_ENDPOINT_URL_SESV2`` set in
the process environment, as the console process would have it.
"""

from __future__ import annotations

import html
import json
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
import sqlalchemy as sa
from starlette.testclient import TestClient

from outbox.schema import operator_actions, suppressions
from relay.admin.suppressions import SesBounds, add_manual
from relay.console import ses_import
from relay.db import make_engine
from relay.store import operator as ops
from tests.support.console import OUTCOME, SAME, client, csrf_of, login, users_file
from tests.support.ses import AWS_VARIABLES, aws_env

OPERATOR = "olga@example.com"
PREVIEW, IMPORT = "/suppressions/import/preview", "/suppressions/import"
IMPORTED = "imported from the SES account suppression list"


# -- the console ---------------------------------------------------------------------------


@pytest.fixture
def users(tmp_path: Path) -> Path:
    return users_file(tmp_path)


def signed_in(engine: sa.Engine, users: Path, name: str) -> TestClient:
    """A client of a console over ``engine``, signed in as ``name``."""
    c = client(engine, users)
    done = login(c, name)
    assert done.status_code == 303, done.text
    return c


def outcome(page: Any) -> str:
    found = OUTCOME.search(page.text)
    assert found is not None, page.text
    return html.unescape(found.group(1))


def counts(page: Any) -> dict[str, int]:
    """The preview's counts: listed, would-add, already."""
    found = dict(re.findall(r'id="ses-(listed|would-add|already)">([\d,]+)<', page.text))
    assert len(found) == 3, page.text
    return {name: int(n.replace(",", "")) for name, n in found.items()}


def suppressed(engine: sa.Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        return {r.address: r for r in conn.execute(sa.select(suppressions))}


def log_rows(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(operator_actions).order_by(operator_actions.c.id)))


# -- SES -----------------------------------------------------------------------------------


class _SuppressionList(BaseHTTPRequestHandler):
    """``GET /v2/email/suppression/addresses``: the server's pages, one per request, chained
    by ``NextToken``, each answer held ``server.hang`` seconds first; every request's path
    and query recorded."""

    server: Any

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        url = urlparse(self.path)
        query = parse_qs(url.query)
        self.server.requests.append((url.path, query))
        if self.server.hang:
            self.server.released.wait(self.server.hang)  # past the client's read timeout
        if url.path != "/v2/email/suppression/addresses":
            self._answer(404, {"message": "not here"}, error="NotFoundException")
            return
        index = int(query.get("NextToken", ["0"])[0])
        body: dict[str, Any] = {
            "SuppressedDestinationSummaries": [
                {"EmailAddress": a, "Reason": r, "LastUpdateTime": 1.7e9}
                for a, r in self.server.pages[index]
            ]
        }
        if index + 1 < len(self.server.pages):
            body["NextToken"] = str(index + 1)
        self._answer(200, body)

    def _answer(self, status: int, body: dict[str, Any], error: str | None = None) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if error:
                self.send_header("x-amzn-ErrorType", error)
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client gave up waiting (the slow SES test): nobody to answer


@pytest.fixture
def ses_list() -> Iterator[Any]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SuppressionList)
    server.requests = []
    server.hang = 0.0
    server.released = threading.Event()
    server.pages = [
        [("Bounced@Example.com", "BOUNCE"), ("spam@example.com", "COMPLAINT")],
        [("kept@example.com", "BOUNCE"), ("not an address", "BOUNCE")],
        [("last@example.com", "COMPLAINT")],
    ]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.released.set()
    server.shutdown()
    server.server_close()


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Set the console process's AWS environment: ``aws(url, drop=(...))`` sets
    :func:`aws_env` of ``url`` without the variables in ``drop``, and nothing else of the
    machine's AWS chain (every variable cleared first)."""

    def set_env(url: str, *, drop: tuple[str, ...] = ()) -> None:
        for name in AWS_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        for name, value in aws_env(url).items():
            if name not in drop:
                monkeypatch.setenv(name, value)

    return set_env


def closed_port() -> int:
    """A local port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def url_of(server: Any) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


# -- the tests -----------------------------------------------------------------------------


def test_a_dry_run_shows_the_counts_and_the_import_adds_them_under_the_operator(
    engine, users, ses_list, aws
):
    aws(url_of(ses_list))
    c = signed_in(engine, users, OPERATOR)
    page = c.get("/suppressions").text
    assert 'id="ses-import"' in page
    assert f'action="{PREVIEW}"' in page
    token = csrf_of(c, "/suppressions")
    kept = c.post(
        "/suppressions/add",
        data={"csrf": token, "addresses": "kept@example.com", "reason": "ours"},
        headers=SAME,
    )
    assert kept.status_code == 200, kept.text

    preview = c.post(PREVIEW, data={"csrf": token}, headers=SAME)
    assert preview.status_code == 200, preview.text
    assert counts(preview) == {"listed": 5, "would-add": 3, "already": 1}
    assert "Skipped, not email addresses: &#39;not an address&#39;" in preview.text
    for address in ("bounced@example.com", "spam@example.com", "last@example.com"):
        assert f"<li>{address}</li>" in preview.text
    assert f'action="{IMPORT}"' in preview.text
    assert sorted(suppressed(engine)) == ["kept@example.com"]  # a dry run adds nothing
    assert len(log_rows(engine)) == 1
    # boto3 went through the endpoint variable, three pages chained by NextToken
    listed = [q for path, q in ses_list.requests if path == "/v2/email/suppression/addresses"]
    assert [q.get("NextToken") for q in listed] == [None, ["1"], ["2"]]
    assert all(q["PageSize"] == ["1000"] for q in listed)

    done = c.post(IMPORT, data={"csrf": token}, headers=SAME)
    assert done.status_code == 200, done.text
    assert outcome(done) == (
        "SES lists 5 address(es): added 3, 1 already suppressed; "
        "skipped, not email addresses: 'not an address'"
    )
    rows = suppressed(engine)
    assert {a: (r.reason, r.detail, r.actor) for a, r in rows.items()} == {
        "bounced@example.com": ("ses", "BOUNCE", OPERATOR),
        "spam@example.com": ("ses", "COMPLAINT", OPERATOR),
        "last@example.com": ("ses", "COMPLAINT", OPERATOR),
        "kept@example.com": ("manual", "ours", OPERATOR),  # already there: left as it was
    }
    imported = log_rows(engine)[1:]
    assert sorted((r.action, r.address, r.actor, r.reason) for r in imported) == [
        ("suppress", a, OPERATOR, IMPORTED)
        for a in ("bounced@example.com", "last@example.com", "spam@example.com")
    ]
    assert json.loads(imported[0].detail)["suppression_reason"] == "ses"

    again = c.post(IMPORT, data={"csrf": token}, headers=SAME)  # a reload, a second tab
    assert again.status_code == 200, again.text
    assert outcome(again).startswith("SES lists 5 address(es): added 0, 4 already suppressed")
    assert len(log_rows(engine)) == 4
    nothing = c.post(PREVIEW, data={"csrf": token}, headers=SAME)
    assert counts(nothing) == {"listed": 5, "would-add": 0, "already": 4}
    assert f'action="{IMPORT}"' not in nothing.text
    assert "Nothing to import" in nothing.text


def test_without_boto3_a_region_or_credentials_the_import_is_refused_in_one_line(
    engine, users, ses_list, aws, monkeypatch
):
    c = signed_in(engine, users, OPERATOR)
    token = csrf_of(c, "/suppressions")
    url = url_of(ses_list)

    def refused(why: str) -> None:
        for path in (PREVIEW, IMPORT):
            answer = c.post(path, data={"csrf": token}, headers=SAME)
            assert answer.status_code == 409, answer.text
            said = outcome(answer)
            assert said == why, said
            assert "\n" not in said

    aws(url, drop=("AWS_REGION", "AWS_DEFAULT_REGION"))
    refused("no AWS region configured (AWS_REGION or AWS_DEFAULT_REGION)")
    aws(url, drop=("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))
    refused(
        "no AWS credentials found (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
        "or a role)"
    )
    aws(url)
    monkeypatch.setitem(sys.modules, "boto3", None)  # not installed: its import fails
    refused("importing from SES needs boto3: pip install 'sqlalchemy-outbox[ses]'")
    assert ses_list.requests == []
    assert suppressed(engine) == {}
    assert log_rows(engine) == []


def test_an_unreachable_or_slow_ses_is_refused_in_one_line_within_a_bounded_time(
    engine, users, ses_list, aws, monkeypatch
):
    c = signed_in(engine, users, OPERATOR)
    token = csrf_of(c, "/suppressions")
    # the console's own bounds: what a proxy in front of it waits, about a minute
    bounds = ses_import.SES_BOUNDS
    assert bounds.attempts * (bounds.connect + bounds.read) < 60
    assert bounds.total is not None
    assert bounds.total <= 30

    aws(f"http://127.0.0.1:{closed_port()}")  # nothing listens: the connection is refused
    started = time.monotonic()
    unreachable = c.post(IMPORT, data={"csrf": token}, headers=SAME)
    assert time.monotonic() - started < 15  # three attempts, a few seconds of backoff
    assert unreachable.status_code == 409, unreachable.text
    assert outcome(unreachable).startswith("SES: Could not connect to the endpoint URL")

    # SES that accepts and never answers in time: each attempt ends at the read timeout
    monkeypatch.setattr(ses_import, "SES_BOUNDS", SesBounds(connect=1, read=1, attempts=2))
    aws(url_of(ses_list))
    ses_list.hang = 10.0
    started = time.monotonic()
    slow = c.post(PREVIEW, data={"csrf": token}, headers=SAME)
    assert time.monotonic() - started < 6  # 2 attempts of 1 s, at most 1 s between: not 10
    assert slow.status_code == 409, slow.text
    assert outcome(slow).startswith("SES: Read timeout on endpoint URL")
    assert len(ses_list.requests) == 2  # the attempts asked for, no more

    # a list that takes longer than the listing may: stopped between pages, sent to the CLI
    ses_list.hang = 0.0
    monkeypatch.setattr(
        ses_import, "SES_BOUNDS", SesBounds(connect=1, read=1, attempts=1, total=0.0)
    )
    long = c.post(IMPORT, data={"csrf": token}, headers=SAME)
    assert long.status_code == 409, long.text
    assert outcome(long) == (
        "SES: the list took over 0 s to read (2 address(es) so far): import it with "
        "outbox-relay suppressions import"
    )
    assert suppressed(engine) == {}
    assert log_rows(engine) == []


def test_an_import_racing_a_manual_add_counts_the_address_once_as_already_suppressed(
    server_backend, users, ses_list, aws, monkeypatch
):
    """Two races: an operator adds an address between the preview and the confirmation,
    and another commits one after the import's batch read its rows and before it inserts
    (a duplicate key: the batch tries again). The console runs on the engine ``ui`` builds
    (READ COMMITTED on MariaDB)."""
    engine = make_engine(server_backend.url)
    try:
        ses_list.pages = [[(f"{n}@example.com", "BOUNCE") for n in ("a", "b", "c", "d")]]
        aws(url_of(ses_list))
        c = signed_in(engine, users, OPERATOR)
        token = csrf_of(c, "/suppressions")
        preview = c.post(PREVIEW, data={"csrf": token}, headers=SAME)
        assert counts(preview) == {"listed": 4, "would-add": 4, "already": 0}
        manual = c.post(
            "/suppressions/add",
            data={"csrf": token, "addresses": "a@example.com", "reason": "asked"},
            headers=SAME,
        )
        assert manual.status_code == 200, manual.text

        read_rows = ops.suppressed_rows
        raced: list[str] = []
        reads: list[list[str]] = []

        def racing(conn: sa.Connection, addresses: Any) -> dict[str, Any]:
            found = read_rows(conn, addresses)
            reads.append(sorted(found))
            if not raced:  # once: the import's batch read, before it inserts
                raced.append("b@example.com")
                add_manual(engine, raced, reason="by phone", actor="eve")
            return found

        monkeypatch.setattr(ops, "suppressed_rows", racing)
        done = c.post(IMPORT, data={"csrf": token}, headers=SAME)
        assert done.status_code == 200, done.text
        assert raced == ["b@example.com"]
        # the batch read a, the racer b's add read nothing, the batch's insert met b's key
        # and the batch read again, finding both
        assert reads == [["a@example.com"], [], ["a@example.com", "b@example.com"]]
        assert outcome(done) == "SES lists 4 address(es): added 2, 2 already suppressed"
        rows = suppressed(engine)
        assert {a: (r.reason, r.actor) for a, r in rows.items()} == {
            "a@example.com": ("manual", OPERATOR),
            "b@example.com": ("manual", "eve"),
            "c@example.com": ("ses", OPERATOR),
            "d@example.com": ("ses", OPERATOR),
        }
        logged = sorted((r.address, r.actor) for r in log_rows(engine))
        assert logged == [
            ("a@example.com", OPERATOR),
            ("b@example.com", "eve"),
            ("c@example.com", OPERATOR),
            ("d@example.com", OPERATOR),
        ]
    finally:
        engine.dispose()


def test_a_database_error_during_the_import_is_one_line_not_an_error_page(
    engine, users, ses_list, aws, monkeypatch
):
    aws(url_of(ses_list))
    c = signed_in(engine, users, OPERATOR)
    token = csrf_of(c, "/suppressions")

    def gone(conn: sa.Connection, addresses: Any) -> dict[str, Any]:
        lost = Exception("server closed the connection unexpectedly\n\tThis probably means")
        raise sa.exc.OperationalError("SELECT", {}, lost)

    monkeypatch.setattr(ops, "suppressed_rows", gone)
    for path in (PREVIEW, IMPORT):
        failed = c.post(path, data={"csrf": token}, headers=SAME)
        assert failed.status_code == 409, failed.text
        assert outcome(failed) == "database error: server closed the connection unexpectedly"
    assert suppressed(engine) == {}


def test_a_viewer_sees_no_import_form_and_is_refused_the_import(engine, users, ses_list, aws):
    aws(url_of(ses_list))
    viewer = signed_in(engine, users, "vic")
    page = viewer.get("/suppressions").text
    assert 'id="ses-import"' not in page
    assert "/suppressions/import" not in page
    token = csrf_of(viewer, "/")  # the logout form's: a valid token of the viewer's session
    for path in (PREVIEW, IMPORT):
        refused = viewer.post(path, data={"csrf": token}, headers=SAME)
        assert refused.status_code == 403, refused.text
        assert "Only an operator may see this." in refused.text
    assert ses_list.requests == []
    assert suppressed(engine) == {}


def test_an_import_from_another_site_or_without_the_token_is_refused(engine, users, ses_list, aws):
    aws(url_of(ses_list))
    c = signed_in(engine, users, OPERATOR)
    token = csrf_of(c, "/suppressions")
    for path in (PREVIEW, IMPORT):
        for data, headers in (
            ({"csrf": token}, {"Sec-Fetch-Site": "cross-site"}),
            ({"csrf": token}, {"Origin": "https://evil.example"}),  # a browser without Fetch
            ({"csrf": "guessed"}, SAME),
            ({"csrf": ""}, SAME),
            ({"reason": "no token"}, SAME),
        ):
            refused = c.post(path, data=data, headers=headers)
            assert refused.status_code == 403, (path, data, headers)
            assert "Refused: not this site&#39;s form." in refused.text
    assert ses_list.requests == []
    assert suppressed(engine) == {}
    assert log_rows(engine) == []
