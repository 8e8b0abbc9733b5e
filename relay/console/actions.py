"""The console's actions: requeue, cancel and resolve one message, and requeue or cancel
everything a filter matches after a preview. Operators only, each POST behind the session's
CSRF token and the fetch-site check. They run the commands' own code
(:mod:`relay.admin.change`, :mod:`relay.admin.batches`): the same guards, the same batches,
the same attempt rows and operators' log, with the signed-in user as the actor."""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import click
import sqlalchemy as sa
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import Response

from outbox.schema import AttemptOutcome, OperatorAction, Status
from relay import store
from relay.admin.batches import Change, in_batches
from relay.admin.change import check_provider_id, resolve_one, select_for_change
from relay.admin.suppressions import add_manual, remove
from relay.clock import read_database_time
from relay.console.guard import Session, cross_site, csrf_matches
from relay.console.views import BadFilter, Pages, message_filter, number

__all__ = [
    "ACTION_FORM_BYTES",
    "BULK",
    "PREVIEWS",
    "PREVIEW_SECONDS",
    "Actions",
    "Bulk",
    "Preview",
    "Previews",
]


@dataclass(frozen=True, slots=True)
class Bulk:
    """A change the console makes by ids or by filter, as its command does."""

    verb: str
    done_as: AttemptOutcome
    action: OperatorAction
    allowed: tuple[str, ...]
    needs_body: bool  # it sends the message again: not without its body

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
        "requeue", AttemptOutcome.REQUEUED, OperatorAction.REQUEUE, store.REQUEUEABLE, True
    ),
    "cancel": Bulk(
        "cancel", AttemptOutcome.CANCELLED, OperatorAction.CANCEL, store.CANCELLABLE, False
    ),
}
_FILTER_FIELDS = ("status", "category", "key", "error", "from", "until", "delivery", "recipient")


PREVIEW_SECONDS = 900.0  # how long a bulk preview may wait for its confirmation
PREVIEWS = 32  # previews one process keeps waiting (a million ids take 8 MB)
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

    verb: str
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


class Actions:
    """The action routes of one console, over its :class:`Pages`."""

    def __init__(self, pages: Pages) -> None:
        self.pages = pages
        self.previews = Previews()

    async def _form(self, request: Request, session: Session) -> FormData | Response:
        """The POSTed form, or the refusal of a form another site sent or a stale one."""
        form = await request.form()
        token = form.get("csrf")
        if cross_site(request) or not csrf_matches(
            session, token if isinstance(token, str) else None
        ):
            return self.pages.render(
                request, "refused.html", session, 403, why="Refused: not this site's form."
            )
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
        """GET /actions/preview: what a bulk change of the filter would do, and its form."""
        q = request.query_params
        bulk = BULK.get(q.get("action", ""))
        if bulk is None:
            return self._result(request, session, 404, outcome="no such action", back=None)
        try:
            flt = message_filter(q)
        except BadFilter as bad:
            return self._result(request, session, 400, outcome=str(bad), back=None)

        def work(conn: sa.Connection) -> dict[str, Any]:
            seen_at = read_database_time(conn)
            ids, left_out = select_for_change(
                conn, (), flt, bulk.allowed, bulk.verb, needs_body=bulk.needs_body
            )
            asked = flt.statuses or tuple(s.value for s in Status)
            sending = Status.PROCESSING.value
            return {
                "matched": store.count_messages(conn, flt),
                "ids": ids,
                "seen_at": seen_at,
                "left_out": len(left_out),
                "sending": store.count_messages(conn, dataclasses.replace(flt, statuses=(sending,)))
                if sending in asked
                else 0,
            }

        try:
            found = await self.pages.read(work)
        except click.ClickException as refused:
            return self._result(request, session, 409, outcome=refused.format_message(), back=None)
        ids = found.pop("ids")
        token = self.previews.keep(
            Preview(
                verb=bulk.verb, actor=session.user.name, ids=array("q", ids),
                seen_at=found.pop("seen_at"),
            )
        )  # fmt: skip
        hidden = [(k, v) for k, v in q.multi_items() if k in _FILTER_FIELDS]
        return self.pages.render(
            request, "preview.html", session, bulk=bulk, hidden=hidden, chosen=len(ids),
            preview=token, **found,
        )  # fmt: skip

    async def apply(self, request: Request, session: Session) -> Response:
        """POST /actions/apply: the previewed change, to exactly the messages the preview
        counted, each only if it has not changed since (a message that moved, or that
        committed after, is left alone and counted), in batches. A preview is applied once."""
        form = await self._form(request, session)
        if isinstance(form, Response):
            return form
        preview = self.previews.take(str(form.get("preview", "")), session.user.name)
        if preview is None:
            return self._result(
                request, session, 409, back=None,
                outcome="this preview was applied already, or expired: preview again",
            )  # fmt: skip
        bulk = BULK[preview.verb]
        reason, actor, engine = _reason(form), session.user.name, self.pages.engine

        def work() -> str:
            chosen = list(preview.ids)
            done = in_batches(
                engine, chosen, reason, bulk.change(actor), by_id=False, apply=bulk.apply,
                advance=lambda _n: None, unchanged_since=preview.seen_at,
            )  # fmt: skip
            moved = len(chosen) - len(done)
            tail = f" ({moved} moved meanwhile and were left alone)" if moved else ""
            return f"{bulk.done_as.value} {len(done)} message(s){tail}"

        try:
            said = await run_in_threadpool(work)
        except click.ClickException as refused:
            return self._result(request, session, 409, outcome=refused.format_message(), back=None)
        return self._result(request, session, 200, outcome=said, back=None)

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
