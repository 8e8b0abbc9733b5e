"""The console's actions: requeue, cancel and resolve one message, and requeue or cancel
everything a filter matches after a preview. Operators only, each POST behind the session's
CSRF token and the fetch-site check. They run the commands' own code
(:mod:`relay.admin.change`, :mod:`relay.admin.batches`): the same guards, the same batches,
the same attempt rows and operators' log, with the signed-in user as the actor."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
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
from relay.console.guard import Session, cross_site, csrf_matches
from relay.console.views import BadFilter, Pages, message_filter, number

__all__ = ["BULK", "Actions", "Bulk"]


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


def _reason(form: FormData) -> str | None:
    text = str(form.get("reason", "")).strip()
    return text[:1000] or None


class Actions:
    """The action routes of one console, over its :class:`Pages`."""

    def __init__(self, pages: Pages) -> None:
        self.pages = pages

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

        def work() -> str:
            if message_id is None:
                raise click.ClickException("no such message")
            if action in BULK:
                bulk = BULK[action]
                with engine.connect() as conn:
                    ids, _ = select_for_change(
                        conn, [message_id], store.Filter(), bulk.allowed, bulk.verb,
                        needs_body=bulk.needs_body,
                    )  # fmt: skip
                done = in_batches(
                    engine, ids, reason, bulk.change(actor), by_id=True, apply=bulk.apply,
                    advance=lambda _n: None,
                )  # fmt: skip
                if not done:
                    return f"message {message_id} moved on meanwhile: nothing changed"
                return f"{bulk.done_as.value} message {message_id}"
            if action in ("resolve_delivered", "resolve_not_delivered"):
                delivered = action == "resolve_delivered"
                provider_id = str(form.get("provider_message_id", "")).strip() or None
                if delivered:
                    check_provider_id(provider_id)
                result = resolve_one(
                    engine, message_id, delivered=delivered, provider_message_id=provider_id,
                    reason=reason, actor=actor,
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
            ids, left_out = select_for_change(
                conn, (), flt, bulk.allowed, bulk.verb, needs_body=bulk.needs_body
            )
            asked = flt.statuses or tuple(s.value for s in Status)
            sending = Status.PROCESSING.value
            return {
                "matched": store.count_messages(conn, flt),
                "chosen": len(ids),
                "upto": max(ids, default=0),
                "left_out": len(left_out),
                "sending": store.count_messages(conn, dataclasses.replace(flt, statuses=(sending,)))
                if sending in asked
                else 0,
            }

        try:
            found = await self.pages.read(work)
        except click.ClickException as refused:
            return self._result(request, session, 409, outcome=refused.format_message(), back=None)
        hidden = [(k, v) for k, v in q.multi_items() if k in _FILTER_FIELDS]
        return self.pages.render(
            request, "preview.html", session, bulk=bulk, hidden=hidden, **found
        )

    async def apply(self, request: Request, session: Session) -> Response:
        """POST /actions/apply: the previewed change, to the messages matching the filter now
        that were there at the preview (ids up to the preview's highest), in batches."""
        form = await self._form(request, session)
        if isinstance(form, Response):
            return form
        bulk = BULK.get(str(form.get("action", "")))
        upto = number(str(form.get("upto", "")))
        if bulk is None or upto is None:
            return self._result(request, session, 400, outcome="an incomplete form", back=None)
        try:
            flt = message_filter(form)
        except BadFilter as bad:
            return self._result(request, session, 400, outcome=str(bad), back=None)
        reason, actor, engine = _reason(form), session.user.name, self.pages.engine

        def work() -> str:
            with engine.connect() as conn:
                ids, _ = select_for_change(
                    conn, (), flt, bulk.allowed, bulk.verb, needs_body=bulk.needs_body
                )
            chosen = sorted(i for i in ids if i <= upto)
            done = in_batches(
                engine, chosen, reason, bulk.change(actor), by_id=False, apply=bulk.apply,
                advance=lambda _n: None,
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
