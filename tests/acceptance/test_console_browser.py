"""The operator console in a real browser (Debian's chromium through Selenium) on SQLite,
PostgreSQL and MariaDB: logging in, the overview, filtering messages and paging, one
message's timeline and its sandboxed body, a viewer's masked view and refused body, a forged
cross-site POST refused, and the real ``outbox-relay ui`` process refusing to start without
an authentication source and serving a browser once it has one.

With ``OUTBOX_SCREENSHOTS=docs/images`` the run saves the pictures of each page the docs show
(docs/operations/console.md)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from selenium.webdriver.common.by import By
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route

from outbox.schema import messages, operator_actions, relays
from relay import store
from relay.console import Auth, Role, UsersFile, actions, add_user, create_app
from tests.support.browser import LiveServer, chromium, screenshot, wait_until
from tests.support.factories import email, enqueue
from tests.support.relays import RELAY

PASSWORD = "correct horse battery"


@pytest.fixture
def users(tmp_path: Path) -> Path:
    path = tmp_path / "users"
    add_user(path, "olga@example.com", Role.OPERATOR, PASSWORD)
    add_user(path, "vic", Role.VIEWER, PASSWORD)
    return path


@pytest.fixture
def console(backend, users) -> Iterator[LiveServer]:
    """The console mounted under /outbox in an app of its own, as an app mounts it."""
    app = Starlette(
        routes=[
            Mount("/outbox", create_app(backend.engine, auth=Auth(users_file=UsersFile(users))))
        ]
    )
    with LiveServer(app) as server:
        yield server


def log_in(driver, base: str, name: str) -> None:
    driver.get(f"{base}/login")
    driver.find_element(By.ID, "name").send_keys(name)
    driver.find_element(By.ID, "password").send_keys(PASSWORD)
    driver.find_element(By.ID, "login").click()
    wait_until(driver, lambda d: d.find_elements(By.ID, "totals"), message="the overview")


def shown_ids(driver) -> list[int]:
    return [
        int(row.get_attribute("data-id"))
        for row in driver.find_elements(By.CSS_SELECTOR, "tr[data-id]")
    ]


def test_an_operator_logs_in_filters_pages_and_reads_a_timeline(backend, console):
    ids = enqueue(backend.engine, 55, short=True, prefix="order")
    (html_id,) = enqueue(
        backend.engine,
        [
            email(
                99,
                to=["jane.doe@example.com"],
                html='<h1 id="inside">Your order</h1>'
                '<script>parent.document.title="owned"</script>',
            )
        ],
    )
    with backend.engine.begin() as conn:
        conn.execute(
            sa.update(messages)
            .where(messages.c.id.in_(ids[:2]))
            .values(status="failed", last_error_code="MessageRejected", attempt_count=1)
        )
    with backend.engine.begin() as conn:
        now = datetime.now(UTC)
        conn.execute(
            relays.insert().values(
                relay_id="relay-a", host="worker-1", pid=4242, started_at=now, heartbeat_at=now,
                state="running",
                paused_scopes=store.pauses_text([
                    store.PausedScope(
                        kind="identity", name="promo@example.com", code="AccessDenied",
                        since=now - timedelta(minutes=3), until=now + timedelta(seconds=40),
                    )
                ]),
            )
        )  # fmt: skip
    base = f"{console.url}/outbox"
    with chromium() as driver:
        driver.get(f"{base}/login")
        screenshot(driver, "console-login")
        log_in(driver, base, "olga@example.com")
        totals = {
            cell.get_attribute("data-status"): int(cell.text)
            for cell in driver.find_elements(By.CSS_SELECTOR, "#totals td")
        }
        assert totals["pending"] == 54
        assert totals["failed"] == 2
        screenshot(driver, "console-overview")

        driver.find_element(By.LINK_TEXT, "Relays").click()
        wait_until(driver, lambda d: d.find_elements(By.ID, "relays"), message="the relays")
        assert "relay-a" in driver.find_element(By.ID, "relays").text
        assert "promo@example.com" in driver.find_element(By.TAG_NAME, "main").text
        screenshot(driver, "console-relays")
        driver.find_element(By.LINK_TEXT, "Suppressions").click()
        driver.find_element(By.ID, "addresses").send_keys("bounced@example.com")
        driver.find_element(By.ID, "suppress-reason").send_keys("asked to stop")
        driver.find_element(By.ID, "do-suppress").click()
        wait_until(driver, lambda d: d.find_elements(By.ID, "outcome"), message="the outcome")
        assert driver.find_element(By.ID, "outcome").text == "suppressed 1 address(es)"
        driver.get(f"{base}/suppressions")
        assert "bounced@example.com" in driver.find_element(By.ID, "suppressions").text
        screenshot(driver, "console-suppressions")

        driver.find_element(By.LINK_TEXT, "Messages").click()
        wait_until(driver, lambda d: d.find_elements(By.ID, "messages"), message="the list")
        assert shown_ids(driver) == sorted([*ids, html_id], reverse=True)[:50]
        driver.find_element(By.ID, "older").click()
        wait_until(driver, lambda d: "before=" in d.current_url, message="the next page")
        assert shown_ids(driver) == sorted([*ids, html_id], reverse=True)[50:]

        driver.get(f"{base}/messages")
        driver.find_element(By.CSS_SELECTOR, 'input[name="status"][value="failed"]').click()
        driver.find_element(By.ID, "error-code").send_keys("MessageRejected")
        driver.find_element(By.ID, "apply").click()
        wait_until(driver, lambda d: "status=failed" in d.current_url, message="the filter")
        assert shown_ids(driver) == sorted(ids[:2], reverse=True)
        screenshot(driver, "console-messages")

        driver.get(f"{base}/messages/{html_id}")
        assert driver.find_element(By.ID, "recipients").text == "jane.doe@example.com"
        timeline = driver.find_element(By.ID, "timeline").text
        assert "enqueued" in timeline
        frame = driver.find_element(By.ID, "body")
        assert frame.get_attribute("sandbox") == ""
        driver.switch_to.frame(frame)
        assert driver.find_element(By.ID, "inside").text == "Your order"
        driver.switch_to.default_content()
        time.sleep(0.3)  # a script in the body would have run by now
        assert driver.title != "owned"
        screenshot(driver, "console-message")


def test_a_viewer_sees_masked_addresses_and_is_refused_a_body(backend, console):
    (mid,) = enqueue(
        backend.engine, [email(1, to=["jane.doe@example.com"], html="<p>code 4711</p>")]
    )
    base = f"{console.url}/outbox"
    with chromium() as driver:
        log_in(driver, base, "vic")
        driver.get(f"{base}/messages/{mid}")
        assert driver.find_element(By.ID, "recipients").text == "j\u2022\u2022\u2022@example.com"
        assert driver.find_elements(By.ID, "no-body")
        assert "4711" not in driver.page_source
        assert "jane.doe" not in driver.page_source
        driver.get(f"{base}/messages/{mid}/body")
        assert driver.find_element(By.ID, "refused").text == "Only an operator may see this."


def evil_site(target: str) -> Starlette:
    """Another site's page that posts a form to the console as soon as it loads."""

    async def page(request: Request) -> Response:
        return HTMLResponse(
            f'<form id="f" method="post" action="{target}"><input name="csrf" value="guess"></form>'
            '<script>document.getElementById("f").submit()</script>'
        )

    return Starlette(routes=[Route("/", page)])


def test_a_forged_cross_site_post_is_refused_and_the_session_stays(backend, console):
    base = f"{console.url}/outbox"
    with chromium() as driver, LiveServer(evil_site(f"{base}/logout")) as evil:
        log_in(driver, base, "olga@example.com")
        # localhost and 127.0.0.1 are different sites: the browser says cross-site
        driver.get(evil.url.replace("127.0.0.1", "localhost") + "/")
        wait_until(driver, lambda d: "/logout" in d.current_url, message="the forged POST")
        assert "Refused" in driver.find_element(By.TAG_NAME, "h1").text
        driver.get(f"{base}/")
        assert driver.find_elements(By.ID, "totals"), "the forged POST logged the operator out"


def test_the_real_ui_command_refuses_without_auth_then_serves_a_browser(backend, users, tmp_path):
    command = [RELAY, "ui", "--database-url", backend.url]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "Error: the console needs an authentication source: --users-file "
        "(OUTBOX_UI_USERS_FILE; add users with `outbox-relay ui-user add`) or --trusted-header "
        "with --trusted-proxy"
    ]
    with LiveServer(Starlette()) as probe:  # a free port, given back for the real process
        port = probe.port
    env = {**os.environ, "OUTBOX_UI_USERS_FILE": str(users)}
    process = subprocess.Popen(
        [*command, "--port", str(port)], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stderr is not None
        assert process.stderr.readline().strip() == f"console on http://127.0.0.1:{port}/"
        with chromium() as driver:
            deadline = time.monotonic() + 20
            while True:
                try:
                    log_in(driver, f"http://127.0.0.1:{port}", "vic")
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert "vic (viewer)" in driver.find_element(By.TAG_NAME, "header").text
    finally:
        process.terminate()
        process.wait(15)
        if process.stderr is not None:
            process.stderr.close()


def test_a_bulk_requeue_through_its_preview(backend, console):
    ids = enqueue(backend.engine, 8, short=True, prefix="invoice")
    with backend.engine.begin() as conn:
        conn.execute(
            sa.update(messages)
            .where(messages.c.id.in_(ids[:5]))
            .values(status="failed", last_error_code="MessageRejected", attempt_count=3)
        )
    base = f"{console.url}/outbox"
    with chromium() as driver:
        log_in(driver, base, "olga@example.com")
        driver.get(f"{base}/messages?status=failed")
        driver.find_element(By.ID, "bulk-requeue").click()
        wait_until(driver, lambda d: d.find_elements(By.ID, "preview"), message="the preview")
        assert driver.find_element(By.ID, "matched").text == "5"
        assert driver.find_element(By.ID, "chosen").text == "5"
        screenshot(driver, "console-preview")
        driver.find_element(By.ID, "reason").send_keys("SES sandbox lifted")
        driver.find_element(By.ID, "apply").click()
        # the apply answers with its job's page, which reloads itself until the job ends
        wait_until(driver, lambda d: d.find_elements(By.ID, "outcome"), message="the outcome")
        assert "/outbox/actions/jobs/" in driver.current_url
        assert driver.find_element(By.ID, "outcome").text == "requeued 5 message(s)"
    with backend.engine.connect() as conn:
        got = dict(conn.execute(sa.select(messages.c.id, messages.c.status)).all())
    assert [got[i] for i in ids] == ["pending"] * 8


def test_a_bulk_resolve_as_not_delivered_through_its_preview_and_its_job_page(
    backend, console, monkeypatch
):
    """The job is held after its first message (the ``job_step`` seam), so the page is seen
    running, reloading itself, before it reaches its outcome."""
    reached, go = threading.Event(), threading.Event()

    def hold(job: actions.Job) -> None:
        if not reached.is_set():
            reached.set()
            go.wait(30)

    monkeypatch.setattr(actions, "job_step", hold)
    ids = enqueue(backend.engine, 6, short=True, prefix="receipt")
    with backend.engine.begin() as conn:
        conn.execute(
            sa.update(messages).where(messages.c.id.in_(ids[:4])).values(status="unknown_outcome")
        )
        conn.execute(sa.update(messages).where(messages.c.id.in_(ids[4:])).values(status="sent"))
    base = f"{console.url}/outbox"
    try:
        with chromium() as driver:
            log_in(driver, base, "olga@example.com")
            driver.get(f"{base}/messages?key=receipt:*")
            driver.find_element(By.ID, "bulk-resolve-not-delivered").click()
            wait_until(driver, lambda d: d.find_elements(By.ID, "preview"), message="the preview")
            assert driver.find_element(By.ID, "matched").text == "6"
            assert driver.find_element(By.ID, "chosen").text == "4"
            skipped = driver.find_element(By.CSS_SELECTOR, '#skipped tr[data-status="sent"]')
            assert skipped.text == "2 sent already sent"
            driver.find_element(By.ID, "reason").send_keys("SES says they bounced")
            driver.find_element(By.ID, "apply").click()
            wait_until(driver, lambda d: d.find_elements(By.ID, "running"), message="the job")
            assert reached.wait(10)
            wait_until(
                driver,
                lambda d: (
                    d.find_element(By.ID, "progress").text == "resolved 1 of 4 message(s)\u2026"
                ),
                message="the partial count",
            )
            screenshot(driver, "console-job")
            go.set()
            wait_until(
                driver, lambda d: d.find_elements(By.ID, "outcome"), message="the page reloaded"
            )
            assert driver.find_element(By.ID, "outcome").text == (
                "resolved 4 message(s) as not delivered (requeued)"
            )
            assert driver.find_element(By.ID, "progress").text == "resolved 4 of 4 message(s)"
    finally:
        go.set()
    with backend.engine.connect() as conn:
        got = dict(conn.execute(sa.select(messages.c.id, messages.c.status)).all())
        actors = conn.execute(sa.select(operator_actions.c.actor, operator_actions.c.action)).all()
    assert [got[i] for i in ids] == ["pending"] * 4 + ["sent"] * 2
    assert sorted(tuple(a) for a in actors) == [("olga@example.com", "resolve_not_delivered")] * 4


def test_a_viewer_is_offered_no_action_and_refused_one(backend, console):
    (mid,) = enqueue(backend.engine, [email(1)])
    base = f"{console.url}/outbox"
    with chromium() as driver:
        log_in(driver, base, "vic")
        driver.get(f"{base}/messages/{mid}")
        assert not driver.find_elements(By.ID, "actions")
        driver.get(f"{base}/messages")
        assert not driver.find_elements(By.ID, "bulk-cancel")
        driver.get(f"{base}/actions/preview?action=cancel")
        assert driver.find_element(By.ID, "refused").text == "Only an operator may see this."


def test_the_overview_counts_update_live_and_stop_while_the_tab_is_hidden(backend, users):
    app = create_app(backend.engine, auth=Auth(users_file=UsersFile(users)))
    pages = app.app.state.pages
    with LiveServer(app) as server, chromium() as driver:
        log_in(driver, server.url, "vic")
        wait_until(driver, lambda d: pages.streams == 1, message="the live stream")
        enqueue(backend.engine, 3, short=True)
        wait_until(
            driver,
            lambda d: d.find_element(By.CSS_SELECTOR, 'td[data-status="pending"]').text == "3",
            timeout=15,
            message="the pending count updated without a reload",
        )
        overview = driver.current_window_handle
        driver.switch_to.new_window("tab")  # the overview's tab is hidden now
        driver.get(f"{server.url}/relays")
        wait_until(driver, lambda d: pages.streams == 0, message="the hidden tab's stream closed")
        driver.switch_to.window(overview)
        driver.execute_cdp_cmd("Page.bringToFront", {})
        wait_until(driver, lambda d: pages.streams == 1, message="the stream back once visible")


def test_on_postgresql_a_commit_that_enqueues_wakes_the_live_counts(
    postgres_backend, users, monkeypatch
):
    """With the poll a minute away, only the NOTIFY of the enqueue's commit can bring the
    new count to the page within the wait."""
    from relay.console import views

    monkeypatch.setattr(views, "LIVE_SECONDS", 60.0)
    app = create_app(postgres_backend.engine, auth=Auth(users_file=UsersFile(users)))
    pages = app.app.state.pages
    with LiveServer(app) as server, chromium() as driver:
        log_in(driver, server.url, "vic")
        wait_until(driver, lambda d: pages.wake.listening, message="the listener")
        time.sleep(1.0)  # the first poll's answer is in; the next is a minute away
        enqueue(postgres_backend.engine, 2, short=True)
        wait_until(
            driver,
            lambda d: d.find_element(By.CSS_SELECTOR, 'td[data-status="pending"]').text == "2",
            timeout=20,
            message="the count woken by the NOTIFY",
        )
    deadline = time.monotonic() + 10
    while pages.wake.listening and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pages.wake.listening  # the last stream closed: the listener stopped
