"""``outbox-relay suppressions list|add|remove|import`` through the real CLI on SQLite,
PostgreSQL and MariaDB: addresses checked and keyed as the relay compares them, the
operators' log written with each change, and the import of the SES account suppression list.

moto (5.2) does not implement ``ListSuppressedDestinations``, so the import runs against a
small HTTP stand-in that answers it as SES documents it (restJson1, ``NextToken`` paging),
reached by real boto3 through ``AWS_ENDPOINT_URL_SESV2``: the command's client, its paging and
its endpoint variable are the ones production uses.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox.schema import operator_actions, suppressions
from relay.cli import main
from tests.support.ses import aws_env


def cli(backend: Any, *args: str, **env: str) -> Any:
    return CliRunner().invoke(
        main,
        ["suppressions", *args],
        env={"OUTBOX_DATABASE_URL": backend.url, "OUTBOX_ACTOR": "ops", **env},
        catch_exceptions=False,
    )


def suppressed(engine: sa.Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        return {r.address: r for r in conn.execute(sa.select(suppressions))}


def log_rows(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(operator_actions).order_by(operator_actions.c.id)))


def test_add_keys_addresses_as_the_relay_compares_them_and_logs_each(backend):
    engine = backend.engine
    done = cli(
        backend, "add", "Bob <Bob@Example.COM>", "carol@example.com", "BOB@example.com",
        "--reason", "asked to stop by phone",
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    assert done.output == "suppressed 2 address(es)\n"
    rows = suppressed(engine)
    assert sorted(rows) == ["bob@example.com", "carol@example.com"]
    bob = rows["bob@example.com"]
    assert (bob.reason, bob.detail, bob.actor, bob.event_id) == (
        "manual",
        "asked to stop by phone",
        "ops",
        None,
    )
    logged = log_rows(engine)
    assert [(r.action, r.address, r.actor, r.message_id) for r in logged] == [
        ("suppress", "bob@example.com", "ops", None),
        ("suppress", "carol@example.com", "ops", None),
    ]
    assert logged[0].reason == "asked to stop by phone"
    assert json.loads(logged[0].detail)["suppression_reason"] == "manual"
    assert logged[0].at == bob.created_at


def test_add_leaves_an_address_already_suppressed_as_it_is_and_names_it(backend):
    engine = backend.engine
    assert cli(backend, "add", "dan@example.com", "--reason", "first").exit_code == 0
    again = cli(backend, "add", "dan@example.com", "erin@example.com", "--reason", "second")
    assert again.exit_code == 0, again.output
    assert "suppressed 1 address(es)" in again.output
    assert "already suppressed: dan@example.com (manual)" in again.output
    assert suppressed(engine)["dan@example.com"].detail == "first"
    assert [r.address for r in log_rows(engine)] == ["dan@example.com", "erin@example.com"]


@pytest.mark.parametrize("bad", ["not-an-address", "a@b@c", "x@example.com\r\nBcc: y@z.com", ""])
def test_an_invalid_address_stops_add_and_remove_naming_it_and_changes_nothing(backend, bad):
    engine = backend.engine
    assert cli(backend, "add", "kept@example.com", "--reason", "r").exit_code == 0
    for command in (("add", "--reason", "r"), ("remove",)):
        refused = cli(backend, *command, "fine@example.com", bad, "kept@example.com")
        assert refused.exit_code == 2, refused.output
        assert "not an email address" in refused.output
        assert repr(bad) in refused.output
    assert sorted(suppressed(engine)) == ["kept@example.com"]
    assert len(log_rows(engine)) == 1


def test_add_needs_a_reason(backend):
    refused = cli(backend, "add", "a@example.com")
    assert refused.exit_code == 2
    assert "--reason" in refused.output
    assert suppressed(backend.engine) == {}


def test_remove_logs_what_was_removed_and_refuses_an_address_not_suppressed(backend):
    engine = backend.engine
    assert cli(backend, "add", "f@example.com", "g@example.com", "--reason", "r").exit_code == 0
    refused = cli(backend, "remove", "F@example.com", "typo@example.com")
    assert refused.exit_code == 1
    assert "not suppressed: typo@example.com; nothing removed" in refused.output
    assert sorted(suppressed(engine)) == ["f@example.com", "g@example.com"]
    done = cli(backend, "remove", "F@Example.com", "--reason", "confirmed by the customer")
    assert done.exit_code == 0, done.output
    assert sorted(suppressed(engine)) == ["g@example.com"]
    last = log_rows(engine)[-1]
    assert (last.action, last.address, last.reason, last.actor) == (
        "unsuppress",
        "f@example.com",
        "confirmed by the customer",
        "ops",
    )
    detail = json.loads(last.detail)
    assert (detail["suppression_reason"], detail["suppression_detail"]) == ("manual", "r")
    assert detail["suppressed_by"] == "ops"


def test_list_filters_by_reason_and_pages(backend):
    engine = backend.engine
    assert cli(backend, "add", "m1@example.com", "m2@example.com", "--reason", "r").exit_code == 0
    with engine.begin() as conn:
        conn.execute(
            sa.insert(suppressions),
            [
                {
                    "address": "b@example.com",
                    "reason": "bounce",
                    "detail": "Permanent/General",
                    "event_id": 7,
                    "created_at": log_rows(engine)[0].at,
                    "actor": "ses-events",
                }
            ],
        )
    everything = json.loads(cli(backend, "list", "--json").output)
    assert [r["address"] for r in everything] == [
        "b@example.com",
        "m1@example.com",
        "m2@example.com",
    ]
    assert everything[0]["event_id"] == 7
    assert everything[0]["created_at"].endswith("Z")
    bounces = json.loads(cli(backend, "list", "--reason", "bounce", "--json").output)
    assert [r["address"] for r in bounces] == ["b@example.com"]
    page = cli(backend, "list", "--limit", "2")
    assert "... more: --after m1@example.com" in page.output
    rest = json.loads(cli(backend, "list", "--after", "m1@example.com", "--json").output)
    assert [r["address"] for r in rest] == ["m2@example.com"]
    assert cli(backend, "list", "--reason", "complaint").output == "no suppressed addresses match\n"


class _SesSuppressionList(BaseHTTPRequestHandler):
    """``GET /v2/email/suppression/addresses``: the server's pages, one per request, chained
    by ``NextToken``; every request's query recorded."""

    server: Any

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        url = urlparse(self.path)
        query = parse_qs(url.query)
        self.server.requests.append((url.path, query))
        if url.path != "/v2/email/suppression/addresses":
            self._answer(404, {"message": "not here"}, error="NotFoundException")
            return
        token = query.get("NextToken", ["0"])[0]
        index = int(token)
        items, pages = self.server.pages[index], len(self.server.pages)
        body: dict[str, Any] = {
            "SuppressedDestinationSummaries": [
                {"EmailAddress": a, "Reason": r, "LastUpdateTime": 1.7e9} for a, r in items
            ]
        }
        if index + 1 < pages:
            body["NextToken"] = str(index + 1)
        self._answer(200, body)

    def _answer(self, status: int, body: dict[str, Any], error: str | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if error:
            self.send_header("x-amzn-ErrorType", error)
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def ses_list() -> Iterator[Any]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SesSuppressionList)
    server.requests = []
    server.pages = [
        [("Bounced@Example.com", "BOUNCE"), ("spam@example.com", "COMPLAINT")],
        [("kept@example.com", "BOUNCE"), ("not an address", "BOUNCE")],
        [("last@example.com", "COMPLAINT")],
    ]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_import_adds_the_ses_account_list_page_by_page_and_only_what_is_new(backend, ses_list):
    engine = backend.engine
    env = aws_env(f"http://127.0.0.1:{ses_list.server_address[1]}")
    assert cli(backend, "add", "kept@example.com", "--reason", "ours").exit_code == 0
    dry = cli(backend, "import", "--dry-run", "--json", **env)
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.stdout)["would_add"] == 3
    assert sorted(suppressed(engine)) == ["kept@example.com"]
    done = cli(backend, "import", "--json", **env)
    assert done.exit_code == 0, done.output
    assert "skipped, not email addresses: 'not an address'" in done.stderr
    report = json.loads(done.stdout)
    assert {k: report[k] for k in ("listed", "added", "already", "skipped")} == {
        "listed": 5,
        "added": 3,
        "already": 1,
        "skipped": 1,
    }
    rows = suppressed(engine)
    assert {a: (r.reason, r.detail) for a, r in rows.items()} == {
        "bounced@example.com": ("ses", "BOUNCE"),
        "spam@example.com": ("ses", "COMPLAINT"),
        "last@example.com": ("ses", "COMPLAINT"),
        "kept@example.com": ("manual", "ours"),  # already there: left as it was
    }
    imported = [r for r in log_rows(engine) if r.address != "kept@example.com"]
    assert sorted(r.address for r in imported) == sorted(set(rows) - {"kept@example.com"})
    assert {r.action for r in imported} == {"suppress"}
    # boto3 went through the endpoint variable, three pages chained by NextToken
    pages = [q for path, q in ses_list.requests if path == "/v2/email/suppression/addresses"]
    assert [q.get("NextToken") for q in pages[-3:]] == [None, ["1"], ["2"]]
    assert all(q["PageSize"] == ["1000"] for q in pages)
    again = cli(backend, "import", **env)
    assert again.exit_code == 0, again.output
    assert "added 0, 4 already suppressed" in again.output


def test_import_says_in_one_line_when_ses_cannot_be_reached(backend):
    env = aws_env("http://127.0.0.1:9")  # nothing listens on the discard port
    refused = cli(backend, "import", **env)
    assert refused.exit_code == 1
    assert refused.output.startswith("Error: SES: ")
    assert len(refused.output.strip().splitlines()) == 1
    assert suppressed(backend.engine) == {}
