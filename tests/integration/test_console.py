"""The operator console over HTTP (Starlette's test client) on SQLite, PostgreSQL and MariaDB:
locked by default, its sessions, CSRF and fetch-site checks, the login throttle, what each
role sees, and its pages read through the store. The real browser's tests are in
tests/acceptance/test_console_browser.py."""

from __future__ import annotations

import ipaddress
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from starlette.testclient import TestClient

from outbox.exceptions import ConfigurationError
from outbox.schema import messages, operator_actions, suppressions
from relay.cli import main
from relay.console import Auth, Role, UsersFile, add_user, create_app, remove_user
from relay.console.guard import CONTENT_SECURITY_POLICY, SESSION_COOKIE
from tests.support.console import (
    CSRF,
    HIDDEN,
    NONCE,
    OUTCOME,
    PASSWORD,
    SAME,
    client,
    csrf_of,
    finished_job,
    login,
)
from tests.support.factories import email, enqueue


@pytest.fixture
def users(tmp_path: Path) -> Path:
    path = tmp_path / "users"
    add_user(path, "olga@example.com", Role.OPERATOR, PASSWORD)
    add_user(path, "vic", Role.VIEWER, PASSWORD)
    return path


def test_it_will_not_start_without_an_authentication_source(engine, tmp_path):
    with pytest.raises(ConfigurationError, match="authentication"):
        create_app(engine, auth=Auth())
    with pytest.raises(ConfigurationError, match="--trusted-proxy"):
        create_app(engine, auth=Auth(trusted_header="X-Forwarded-Email"))
    result = CliRunner().invoke(main, ["ui", "--database-url", "sqlite://"])
    assert result.exit_code == 2
    assert "needs an authentication source" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_every_page_asks_for_a_login_first(engine, users):
    c = client(engine, users)
    for path in ("/", "/messages", "/messages/1", "/messages/1/body", "/suppressions", "/relays"):
        response = c.get(path)
        assert response.status_code == 303, path
        assert response.headers["location"].endswith("/login")


def test_a_login_issues_a_fresh_session_and_a_wrong_password_none(engine, users):
    c = client(engine, users)
    wrong = login(c, "olga@example.com", "not the password!")
    assert wrong.status_code == 401  # type: ignore[attr-defined]
    assert c.get("/").status_code == 303
    right = login(c, "olga@example.com")
    assert right.status_code == 303  # type: ignore[attr-defined]
    cookie = right.headers["set-cookie"]  # type: ignore[attr-defined]
    assert "HttpOnly" in cookie
    assert "SameSite=strict" in cookie.replace("Strict", "strict")
    page = c.get("/")
    assert page.status_code == 200
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert page.headers["x-frame-options"] == "DENY"
    assert page.headers["x-dns-prefetch-control"] == "off"


def test_a_planted_session_cookie_beside_ours_ends_the_session_rather_than_win(engine, users):
    """A cookie of our name planted by a sibling site or the host app rides beside ours; the
    server cannot tell which is which, so a request with two is no session (attack F6)."""
    c = client(engine, users)
    login(c, "olga@example.com")
    mine = c.cookies[SESSION_COOKIE]
    both = f"{SESSION_COOKIE}={mine}; {SESSION_COOKIE}=attackers-own-valid-session"
    assert c.get("/", headers={"cookie": both}).status_code == 303
    assert c.get("/", headers={"cookie": f"{SESSION_COOKIE}={mine}"}).status_code == 200


def test_secure_cookies_are_host_only_by_name(engine, users):
    app = create_app(engine, auth=Auth(users_file=UsersFile(users)))
    c = TestClient(app, base_url="https://console.test", follow_redirects=False)
    page = c.get("/login")
    assert page.headers["set-cookie"].startswith("__Host-outbox_console_login=")
    response = login(c, "vic")
    cookie = response.headers["set-cookie"]  # type: ignore[attr-defined]
    assert cookie.startswith(f"__Host-{SESSION_COOKIE}=")
    assert "Secure" in cookie
    assert "Path=/" in cookie
    assert "Domain" not in cookie
    assert c.get("/").status_code == 200


def test_a_login_from_another_site_is_refused(engine, users):
    c = client(engine, users)
    nonce = NONCE.search(c.get("/login").text)
    assert nonce is not None
    forged = c.post(
        "/login",
        data={"name": "vic", "password": PASSWORD, "nonce": nonce.group(1)},
        headers={"Sec-Fetch-Site": "cross-site"},
    )
    assert forged.status_code == 403
    no_nonce = c.post(
        "/login",
        data={"name": "vic", "password": PASSWORD},
        headers={"Sec-Fetch-Site": "same-origin"},
    )
    assert no_nonce.status_code == 403
    assert SESSION_COOKIE not in c.cookies


def test_logging_out_needs_the_sessions_csrf_token(engine, users):
    c = client(engine, users)
    login(c, "vic")
    page = c.get("/")
    token = CSRF.search(page.text)
    assert token is not None
    same_site = {"Sec-Fetch-Site": "same-origin"}
    assert c.post("/logout", data={"csrf": "guessed"}, headers=same_site).status_code == 403
    assert (
        c.post(
            "/logout", data={"csrf": token.group(1)}, headers={"Sec-Fetch-Site": "cross-site"}
        ).status_code
        == 403
    )
    assert c.post("/logout", data={"csrf": token.group(1)}, headers=same_site).status_code == 303


def test_the_login_throttle_stops_guessing_and_says_when_to_come_back(engine, users):
    c = client(engine, users)
    for _ in range(5):
        assert login(c, "vic", "wrong password!!").status_code == 401  # type: ignore[attr-defined]
    throttled = login(c, "vic")  # the right password no longer helps for a while
    assert throttled.status_code == 429  # type: ignore[attr-defined]
    assert int(throttled.headers["retry-after"]) > 0  # type: ignore[attr-defined]
    assert c.get("/").status_code == 303


def test_removing_a_user_ends_their_session_at_once(engine, users):
    c = client(engine, users)
    login(c, "vic")
    assert c.get("/").status_code == 200
    assert remove_user(users, "vic")
    assert c.get("/").status_code == 303
    add_user(users, "vic", Role.VIEWER, PASSWORD)  # back: a new hash, so a new session
    assert c.get("/").status_code == 303


def test_a_viewer_sees_addresses_masked_and_no_body(engine, users):
    (mid,) = enqueue(
        engine, [email(1, to=["jane.doe@example.com"], html="<p>secret code 4711</p>")]
    )
    viewer, operator = client(engine, users), client(engine, users)
    login(viewer, "vic")
    login(operator, "olga@example.com")
    listed = viewer.get("/messages")
    assert "jane.doe@example.com" not in listed.text
    assert "j\u2022\u2022\u2022@example.com" in listed.text
    detail = viewer.get(f"/messages/{mid}")
    assert "jane.doe" not in detail.text
    assert "4711" not in detail.text
    assert viewer.get(f"/messages/{mid}/body").status_code == 403
    shown = operator.get(f"/messages/{mid}")
    assert "jane.doe@example.com" in shown.text
    body = operator.get(f"/messages/{mid}/body")
    assert "secret code 4711" in body.text
    assert body.headers["content-security-policy"].startswith("sandbox;")


def test_html_in_a_subject_or_a_key_is_shown_as_text(engine, users):
    enqueue(
        engine,
        [email(1, subject='<script>alert("x")</script><img src=x onerror=alert(1)>')],
        key="<b>k</b>",
    )
    c = client(engine, users)
    login(c, "olga@example.com")
    page = c.get("/messages")
    assert "<script>alert" not in page.text
    assert "<img src=x" not in page.text
    assert "&lt;script&gt;" in page.text
    assert "&lt;b&gt;k&lt;/b&gt;" in page.text


def test_messages_filter_and_page_newest_first(engine, users):
    ids = enqueue(engine, 60, short=True, prefix="order")
    with engine.begin() as conn:
        conn.execute(
            sa.update(messages)
            .where(messages.c.id == ids[3])
            .values(status="failed", last_error_code="MessageRejected")
        )
    c = client(engine, users)
    login(c, "olga@example.com")
    first = c.get("/messages")
    shown = [int(i) for i in re.findall(r'<tr data-id="(\d+)"', first.text)]
    assert shown == sorted(ids, reverse=True)[:50]
    older = re.search(r'id="older" href="([^"]+)"', first.text)
    assert older is not None
    second = c.get(older.group(1).replace("&amp;", "&").removeprefix(""))
    rest = [int(i) for i in re.findall(r'<tr data-id="(\d+)"', second.text)]
    assert rest == sorted(ids, reverse=True)[50:]
    failed = c.get("/messages", params={"status": "failed", "error": "MessageRejected"})
    assert re.findall(r'<tr data-id="(\d+)"', failed.text) == [str(ids[3])]
    keyed = c.get("/messages", params={"key": "order:1*"})
    assert sorted(int(i) for i in re.findall(r'<tr data-id="(\d+)"', keyed.text)) == [
        ids[1],
        *ids[10:20],
    ]


def test_one_message_shows_its_timeline(engine, users):
    (mid,) = enqueue(engine, [email(1, headers={"X-Order": "1"})])
    c = client(engine, users)
    login(c, "olga@example.com")
    page = c.get(f"/messages/{mid}")
    assert page.status_code == 200
    assert "<th>From</th><td>Shop &lt;shop@example.com&gt;</td>" in page.text
    assert "<th>X-Order</th><td>1</td>" in page.text
    assert "enqueued" in page.text
    assert "Order 1" in page.text
    assert c.get("/messages/999999999").status_code == 404
    assert c.get("/messages/nope").status_code == 404


def test_overview_suppressions_and_relays_pages_answer(engine, users):
    enqueue(engine, 3, short=True)
    c = client(engine, users)
    login(c, "vic")
    overview = c.get("/")
    assert re.search(r'data-status="pending">3<', overview.text), overview.text
    assert c.get("/suppressions").status_code == 200
    assert c.get("/relays").status_code == 200


def test_a_trusted_header_is_believed_only_from_the_named_proxies(engine):
    auth = Auth(
        trusted_header="X-Forwarded-Email",
        trusted_proxies=(ipaddress.ip_network("127.0.0.0/8"),),
        operators=frozenset({"boss@example.com"}),
    )
    app = create_app(engine, auth=auth)
    # Starlette's test client connects from "testclient", not an address: never trusted
    stranger = TestClient(app, follow_redirects=False)
    assert stranger.get("/", headers={"X-Forwarded-Email": "boss@example.com"}).status_code == 303
    trusted = TestClient(app, follow_redirects=False, client=("127.0.0.1", 50000))
    assert trusted.get("/", headers={"X-Forwarded-Email": "boss@example.com"}).status_code == 200
    assert trusted.get("/").status_code == 303
    as_viewer = trusted.get("/messages/1/body", headers={"X-Forwarded-Email": "eve@example.com"})
    assert as_viewer.status_code == 403


# -- actions -------------------------------------------------------------------------------


def action_form(c: TestClient, mid: int, action: str) -> dict[str, str]:
    """The hidden fields of the message page's form for ``action``."""
    page = c.get(f"/messages/{mid}").text
    for chunk in page.split("<form")[1:]:
        fields = dict(HIDDEN.findall(chunk.split("</form>")[0]))
        if fields.get("action") == action:
            return fields
    raise AssertionError(f"no {action} form on the page")


def test_an_operator_requeues_one_message_with_a_reason_logged_under_their_name(engine, users):
    (mid,) = enqueue(engine, [email(1)])
    with engine.begin() as conn:
        conn.execute(sa.update(messages).where(messages.c.id == mid).values(status="failed"))
    c = client(engine, users)
    login(c, "olga@example.com")
    form = action_form(c, mid, "requeue")
    done = c.post(
        f"/messages/{mid}/act", data={**form, "reason": "the domain is fixed"}, headers=SAME
    )
    assert done.status_code == 200, done.text
    assert f"requeued message {mid}" in done.text
    with engine.connect() as conn:
        assert (
            conn.execute(sa.select(messages.c.status).where(messages.c.id == mid)).scalar_one()
            == "pending"
        )
        logged = conn.execute(
            sa.select(
                operator_actions.c.actor, operator_actions.c.action, operator_actions.c.reason
            )
        ).all()
    assert [tuple(r) for r in logged] == [("olga@example.com", "requeue", "the domain is fixed")]
    with engine.begin() as conn:  # the resend's outcome is unknown again, a moment later
        conn.execute(
            sa.update(messages)
            .where(messages.c.id == mid)
            .values(status="unknown_outcome", updated_at=datetime.now(UTC) + timedelta(seconds=1))
        )
    # the result page reloaded, or the form sent again from another tab (attack A2)
    again = c.post(f"/messages/{mid}/act", data=form, headers=SAME)
    assert again.status_code == 409
    assert "changed since you looked at it" in again.text


def test_a_viewer_and_a_forged_form_cannot_act(engine, users):
    (mid,) = enqueue(engine, [email(1)])
    viewer, operator = client(engine, users), client(engine, users)
    login(viewer, "vic")
    login(operator, "olga@example.com")
    token = csrf_of(viewer, "/")
    refused = viewer.post(
        f"/messages/{mid}/act", data={"csrf": token, "action": "cancel"}, headers=SAME
    )
    assert refused.status_code == 403
    forged = operator.post(
        f"/messages/{mid}/act", data={"csrf": "guess", "action": "cancel"}, headers=SAME
    )
    assert forged.status_code == 403
    cross = operator.post(
        f"/messages/{mid}/act",
        data={"csrf": csrf_of(operator, "/"), "action": "cancel"},
        headers={"Sec-Fetch-Site": "cross-site"},
    )
    assert cross.status_code == 403
    with engine.connect() as conn:
        assert (
            conn.execute(sa.select(messages.c.status).where(messages.c.id == mid)).scalar_one()
            == "pending"
        )


def test_a_bulk_cancel_previews_then_changes_only_what_it_previewed(engine, users):
    ids = enqueue(engine, 12, short=True, prefix="promo")
    with engine.begin() as conn:
        conn.execute(
            sa.update(messages).where(messages.c.id.in_(ids[:2])).values(status="processing")
        )
    c = client(engine, users)
    login(c, "olga@example.com")
    preview = c.get("/actions/preview", params={"action": "cancel", "key": "promo:*"})
    assert preview.status_code == 200
    assert re.search(r'id="matched">12<', preview.text)
    assert re.search(r'id="chosen">10<', preview.text)
    assert re.search(r'id="sending">2<', preview.text)
    late = enqueue(engine, 1, short=True, key="promo:late")  # matches only after the preview
    form = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', preview.text))
    started = c.post("/actions/apply", data={**form, "reason": "campaign withdrawn"}, headers=SAME)
    done = finished_job(c, started)
    assert done.status_code == 200, done.text
    assert OUTCOME.findall(done.text) == ["cancelled 10 message(s)"]
    with engine.connect() as conn:
        got = dict(conn.execute(sa.select(messages.c.id, messages.c.status)).all())
    assert [got[i] for i in ids] == ["processing"] * 2 + ["cancelled"] * 10
    assert got[late[0]] == "pending"


def test_a_bulk_requeue_leaves_out_what_prune_took_the_body_of(engine, users):
    ids = enqueue(engine, 3, short=True)
    with engine.begin() as conn:
        conn.execute(sa.update(messages).where(messages.c.id.in_(ids)).values(status="failed"))
        conn.execute(
            sa.update(messages).where(messages.c.id == ids[0]).values(body_dropped_at=sa.func.now())
        )
    c = client(engine, users)
    login(c, "olga@example.com")
    preview = c.get("/actions/preview", params={"action": "requeue", "status": "failed"})
    assert re.search(r'id="chosen">2<', preview.text)
    assert re.search(r'id="left-out">1<', preview.text)
    refused = c.get("/actions/preview", params={"action": "requeue", "status": "sent"})
    assert refused.status_code == 409
    assert "cannot requeue sent messages" in refused.text


def test_the_overview_charts_each_hours_sent_and_failed_messages(engine, users):
    ids = enqueue(engine, 9, short=True)
    # mid-hour moments: the bucket is the same by the test's clock and the database's
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    with engine.begin() as conn:
        for i in ids[:4]:
            conn.execute(
                sa.update(messages)
                .where(messages.c.id == i)
                .values(status="sent", sent_at=hour - timedelta(minutes=90))
            )
        conn.execute(
            sa.update(messages)
            .where(messages.c.id.in_(ids[4:6]))
            .values(status="failed", updated_at=hour - timedelta(minutes=30))
        )
        conn.execute(  # a day and more ago: not charted
            sa.update(messages)
            .where(messages.c.id == ids[6])
            .values(status="sent", sent_at=hour - timedelta(hours=30))
        )
    c = client(engine, users)
    login(c, "vic")
    page = c.get("/").text
    sent = [int(n) for n in re.findall(r'data-sent="(\d+)"', page)]
    failed = [int(n) for n in re.findall(r'data-failed="(\d+)"', page)]
    assert len(sent) == len(failed) == 24
    assert sent[-3] == 4
    assert sum(sent) == 4
    assert failed[-2] == 2
    assert sum(failed) == 2


def test_an_operator_suppresses_and_unsuppresses_addresses_logged_under_their_name(engine, users):
    c = client(engine, users)
    login(c, "olga@example.com")
    token = csrf_of(c, "/suppressions")
    added = c.post(
        "/suppressions/add",
        data={"csrf": token, "addresses": "Ann@Example.com\nbob@example.com", "reason": "asked"},
        headers=SAME,
    )
    assert added.status_code == 200, added.text
    assert "suppressed 2 address(es)" in added.text
    listed = c.get("/suppressions").text
    assert "ann@example.com" in listed
    bad = c.post(
        "/suppressions/add",
        data={"csrf": token, "addresses": "not-an-address", "reason": "x"},
        headers=SAME,
    )
    assert bad.status_code == 409
    assert "not an email address" in bad.text
    removed = c.post(
        "/suppressions/remove",
        data={"csrf": token, "addresses": "ann@example.com", "reason": "resubscribed"},
        headers=SAME,
    )
    assert removed.status_code == 200, removed.text
    with engine.connect() as conn:
        left = conn.execute(sa.select(suppressions.c.address)).scalars().all()
        logged = conn.execute(
            sa.select(operator_actions.c.actor, operator_actions.c.action).order_by(
                operator_actions.c.id
            )
        ).all()
    assert left == ["bob@example.com"]
    assert [tuple(r) for r in logged] == [
        ("olga@example.com", "suppress"),
        ("olga@example.com", "suppress"),
        ("olga@example.com", "unsuppress"),
    ]
    viewer = client(engine, users)
    login(viewer, "vic")
    refused = viewer.post(
        "/suppressions/remove",
        data={"csrf": csrf_of(viewer, "/"), "addresses": "bob@example.com"},
        headers=SAME,
    )
    assert refused.status_code == 403


# -- the attack review's finds ---------------------------------------------------------------


def test_concurrent_guesses_are_counted_before_any_password_is_checked(engine, users):
    """Attack F3: the throttle counted a failure only after the hash check, so guesses sent
    at once all passed the check. Now each attempt counts from its start."""
    import concurrent.futures

    # sixteen browsers of one console process
    app = create_app(engine, auth=Auth(users_file=UsersFile(users)), secure_cookies=False)
    shared = [TestClient(app, follow_redirects=False) for _ in range(16)]
    page = TestClient(app).get("/login")
    token = NONCE.search(page.text)
    assert token is not None

    def shared_guess(n: int) -> int:
        h = shared[n]
        h.cookies.set("outbox_console_login", token.group(1))
        return h.post(
            "/login",
            data={
                "name": "olga@example.com",
                "password": f"guess {n:04d}!!",
                "nonce": token.group(1),
            },
            headers=SAME,
        ).status_code

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(shared_guess, range(16)))
    assert codes.count(401) == 5, codes
    assert codes.count(429) == 11, codes


def test_a_success_does_not_wipe_the_failures_before_it(engine, users):
    """Attack F3b: logging in to one's own account cleared the address's failures, so an
    attacker interleaving their own logins guessed without end."""
    app = create_app(engine, auth=Auth(users_file=UsersFile(users)), secure_cookies=False)
    c = TestClient(app, follow_redirects=False)
    codes = []
    for n in range(12):
        codes.append(login(c, "olga@example.com", f"guess {n:04d}!!").status_code)  # type: ignore[attr-defined]
        assert login(c, "vic").status_code == 303  # type: ignore[attr-defined]
    assert codes[:5] == [401] * 5
    assert set(codes[5:]) == {429}


def test_strangers_cannot_lock_a_user_out_from_elsewhere(engine, users):
    """Attack F4: five junk logins for a name from any address locked that user out. Now the
    tight limit is per name and address; a name alone takes 50."""
    app = create_app(engine, auth=Auth(users_file=UsersFile(users)), secure_cookies=False)
    stranger = TestClient(app, follow_redirects=False, client=("198.51.100.7", 4000))
    for n in range(6):
        login(stranger, "OLGA@example.com", f"junk {n:04d}!!!!")
    assert login(stranger, "olga@example.com").status_code == 429  # type: ignore[attr-defined]
    olga = TestClient(app, follow_redirects=False, client=("203.0.113.9", 5000))
    assert login(olga, "olga@example.com").status_code == 303  # type: ignore[attr-defined]


def test_behind_a_trusted_proxy_the_throttle_keys_on_the_forwarded_address(engine, users):
    auth = Auth(users_file=UsersFile(users), trusted_proxies=(ipaddress.ip_network("10.0.0.0/8"),))
    app = create_app(engine, auth=auth, secure_cookies=False)
    proxy = TestClient(app, follow_redirects=False, client=("10.0.0.2", 443))
    attacker = {"x-forwarded-for": "198.51.100.7"}
    for n in range(6):
        page = proxy.get("/login")
        nonce = NONCE.search(page.text)
        assert nonce is not None
        proxy.post(
            "/login",
            data={
                "name": "olga@example.com",
                "password": f"junk {n:04d}!!!!",
                "nonce": nonce.group(1),
            },
            headers={**SAME, **attacker},
        )
    page = proxy.get("/login")
    nonce = NONCE.search(page.text)
    assert nonce is not None
    olga = proxy.post(
        "/login",
        data={"name": "olga@example.com", "password": PASSWORD, "nonce": nonce.group(1)},
        headers={**SAME, "x-forwarded-for": "203.0.113.9"},
    )
    assert olga.status_code == 303


def test_logging_out_ends_the_session_even_for_a_copied_cookie(engine, users):
    """Attack F5: a copy of the cookie outlived logout, a new password, a re-added user."""
    c = client(engine, users)
    login(c, "olga@example.com")
    stolen = {"cookie": f"{SESSION_COOKIE}={c.cookies[SESSION_COOKIE]}"}
    assert c.post("/logout", data={"csrf": csrf_of(c, "/")}, headers=SAME).status_code == 303
    app_thief = c  # the same console process: it learnt of the logout
    assert app_thief.get("/", headers=stolen).status_code == 303


def test_a_new_password_or_a_re_added_user_ends_every_older_session(engine, users):
    c = client(engine, users)
    login(c, "vic")
    cookie = {"cookie": f"{SESSION_COOKIE}={c.cookies[SESSION_COOKIE]}"}
    assert c.get("/", headers=cookie).status_code == 200
    add_user(users, "vic", Role.VIEWER, PASSWORD + " changed")
    assert c.get("/", headers=cookie).status_code == 303
    remove_user(users, "vic")
    add_user(users, "vic", Role.VIEWER, PASSWORD)  # the old password back, a new hash
    assert c.get("/", headers=cookie).status_code == 303


def test_a_viewer_cannot_read_or_probe_a_suppressed_address(engine, users):
    """Attack F1: the next page's link put an address in the URL, and ``after=`` answered
    whether an address follows a guess."""
    with engine.begin() as conn:
        conn.execute(
            suppressions.insert(),
            [
                {
                    "address": f"user{n:03d}@example.com",
                    "reason": "manual",
                    "created_at": datetime.now(UTC),
                    "actor": "olga@example.com",
                }
                for n in range(60)
            ],
        )
    c = client(engine, users)
    login(c, "vic")
    first = c.get("/suppressions").text
    assert "user0" not in first
    assert "olga@example.com" not in first
    more = re.search(r'id="more" href="([^"]+)"', first)
    assert more is not None
    assert "%40" not in more.group(1)
    assert "@" not in more.group(1)
    second = c.get(more.group(1).replace("&amp;", "&")).text
    assert second.count("<tr>") == 1 + 10
    assert c.get("/suppressions", params={"after": "user050@example.com"}).text == first


def test_a_viewer_sees_no_display_name_key_or_free_text(engine, users):
    """Attack F2: the mask missed display names, quoted local parts, addresses in keys and
    free text; a prefix key filter spelled a key out."""
    (mid,) = enqueue(
        engine,
        [
            email(
                1,
                to=["Alice Smith <alice@example.com>"],
                headers={"X-Customer": "dave@example.org"},
            )
        ],
        key="reset:dave.secretive%40example.com",
    )
    with engine.begin() as conn:
        conn.execute(
            sa.update(messages)
            .where(messages.c.id == mid)
            .values(
                last_error_code="MessageRejected", last_error_message="bob@example.com rejected"
            )
        )
    c = client(engine, users)
    login(c, "vic")
    page = c.get(f"/messages/{mid}").text + c.get("/messages").text
    for secret in ("Alice", "Smith", "carol", "private", "dave", "secretive", "bob@"):
        assert secret not in page, secret
    assert "a\u2022\u2022\u2022@example.com" in page
    assert "reset:\u2022\u2022\u2022" in page
    probe = c.get("/messages", params={"key": "reset:d*"})
    assert probe.status_code == 400
    operator = client(engine, users)
    login(operator, "olga@example.com")
    assert "Alice Smith" in operator.get(f"/messages/{mid}").text


@pytest.mark.parametrize(
    "path",
    [
        "/messages/\u00b2",
        "/messages/\u00b2/body",
        "/messages?before=\u00b2",
        "/messages?key=a%00b",
        "/messages?category=%00",
    ],
)
def test_odd_ids_and_control_characters_are_a_clear_answer_not_a_crash(engine, users, path):
    """Attack F7: '²' passed isdigit() and crashed int(); a NUL crashed PostgreSQL."""
    c = client(engine, users)
    login(c, "olga@example.com")
    response = c.get(path)
    assert response.status_code in (200, 400, 404), response.status_code


def test_a_trusted_header_sent_twice_or_malformed_is_no_one(engine):
    """Attack F10: with a proxy that appends, the client's own copy came first and won."""
    auth = Auth(
        trusted_header="X-Forwarded-Email",
        trusted_proxies=(ipaddress.ip_network("127.0.0.0/8"),),
        operators=frozenset({"boss@example.com"}),
    )
    trusted = TestClient(
        create_app(engine, auth=auth), follow_redirects=False, client=("127.0.0.1", 1)
    )
    twice = [("X-Forwarded-Email", "boss@example.com"), ("X-Forwarded-Email", "eve@example.com")]
    assert trusted.get("/", headers=twice).status_code == 303
    assert (
        trusted.get(
            "/", headers={"X-Forwarded-Email": "boss@example.com, eve@example.com"}
        ).status_code
        == 303
    )
    assert trusted.get("/", headers={"X-Forwarded-Email": "eve@example.com"}).status_code == 200


def test_key_and_users_files_others_can_read_are_refused(engine, users, tmp_path):
    """Attack F11: a world-readable key lets anyone forge an operator's session."""
    key = tmp_path / "key"
    key.write_bytes(b"k" * 48)
    key.chmod(0o644)
    result = CliRunner().invoke(
        main,
        [
            "ui",
            "--database-url",
            "sqlite://",
            "--users-file",
            str(users),
            "--secret-key-file",
            str(key),
        ],
    )
    assert result.exit_code == 2
    assert "chmod 600" in result.output
    users.chmod(0o644)
    with pytest.raises(ConfigurationError, match="chmod 600"):
        UsersFile(users)


def test_the_emails_html_reaches_the_frame_without_anything_that_reaches_out(engine, users):
    """Attack F9: a preconnect hint in the email made the browser connect to its host."""
    html = (
        '<link rel="preconnect" href="https://tracker.example"><meta http-equiv="refresh" '
        'content="0;url=https://x.example"><base href="https://evil.example/">'
        '<style>p{color:red}</style><p style="margin:0">Hi <img src="https://t.example/p.gif">'
        '<img src="data:image/png;base64,AAAA"></p>'
    )
    (mid,) = enqueue(engine, [email(1, html=html)])
    c = client(engine, users)
    login(c, "olga@example.com")
    body = c.get(f"/messages/{mid}/body").text
    for gone in ("<link", "<meta", "<base", "tracker.example", "t.example"):
        assert gone not in body, gone
    assert "<style>p{color:red}</style>" in body
    assert 'src="data:image/png;base64,AAAA"' in body


def test_operators_filter_by_recipient_and_delivery_viewers_not_by_recipient(engine, users):
    ids = enqueue(engine, [email(1, to=["Jane_Doe@Example.com"]), email(2), email(3)])
    with engine.begin() as conn:
        conn.execute(
            sa.update(messages)
            .where(messages.c.id == ids[2])
            .values(status="sent", delivery_status="bounced")
        )
    c = client(engine, users)
    login(c, "olga@example.com")
    found = c.get("/messages", params={"recipient": "jane_doe@"}).text
    assert re.findall(r'<tr data-id="(\d+)"', found) == [str(ids[0])]
    assert (
        re.findall(r'<tr data-id="(\d+)"', c.get("/messages", params={"recipient": "%"}).text) == []
    )
    bounced = c.get("/messages", params={"delivery": "bounced"}).text
    assert re.findall(r'<tr data-id="(\d+)"', bounced) == [str(ids[2])]
    viewer = client(engine, users)
    login(viewer, "vic")
    assert viewer.get("/messages", params={"recipient": "jane"}).status_code == 400
    assert "by-category" in viewer.get("/").text


def test_a_bulk_apply_changes_exactly_what_its_preview_counted_and_only_once(engine, users):
    """Attack A1/A3: the apply picked again by filter and id bound, so a message skipped
    while it was being sent, or one whose insert committed after the preview with a lower
    id, was changed too; a confirmation sent twice applied twice."""
    ids = enqueue(engine, 4, short=True, prefix="batch")
    with engine.begin() as conn:
        conn.execute(sa.update(messages).where(messages.c.id.in_(ids[:3])).values(status="failed"))
        conn.execute(sa.update(messages).where(messages.c.id == ids[3]).values(status="processing"))
    c = client(engine, users)
    login(c, "olga@example.com")
    preview = c.get("/actions/preview", params={"action": "requeue", "key": "batch:*"})
    assert re.search(r'id="chosen">3<', preview.text)
    form = dict(HIDDEN.findall(preview.text))
    later = datetime.now(UTC) + timedelta(seconds=1)
    with engine.begin() as conn:
        # the one being sent ends unknown; one counted fails again after a resend
        conn.execute(
            sa.update(messages)
            .where(messages.c.id.in_([ids[3], ids[0]]))
            .values(status="unknown_outcome", updated_at=later)
        )
    done = finished_job(c, c.post("/actions/apply", data=form, headers=SAME))
    assert done.status_code == 200, done.text
    assert "requeued 2 message(s) (1 moved meanwhile" in done.text
    with engine.connect() as conn:
        got = dict(conn.execute(sa.select(messages.c.id, messages.c.status)).all())
    assert [got[i] for i in ids] == ["unknown_outcome", "pending", "pending", "unknown_outcome"]
    replay = c.post("/actions/apply", data=form, headers=SAME)
    assert replay.status_code == 409
    assert "applied already" in replay.text


def test_forms_are_read_only_url_encoded_and_bounded(engine, users):
    """Attack D2: a multipart upload to /login was spooled to disk before any check."""
    c = client(engine, users)
    page = c.get("/login")
    nonce = NONCE.search(page.text)
    assert nonce is not None
    upload = c.post(
        "/login",
        files={"big": ("x.bin", b"x" * 1024)},
        data={"nonce": nonce.group(1)},
        headers=SAME,
    )
    assert upload.status_code == 415
    huge = c.post(
        "/login",
        content=b"name=" + b"a" * (64 * 1024),
        headers={**SAME, "content-type": "application/x-www-form-urlencoded"},
    )
    assert huge.status_code == 413
    stranger = client(engine, users)  # no nonce cookie: refused before the body is read
    assert stranger.post("/login", files={"big": ("x.bin", b"x")}, headers=SAME).status_code == 403


def test_a_viewer_sees_only_a_keys_first_part(engine, users):
    """Attack C1: the mask kept a key up to its last ':'."""
    enqueue(
        engine,
        [email(1, subject='for "alice private"@example.com')],
        key="order:alice.private@example.com:42",
    )
    c = client(engine, users)
    login(c, "vic")
    page = c.get("/messages").text
    assert "alice" not in page
    assert "order:\u2022\u2022\u2022" in page


def test_a_users_file_reached_through_a_symlink_is_refused(tmp_path, users):
    """Attack F1 (round two): the check and the read were two opens of the path."""
    link = tmp_path / "link"
    link.symlink_to(users)
    with pytest.raises(ConfigurationError, match="symlink"):
        UsersFile(link)


def test_a_huge_login_name_costs_the_throttle_no_more_than_a_short_one():
    """Attack D1: the throttle kept each name whole (NFKC-expanded 18 times)."""
    from relay.console.guard import LoginThrottle

    keys = LoginThrottle.keys("\ufdfa" * 1_000_000, "198.51.100.7")
    assert max(len(k) for k in keys.values()) < 200
    assert (
        LoginThrottle.keys("Olga@Example.com", "a")["name"]
        == LoginThrottle.keys("olga@example.com", "b")["name"]
    )


def test_one_user_cannot_hold_every_live_stream(engine, users):
    """Attack L1: one viewer's tabs could take all 50 streams."""
    from relay.console.views import LIVE_PER_USER

    app = create_app(engine, auth=Auth(users_file=UsersFile(users)), secure_cookies=False)
    c = TestClient(app, follow_redirects=False)
    login(c, "vic")
    app.app.state.pages.streams_of["vic"] = LIVE_PER_USER
    assert c.get("/live").status_code == 503
