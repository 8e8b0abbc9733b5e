"""The console's bulk changes as jobs, over HTTP (Starlette's test client) on SQLite,
PostgreSQL and MariaDB: resolving everything a filter matches as delivered or not delivered
through a preview (the CLI's resolve_one for each message, under the signed-in operator), the
apply answered with a redirect to the job's page, that page showing a partial count while
the job runs and the outcome (or the error that stopped it) once it ended, and who may see
what. A job is caught mid-way through :func:`relay.console.actions.job_step`, the seam a test
replaces to hold the job's thread on an event."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox.schema import attempts, messages, operator_actions
from relay.admin import batches
from relay.console import Role, actions
from tests.support.console import (
    HIDDEN,
    OUTCOME,
    SAME,
    client,
    csrf_of,
    finished_job,
    job_path,
    login,
    users_file,
)
from tests.support.factories import enqueue
from tests.support.waiting import wait_for

OLGA, OTTO = "olga@example.com", "otto@example.com"
REFRESH = '<meta http-equiv="refresh" content="1">'
PROGRESS = re.compile(r'<p id="progress" data-done="(\d+)" data-total="(\d+)">([^<]*)</p>')


@pytest.fixture
def users(tmp_path: Path) -> Path:
    return users_file(tmp_path, **{OTTO: Role.OPERATOR})


def set_rows(engine: sa.Engine, ids: list[int], **values: object) -> None:
    with engine.begin() as conn:
        conn.execute(sa.update(messages).where(messages.c.id.in_(ids)).values(**values))


def statuses_of(engine: sa.Engine, ids: list[int]) -> list[str]:
    with engine.connect() as conn:
        got = dict(conn.execute(sa.select(messages.c.id, messages.c.status)).all())
    return [got[i] for i in ids]


def logged(engine: sa.Engine) -> list[tuple[object, ...]]:
    """The operators' log: (message id, actor, action, reason), by message id."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(
                operator_actions.c.message_id,
                operator_actions.c.actor,
                operator_actions.c.action,
                operator_actions.c.reason,
            ).order_by(operator_actions.c.message_id)
        ).all()
    return [tuple(r) for r in rows]


def preview_form(c, **params: str) -> tuple[str, dict[str, str]]:
    """The preview page of ``params`` and its confirmation form's hidden fields."""
    page = c.get("/actions/preview", params=params)
    assert page.status_code == 200, page.text
    return page.text, dict(HIDDEN.findall(page.text))


def count(page: str, element: str) -> int:
    found = re.search(rf'id="{element}">([\d,]+)<', page)
    assert found is not None, f"no {element} on the page"
    return int(found.group(1).replace(",", ""))


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """(reached, go): a job's thread, once it counted its first step, sets ``reached`` and
    waits for ``go`` (set at the end of the test whatever happens, so no thread is left)."""
    reached, go = threading.Event(), threading.Event()

    def hold(job: actions.Job) -> None:
        if not reached.is_set():
            reached.set()
            assert go.wait(30), "the test never let the job go on"

    monkeypatch.setattr(actions, "job_step", hold)
    try:
        yield reached, go
    finally:
        go.set()


def test_a_bulk_resolve_as_delivered_by_filter_keeps_each_rows_ses_id_and_logs_the_operator(
    engine, users
):
    ids = enqueue(engine, 6, short=True, prefix="receipt")
    set_rows(engine, ids[:4], status="unknown_outcome")
    set_rows(engine, [ids[0]], provider_message_id="ses-first-send")
    set_rows(engine, [ids[4]], status="sent")
    set_rows(engine, [ids[5]], status="processing")
    c = client(engine, users)
    login(c, OLGA)
    listed = c.get("/messages", params={"key": "receipt:*"}).text
    link = re.search(r'id="bulk-resolve-delivered" href="([^"]+)"', listed)
    assert link is not None
    page = c.get(link.group(1).replace("&amp;", "&"))
    assert page.status_code == 200, page.text
    assert count(page.text, "matched") == 6
    assert count(page.text, "chosen") == 4
    assert re.search(r'<tr data-status="sent"><td>1</td><td>sent</td><td>already sent', page.text)
    assert re.search(r'<tr data-status="processing"><td>1</td>.*being sent right now', page.text)
    assert 'name="reason" id="reason" size="60" required' in page.text
    form = dict(HIDDEN.findall(page.text))
    none = c.get("/actions/preview", params={"action": "resolve_delivered", "status": "sent"})
    assert count(none.text, "chosen") == 0  # a filter of other statuses: nothing, and why
    assert "already sent" in none.text
    assert 'id="confirm"' not in none.text

    started = c.post(
        "/actions/apply", data={**form, "reason": "SES history: delivered"}, headers=SAME
    )
    done = finished_job(c, started)
    assert done.status_code == 200, done.text
    assert OUTCOME.findall(done.text) == ["resolved 4 message(s) as delivered (sent)"]
    assert PROGRESS.search(done.text).groups()[:2] == ("4", "4")  # type: ignore[union-attr]
    assert statuses_of(engine, ids) == ["sent"] * 5 + ["processing"]
    with engine.connect() as conn:
        kept = dict(conn.execute(sa.select(messages.c.id, messages.c.provider_message_id)).all())
        tried = conn.execute(
            sa.select(attempts.c.message_id, attempts.c.relay_id, attempts.c.outcome).order_by(
                attempts.c.message_id
            )
        ).all()
    assert [kept[i] for i in ids[:4]] == ["ses-first-send", None, None, None]
    assert [tuple(t) for t in tried] == [(i, f"operator:{OLGA}", "resolved") for i in ids[:4]]
    assert logged(engine) == [
        (i, OLGA, "resolve_delivered", "SES history: delivered") for i in ids[:4]
    ]


def test_a_bulk_resolve_as_not_delivered_leaves_what_changed_and_lists_what_its_guard_refused(
    engine, users
):
    ids = enqueue(engine, 6, short=True, prefix="invoice")
    set_rows(engine, ids, status="unknown_outcome")
    set_rows(engine, [ids[5]], body_dropped_at=datetime.now(UTC))
    c = client(engine, users)
    login(c, OLGA)
    page, form = preview_form(c, action="resolve_not_delivered", status="unknown_outcome")
    assert count(page, "chosen") == 5
    assert count(page, "left-out") == 1  # no body: nothing to send again
    later = datetime.now(UTC) + timedelta(seconds=1)
    # after the preview: a relay's resend of one ends unknown again, the intake settles
    # another as sent, and a third loses its body (a drop leaves updated_at alone)
    set_rows(engine, [ids[0]], updated_at=later)
    set_rows(engine, [ids[1]], status="sent", updated_at=later)
    set_rows(engine, [ids[2]], body_dropped_at=datetime.now(UTC))

    missing = c.post("/actions/apply", data=form, headers=SAME)
    assert missing.status_code == 400
    assert OUTCOME.findall(missing.text)[0].startswith("reason: required")
    done = finished_job(
        c, c.post("/actions/apply", data={**form, "reason": "bounced upstream"}, headers=SAME)
    )
    assert done.status_code == 200, done.text
    assert OUTCOME.findall(done.text) == [
        "resolved 2 message(s) as not delivered (requeued); 2 changed since the preview and "
        "were left alone; 1 refused, each for the reason listed"
    ]
    refusal = re.search(rf'<li data-id="{ids[2]}">.*?</a>: ([^<]*)</li>', done.text)
    assert refusal is not None
    assert "prune dropped its body" in refusal.group(1)
    assert statuses_of(engine, ids) == [
        "unknown_outcome", "sent", "unknown_outcome", "pending", "pending", "unknown_outcome",
    ]  # fmt: skip
    assert logged(engine) == [
        (i, OLGA, "resolve_not_delivered", "bounced upstream") for i in ids[3:5]
    ]


def test_a_job_page_shows_a_partial_count_while_it_runs_then_the_totals(
    engine, users, held, monkeypatch
):
    reached, go = held
    monkeypatch.setattr(batches, "CHANGE_BATCH", 3)
    ids = enqueue(engine, 7, short=True, prefix="refund")
    set_rows(engine, ids, status="failed")
    c = client(engine, users)
    login(c, OLGA)
    _, form = preview_form(c, action="requeue", status="failed")
    started = c.post("/actions/apply", data=form, headers=SAME)
    path = job_path(started)
    assert reached.wait(10), "the job never counted its first batch"
    running = c.get(path)
    assert running.status_code == 200
    assert REFRESH in running.text
    progress = PROGRESS.search(running.text)
    assert progress is not None
    assert progress.groups() == ("3", "7", "requeued 3 of 7 message(s)\u2026")
    assert not OUTCOME.findall(running.text)
    assert statuses_of(engine, ids) == ["pending"] * 3 + ["failed"] * 4
    go.set()
    done = finished_job(c, started)
    assert REFRESH not in done.text
    assert PROGRESS.search(done.text).groups()[:2] == ("7", "7")  # type: ignore[union-attr]
    assert OUTCOME.findall(done.text) == ["requeued 7 message(s)"]
    assert statuses_of(engine, ids) == ["pending"] * 7
    again = c.post("/actions/apply", data=form, headers=SAME)
    assert again.status_code == 409
    assert "applied already" in again.text


def test_an_error_in_the_jobs_thread_shows_on_its_page_as_a_refusal(engine, users, monkeypatch):
    monkeypatch.setattr(batches, "CHANGE_BATCH", 2)

    def fail(job: actions.Job) -> None:
        raise RuntimeError("the console's thread fell over")

    monkeypatch.setattr(actions, "job_step", fail)
    ids = enqueue(engine, 5, short=True)
    set_rows(engine, ids, status="pending")
    c = client(engine, users)
    login(c, OLGA)
    _, form = preview_form(c, action="cancel", status="pending")
    done = finished_job(c, c.post("/actions/apply", data=form, headers=SAME))
    assert done.status_code == 409
    assert "Cancel: not done" in done.text
    (said,) = OUTCOME.findall(done.text)
    assert said.startswith(
        "stopped by an error (RuntimeError: the console&#39;s thread fell over) after going "
        "through 2 of 5 message(s)"
    ), said
    assert 'class="error"' in done.text
    assert statuses_of(engine, ids) == ["cancelled"] * 2 + ["pending"] * 3


def test_only_the_operator_who_started_a_job_sees_it_and_a_viewer_none_of_it(engine, users, held):
    reached, go = held
    ids = enqueue(engine, 2, short=True)
    set_rows(engine, ids, status="unknown_outcome")
    olga, otto, vic = client(engine, users), client(engine, users), client(engine, users)
    login(olga, OLGA)
    login(otto, OTTO)
    login(vic, "vic")
    _, form = preview_form(olga, action="resolve_delivered", status="unknown_outcome")
    # otto cannot confirm olga's preview, nor a viewer anything
    theirs = otto.post(
        "/actions/apply", data={**form, "csrf": csrf_of(otto, "/"), "reason": "x"}, headers=SAME
    )
    assert theirs.status_code == 409
    refused = vic.post(
        "/actions/apply", data={**form, "csrf": csrf_of(vic, "/"), "reason": "x"}, headers=SAME
    )
    assert refused.status_code == 403
    assert vic.get("/actions/preview", params={"action": "resolve_delivered"}).status_code == 403
    started = olga.post("/actions/apply", data={**form, "reason": "seen in SES"}, headers=SAME)
    path = job_path(started)
    assert reached.wait(10)
    assert olga.get(path).status_code == 200
    assert otto.get(path).status_code == 404
    assert "No such job" in otto.get(path).text
    assert vic.get(path).status_code == 403
    assert olga.get("/actions/jobs/not-a-job").status_code == 404
    go.set()
    assert OUTCOME.findall(finished_job(olga, started).text) == [
        "resolved 2 message(s) as delivered (sent)"
    ]
    assert otto.get(path).status_code == 404


def test_with_every_job_slot_running_a_confirmation_waits_and_keeps_its_preview(
    engine, users, held, monkeypatch
):
    reached, go = held
    monkeypatch.setattr(actions, "JOBS", 1)
    ids = enqueue(engine, 4, short=True)
    set_rows(engine, ids, status="failed")
    c = client(engine, users)
    login(c, OLGA)
    _, first = preview_form(c, action="requeue", status="failed")
    _, second = preview_form(c, action="requeue", status="failed")
    started = c.post("/actions/apply", data=first, headers=SAME)
    assert reached.wait(10)
    busy = c.post("/actions/apply", data=second, headers=SAME)
    assert busy.status_code == 503
    assert "1 bulk changes are running in this console" in busy.text
    go.set()
    assert OUTCOME.findall(finished_job(c, started).text) == ["requeued 4 message(s)"]
    # the first ended: the second preview's confirmation starts now (and moves nothing:
    # every message it counted was requeued since)
    later = finished_job(c, c.post("/actions/apply", data=second, headers=SAME))
    assert OUTCOME.findall(later.text) == [
        "requeued 0 message(s) (4 moved meanwhile and were left alone)"
    ]


def test_a_job_the_console_forgets_is_no_longer_shown(engine, users, monkeypatch):
    """Ended jobs are kept ``JOB_SECONDS``, then forgotten: the store stays bounded."""
    monkeypatch.setattr(actions, "JOB_SECONDS", 0.0)
    ids = enqueue(engine, 1, short=True)
    set_rows(engine, ids, status="failed")
    c = client(engine, users)
    login(c, OLGA)
    _, form = preview_form(c, action="requeue", status="failed")
    started = c.post("/actions/apply", data=form, headers=SAME)
    path = job_path(started)

    wait_for(lambda: statuses_of(engine, ids) == ["pending"], what="the job's change")
    wait_for(lambda: c.get(path).status_code == 404, what="the ended job forgotten")


def test_an_action_form_is_read_only_url_encoded_and_bounded(engine, users):
    """An apply's body is read only once the site is checked, only URL-encoded (a multipart
    upload is never spooled to disk) and only up to ``ACTION_FORM_BYTES``."""
    c = client(engine, users)
    login(c, OLGA)
    token = csrf_of(c, "/")
    upload = c.post(
        "/actions/apply", files={"big": ("x.bin", b"x" * 1024)}, data={"csrf": token}, headers=SAME
    )
    assert upload.status_code == 415
    huge = c.post(
        "/actions/apply",
        content=b"csrf=" + token.encode() + b"&reason=" + b"a" * actions.ACTION_FORM_BYTES,
        headers={**SAME, "content-type": "application/x-www-form-urlencoded"},
    )
    assert huge.status_code == 413
    cross = c.post(
        "/actions/apply", files={"big": ("x.bin", b"x")}, headers={"Sec-Fetch-Site": "cross-site"}
    )
    assert cross.status_code == 403
