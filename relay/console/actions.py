"""The console's actions: requeue, cancel and resolve one message, and requeue, cancel or
resolve everything a filter matches after a preview. Operators only, each POST behind the
session's CSRF token and the fetch-site check. They run the commands' own code
(:mod:`relay.admin.change`, :mod:`relay.admin.batches`): the same guards, the same batches,
the same attempt rows and operators' log, with the signed-in user as the actor.

A bulk change runs as a :class:`Job` on a thread of the console process, so its page can
say how far it got while it runs (and a long one outlives no request's timeout)."""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import click
import sqlalchemy as sa
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from outbox.schema import AttemptOutcome, OperatorAction, Status, messages
from relay import store
from relay.admin.batches import Change, in_batches
from relay.admin.change import check_provider_id, resolve_one, select_for_change
from relay.admin.suppressions import add_manual, remove
from relay.clock import read_database_time
from relay.console.guard import Session, cross_site, csrf_matches, read_form
from relay.console.views import BadFilter, Pages, message_filter, number

__all__ = [
    "ACTION_FORM_BYTES",
    "BULK",
    "JOBS",
    "JOB_SECONDS",
    "PREVIEWS",
    "PREVIEW_SECONDS",
    "RESOLVES",
    "SKIPPED_SHOWN",
    "Actions",
    "Bulk",
    "Job",
    "Jobs",
    "Preview",
    "Previews",
    "job_step",
]

_log = logging.getLogger("relay.console")


@dataclass(frozen=True, slots=True)
class Bulk:
    """A change the console makes by ids or by filter, as its command does."""

    verb: str  # what the preview says it does: requeue, resolve as delivered, ...
    done_as: AttemptOutcome
    action: OperatorAction  # its log rows' action; its value names it in the URLs
    allowed: tuple[str, ...]
    needs_body: bool  # it sends the message again: not without its body
    past: str  # what the outcome says: requeued, cancelled, resolved
    delivered: bool | None = None  # a resolve's verdict; None: a requeue or a cancel

    def change(self, actor: str) -> Change:
        return Change(
            actor=actor,
            verb=self.verb,
            done_as=self.done_as,
            action=self.action,
            allowed=self.allowed,
        )

    @property
    def apply(self) -> Any:
        return store.requeue_many if self.action is OperatorAction.REQUEUE else store.cancel_many


BULK = {
    "requeue": Bulk(
        "requeue", AttemptOutcome.REQUEUED, OperatorAction.REQUEUE, store.REQUEUEABLE, True,
        "requeued",
    ),
    "cancel": Bulk(
        "cancel", AttemptOutcome.CANCELLED, OperatorAction.CANCEL, store.CANCELLABLE, False,
        "cancelled",
    ),
}  # fmt: skip
# A bulk resolve takes unknown_outcome messages only, though resolve_one takes more one at a
# time: a filter left too wide must not mark pending mail sent, nor requeue failed mail that
# an operator meant to look at. Each message then goes through resolve_one, its own guard.
RESOLVES = {
    "resolve_delivered": Bulk(
        "resolve as delivered", AttemptOutcome.RESOLVED, OperatorAction.RESOLVE_DELIVERED,
        (Status.UNKNOWN_OUTCOME.value,), False, "resolved", delivered=True,
    ),
    "resolve_not_delivered": Bulk(
        "resolve as not delivered", AttemptOutcome.REQUEUED,
        OperatorAction.RESOLVE_NOT_DELIVERED, (Status.UNKNOWN_OUTCOME.value,), True, "resolved",
        delivered=False,
    ),
}  # fmt: skip
# why a bulk resolve's preview skips the messages of each other status
_NOT_RESOLVED = {
    Status.PENDING.value: "not sent yet: the relay will send them",
    Status.RETRYING.value: "not sent yet: the relay will try them again",
    Status.PROCESSING.value: "being sent right now: the relay will say how it went",
    Status.SENT.value: "already sent",
    Status.FAILED.value: "failed: requeue them, or resolve one on its own page",
    Status.CANCELLED.value: "cancelled: the outbox never sent them",
    Status.EXPIRED.value: "expired before they were sent: resolve one on its own page",
}
_FILTER_FIELDS = ("status", "category", "key", "error", "from", "until", "delivery", "recipient")


PREVIEW_SECONDS = 900.0  # how long a bulk preview may wait for its confirmation
PREVIEWS = 32  # previews one process keeps waiting (a million ids take 8 MB)
JOBS = 32  # bulk changes one process keeps, running or ended; all running: a new one waits
JOB_SECONDS = 3600.0  # how long an ended bulk change's page can still be read
SKIPPED_SHOWN = 100  # the messages a bulk resolve refused that its page lists one by one
ACTION_FORM_BYTES = 1 << 20  # an operator's form: a suppression list of thousands fits


def _moment(text: str) -> datetime | None:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _reason(form: FormData) -> str | None:
    text = str(form.get("reason", "")).strip()
    return text[:1000] or None


@dataclass(frozen=True, slots=True)
class Preview:
    """What a bulk preview showed: the ids it counted, as of the database's ``seen_at``."""

    action: str  # the key of its change in BULK or RESOLVES
    actor: str
    ids: array[int]
    seen_at: datetime


class Previews:
    """The previews waiting for their confirmation, in this process: each applied at most
    once, by the user who made it, within ``PREVIEW_SECONDS``; the oldest forgotten past
    ``PREVIEWS``. A confirmation that reaches another replica is refused (preview again)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, tuple[float, Preview]] = OrderedDict()

    def keep(self, preview: Preview) -> str:
        token = secrets.token_urlsafe(24)
        with self._lock:
            self._kept[token] = (time.monotonic() + PREVIEW_SECONDS, preview)
            while len(self._kept) > PREVIEWS:
                self._kept.popitem(last=False)
        return token

    def take(self, token: str, actor: str) -> Preview | None:
        with self._lock:
            kept = self._kept.get(token)
            if kept is None or kept[1].actor != actor:
                return None
            del self._kept[token]
        until, preview = kept
        return preview if until > time.monotonic() else None

    def peek(self, token: str, actor: str) -> Preview | None:
        """The preview :meth:`take` would give, left waiting: its form is checked first, so
        a confirmation refused for a missing field can be sent again."""
        with self._lock:
            kept = self._kept.get(token)
        if kept is None or kept[1].actor != actor or kept[0] <= time.monotonic():
            return None
        return kept[1]


def job_step(job: Job) -> None:
    """Called on a job's thread each time its progress is counted: does nothing.

    The test seam of a job caught mid-way: tests/integration/test_console_bulk.py replaces
    it (monkeypatch) with one that waits on a ``threading.Event``, so a page fetched then
    shows a partial count for certain, or with one that raises, to stop a job with an
    error. Nothing else uses it."""


class Job:
    """One bulk change, running on a thread of the console process: how far it got and,
    once it ended, its outcome. A job that stopped on an error ends refused, saying what
    was done; its page shows that, never a silence."""

    def __init__(self, actor: str, bulk: Bulk, total: int) -> None:
        self.actor, self.bulk, self.total = actor, bulk, total
        self._lock = threading.Lock()
        self._done = 0  # messages gone through (changed, moved meanwhile or refused)
        self._skipped: list[tuple[int, str]] = []  # (id, why) of the first refused
        self._skipped_count = 0
        self._outcome: str | None = None
        self._refused = False
        self.ended: float | None = None  # time.monotonic() at its end

    def advance(self, n: int) -> None:
        """Count ``n`` more messages gone through (in_batches' ``advance``)."""
        with self._lock:
            self._done += n
        job_step(self)

    def skip(self, message_id: int, why: str) -> None:
        """A message the change's guard refused, and its reason."""
        with self._lock:
            self._skipped_count += 1
            if len(self._skipped) < SKIPPED_SHOWN:
                self._skipped.append((message_id, why))

    def end(self, outcome: str, *, refused: bool) -> None:
        """The job ended: with ``outcome``, a refusal when ``refused`` (it stopped)."""
        with self._lock:
            self._outcome, self._refused = outcome, refused
            self.ended = time.monotonic()

    def state(self) -> dict[str, Any]:
        """What its page shows, read at once."""
        with self._lock:
            return {
                "verb": self.bulk.verb,
                "past": self.bulk.past,
                "total": self.total,
                "done": self._done,
                "running": self._outcome is None,
                "outcome": self._outcome,
                "refused": self._refused,
                "skipped": list(self._skipped),
                "skipped_count": self._skipped_count,
            }


class Jobs:
    """The bulk changes of this process and their threads: each seen only by the user who
    started it, kept ``JOB_SECONDS`` after it ends; past ``JOBS`` the oldest ended one is
    forgotten, and while ``JOBS`` are running no other starts. Per process, as previews
    are: another replica knows nothing of a job."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, Job] = OrderedDict()

    def _forget(self, *, making_room: bool = False) -> None:
        """Drop the ended jobs past their time and, ``making_room`` for a new one, the
        oldest ended ones past ``JOBS`` (under the lock)."""
        now = time.monotonic()
        ended = [t for t, job in self._kept.items() if job.ended is not None]
        for token in ended:
            until = self._kept[token].ended
            if until is not None and until + JOB_SECONDS <= now:
                del self._kept[token]
        ended = [t for t in ended if t in self._kept]
        while making_room and len(self._kept) >= JOBS and ended:
            del self._kept[ended.pop(0)]

    def room(self) -> bool:
        """Whether a job could start now."""
        with self._lock:
            self._forget(making_room=True)
            return len(self._kept) < JOBS

    def start(self, job: Job, work: Callable[[Job], str]) -> str | None:
        """Run ``work(job)`` on a thread of its own; its token, or None when ``JOBS`` are
        running. What ``work`` returns is the job's outcome; what it raises, its refusal."""
        token = secrets.token_urlsafe(24)
        with self._lock:
            self._forget(making_room=True)
            if len(self._kept) >= JOBS:
                return None
            self._kept[token] = job
        thread = threading.Thread(
            target=_run, args=(job, work), name=f"console-job-{token[:6]}", daemon=True
        )
        try:
            thread.start()
        except RuntimeError as exc:  # no thread to be had
            job.end(f"could not start: {exc}; nothing changed", refused=True)
        return token

    def get(self, token: str, actor: str) -> Job | None:
        """The job of ``token`` if ``actor`` started it."""
        with self._lock:
            self._forget()
            job = self._kept.get(token)
        return job if job is not None and job.actor == actor else None


def _run(job: Job, work: Callable[[Job], str]) -> None:
    """A job's thread: its outcome, or the error that stopped it, always on its page."""
    try:
        outcome = work(job)
    except click.ClickException as refused:  # in_batches' Interrupted says what it did
        job.end(refused.format_message(), refused=True)
    except Exception as exc:
        _log.exception("a bulk change stopped on an error", extra={"action": "console_job"})
        said = (str(exc).strip().splitlines() or [""])[0]
        job.end(
            f"stopped by an error ({type(exc).__name__}: {said}) after going through "
            f"{job.state()['done']:,} of {job.total:,} message(s): those are done as the "
            "messages page shows, the others unchanged; preview again to finish",
            refused=True,
        )
    else:
        job.end(outcome, refused=False)


def _changed_since(
    engine: sa.Engine, message_id: int, seen_at: datetime, allowed: tuple[str, ...]
) -> bool:
    """Whether a message is gone, changed after ``seen_at`` or out of the ``allowed``
    statuses: what resolve_one's ``unchanged_since`` and ``only`` guards refuse, told apart
    from its other refusals."""
    with engine.connect() as conn:
        found = conn.execute(
            sa.select(messages.c.id).where(
                messages.c.id == message_id,
                messages.c.updated_at <= seen_at,
                messages.c.status.in_(allowed),
            )
        ).first()
    return found is None


class Actions:
    """The action routes of one console, over its :class:`Pages`."""

    def __init__(self, pages: Pages) -> None:
        self.pages = pages
        self.previews = Previews()
        self.jobs = Jobs()

    async def _form(self, request: Request, session: Session) -> FormData | Response:
        """The POSTed form, or the refusal of a form another site sent or a stale one. The
        site is checked before the body is read, and only a URL-encoded body of at most
        ``ACTION_FORM_BYTES`` is read."""

        def refused() -> Response:
            return self.pages.render(
                request, "refused.html", session, 403, why="Refused: not this site's form."
            )

        if cross_site(request):
            return refused()
        form = await read_form(request, ACTION_FORM_BYTES)
        if isinstance(form, Response):
            return form
        token = form.get("csrf")
        if not csrf_matches(session, token if isinstance(token, str) else None):
            return refused()
        return form

    def _result(self, request: Request, session: Session, status: int, **data: Any) -> Response:
        return self.pages.render(
            request, "result.html", session, status, status_ok=status < 400, **data
        )

    async def one(self, request: Request, session: Session) -> Response:
        """POST /messages/{id}/act: requeue, cancel, resolve_delivered or resolve_not_delivered."""
        form = await self._form(request, session)
        if isinstance(form, Response):
            return form
        message_id = number(request.path_params["message_id"])
        action = str(form.get("action", ""))
        reason, actor = _reason(form), session.user.name
        engine = self.pages.engine
        # the row as the page showed it: a replayed or stale form changes nothing
        version = _moment(str(form.get("version", "")))

        def work() -> str:
            if message_id is None:
                raise click.ClickException("no such message")
            if version is None:
                raise click.ClickException("an incomplete form: look at the message again")
            if action in BULK:
                bulk = BULK[action]
                with engine.connect() as conn:
                    ids, _ = select_for_change(
                        conn, [message_id], store.Filter(), bulk.allowed, bulk.verb,
                        needs_body=bulk.needs_body,
                    )  # fmt: skip
                done = in_batches(
                    engine, ids, reason, bulk.change(actor), by_id=True, apply=bulk.apply,
                    advance=lambda _n: None, unchanged_since=version,
                )  # fmt: skip
                if not done:
                    raise click.ClickException(
                        f"message {message_id} changed since you looked at it: nothing "
                        "changed; look at it again"
                    )
                return f"{bulk.done_as.value} message {message_id}"
            if action in ("resolve_delivered", "resolve_not_delivered"):
                delivered = action == "resolve_delivered"
                provider_id = str(form.get("provider_message_id", "")).strip() or None
                if delivered:
                    check_provider_id(provider_id)
                result = resolve_one(
                    engine, message_id, delivered=delivered, provider_message_id=provider_id,
                    reason=reason, actor=actor, unchanged_since=version,
                )  # fmt: skip
                how = "delivered: sent" if delivered else "not delivered: requeued"
                return f"resolved message {message_id} as {how} (was {result['previous_status']})"
            raise click.ClickException(f"no such action: {action!r}")

        try:
            said = await run_in_threadpool(work)
        except click.ClickException as refused:
            return self._result(
                request, session, 409, outcome=refused.format_message(), back=message_id
            )
        return self._result(request, session, 200, outcome=said, back=message_id)

    async def preview(self, request: Request, session: Session) -> Response:
        """GET /actions/preview: what a bulk change of the filter would do, and its form. A
        requeue or cancel refuses a filter that asks for a status it cannot change; a resolve
        takes the filter's unknown_outcome messages and says what it skips, and why."""
        q = request.query_params
        bulk = BULK.get(q.get("action", "")) or RESOLVES.get(q.get("action", ""))
        if bulk is None:
            return self._result(request, session, 404, outcome="no such action", back=None)
        try:
            flt = message_filter(q)
        except BadFilter as bad:
            return self._result(request, session, 400, outcome=str(bad), back=None)
        resolving = bulk.delivered is not None

        def work(conn: sa.Connection) -> dict[str, Any]:
            seen_at = read_database_time(conn)
            asked = flt.statuses or tuple(s.value for s in Status)
            wanted = tuple(s for s in asked if s in bulk.allowed) if resolving else asked
            ids: list[int] = []
            left_out: list[int] = []
            if wanted:
                ids, left_out = select_for_change(
                    conn, (), dataclasses.replace(flt, statuses=flt.statuses and wanted),
                    bulk.allowed, bulk.verb, needs_body=bulk.needs_body,
                )  # fmt: skip
            skipped = []
            for status in asked if resolving else ():
                if status not in bulk.allowed:
                    one = dataclasses.replace(flt, statuses=(status,))
                    if count := store.count_messages(conn, one):
                        skipped.append((count, status, _NOT_RESOLVED.get(status, "")))
            sending = Status.PROCESSING.value
            return {
                "matched": store.count_messages(conn, flt),
                "ids": ids,
                "seen_at": seen_at,
                "left_out": len(left_out),
                "skipped": skipped,
                "sending": store.count_messages(conn, dataclasses.replace(flt, statuses=(sending,)))
                if sending in asked and not resolving
                else 0,
            }

        try:
            found = await self.pages.read(work)
        except click.ClickException as refused:
            return self._result(request, session, 409, outcome=refused.format_message(), back=None)
        ids = found.pop("ids")
        token = self.previews.keep(
            Preview(
                action=bulk.action.value, actor=session.user.name, ids=array("q", ids),
                seen_at=found.pop("seen_at"),
            )
        )  # fmt: skip
        hidden = [(k, v) for k, v in q.multi_items() if k in _FILTER_FIELDS]
        return self.pages.render(
            request, "preview.html", session, bulk=bulk, hidden=hidden, chosen=len(ids),
            preview=token, resolving=resolving, **found,
        )  # fmt: skip

    async def apply(self, request: Request, session: Session) -> Response:
        """POST /actions/apply: start the previewed change, to exactly the messages the
        preview counted, each only if it has not changed since (a message that moved, or that
        committed after, is left alone and counted), as a job of this process; answers with
        a redirect to the job's page. A preview is applied once."""
        form = await self._form(request, session)
        if isinstance(form, Response):
            return form
        token, actor = str(form.get("preview", "")), session.user.name
        preview = self.previews.peek(token, actor)
        if preview is None:
            return self._result(
                request, session, 409, back=None,
                outcome="this preview was applied already, or expired: preview again",
            )  # fmt: skip
        bulk = BULK.get(preview.action) or RESOLVES[preview.action]
        reason = _reason(form)
        if bulk.delivered is not None and reason is None:
            return self._result(
                request, session, 400, back=None,
                outcome="reason: required to resolve messages in bulk (it goes to the "
                "operators' log): go back and give one",
            )  # fmt: skip
        if not self.jobs.room():
            return self._result(
                request, session, 503, back=None,
                outcome=f"{JOBS} bulk changes are running in this console: wait for one to "
                "end, then confirm again",
            )  # fmt: skip
        if self.previews.take(token, actor) is None:
            return self._result(
                request, session, 409, back=None,
                outcome="this preview was applied already, or expired: preview again",
            )  # fmt: skip
        work = _resolve_work if bulk.delivered is not None else _batch_work
        started = self.jobs.start(
            Job(actor, bulk, len(preview.ids)),
            lambda job: work(self.pages.engine, bulk, preview, reason, job),
        )
        if started is None:
            return self._result(
                request, session, 503, back=None,
                outcome=f"{JOBS} bulk changes are running in this console: wait for one to "
                "end, then preview again",
            )  # fmt: skip
        base = request.scope.get("root_path", "")
        return RedirectResponse(f"{base}/actions/jobs/{started}", status_code=303)

    async def job(self, request: Request, session: Session) -> Response:
        """GET /actions/jobs/{token}: how far a bulk change got; while it runs the page
        reloads itself every second (a meta refresh: no script needed), once it ended it
        says the outcome, or the refusal that stopped it. Only its operator sees it."""
        job = self.jobs.get(str(request.path_params["token"]), session.user.name)
        if job is None:
            return self.pages.render(
                request, "refused.html", session, 404,
                why="No such job: a job is shown to the operator who started it, by the "
                "console process that runs it, for an hour after it ends.",
            )  # fmt: skip
        state = job.state()
        return self.pages.render(
            request, "job.html", session, 409 if state["refused"] else 200, job=state
        )

    async def suppress(self, request: Request, session: Session) -> Response:
        """POST /suppressions/add: never mail these addresses (one a line, or separated by
        spaces or commas), with a reason; POST /suppressions/remove: mail them again."""
        form = await self._form(request, session)
        if isinstance(form, Response):
            return form
        adding = request.url.path.endswith("/add")
        text = str(form.get("addresses", ""))
        addresses = [a for a in text.replace(",", " ").split() if a]
        reason, actor, engine = _reason(form), session.user.name, self.pages.engine

        def work() -> str:
            if not addresses:
                raise click.ClickException("no address given")
            if adding:
                added, kept = add_manual(engine, addresses, reason=reason or "", actor=actor)
                already = f"; already suppressed: {', '.join(kept)}" if kept else ""
                return f"suppressed {len(added)} address(es){already}"
            removed = remove(engine, addresses, reason=reason, actor=actor)
            return f"removed {len(removed)} address(es) from the suppressions"

        try:
            said = await run_in_threadpool(work)
        except click.ClickException as refused:
            return self._result(
                request,
                session,
                409,
                outcome=refused.format_message(),
                back=None,
                to="suppressions",
            )
        return self._result(request, session, 200, outcome=said, back=None, to="suppressions")


def _batch_work(
    engine: sa.Engine, bulk: Bulk, preview: Preview, reason: str | None, job: Job
) -> str:
    """A requeue or cancel job: the command's batches, their progress counted on ``job``."""
    chosen = list(preview.ids)
    done = in_batches(
        engine, chosen, reason, bulk.change(preview.actor), by_id=False, apply=bulk.apply,
        advance=job.advance, unchanged_since=preview.seen_at,
    )  # fmt: skip
    moved = len(chosen) - len(done)
    tail = f" ({moved} moved meanwhile and were left alone)" if moved else ""
    return f"{bulk.done_as.value} {len(done)} message(s){tail}"


def _resolve_work(
    engine: sa.Engine, bulk: Bulk, preview: Preview, reason: str | None, job: Job
) -> str:
    """A resolve job: resolve_one for each message, as the command resolves one, each in its
    own transaction under its own guard; a message changed since the preview is left alone
    and counted, one refused for another reason is listed with that reason, and the others
    go on. A database error stops the job, saying how far it got."""
    delivered = bool(bulk.delivered)
    resolved = moved = 0
    for message_id in preview.ids:
        try:
            try:
                resolve_one(
                    engine, message_id, delivered=delivered, provider_message_id=None,
                    reason=reason, actor=preview.actor, unchanged_since=preview.seen_at,
                    only=bulk.allowed,
                )  # fmt: skip
            except click.ClickException as refused:
                if _changed_since(engine, message_id, preview.seen_at, bulk.allowed):
                    moved += 1
                else:
                    job.skip(message_id, refused.format_message())
            else:
                resolved += 1
        except sa.exc.DBAPIError as exc:
            said = (str(exc.orig or exc).strip().splitlines() or [""])[0]
            raise click.ClickException(
                f"database error: {said}: resolved {resolved} of {len(preview.ids)} "
                f"message(s); message {message_id} may or may not have been (its page says), "
                "the ones after it are unchanged: preview again to resolve them"
            ) from None
        job.advance(1)
    how = "delivered (sent)" if delivered else "not delivered (requeued)"
    parts = [f"resolved {resolved} message(s) as {how}"]
    if moved:
        parts.append(f"{moved} changed since the preview and were left alone")
    skipped = job.state()["skipped_count"]
    if skipped:
        parts.append(f"{skipped} refused, each for the reason listed")
    return "; ".join(parts)
