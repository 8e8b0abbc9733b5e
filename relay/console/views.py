"""The console's pages: what each reads (through :mod:`relay.store`, the statements the
command line reads with) and which template shows it. Every page answers without
JavaScript; a viewer sees addresses masked and never a body."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, QueryParams
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse

from outbox.schema import DeliveryStatus, Status
from relay import store
from relay.clock import read_database_time
from relay.console.guard import (
    LoginThrottle,
    Session,
    Sessions,
    cross_site,
    csrf_matches,
    read_form,
)
from relay.console.live import LiveWake
from relay.console.masking import Shown
from relay.console.sanitize import clean_email_html
from relay.console.users import Role, User
from relay.store import operator as ops

__all__ = [
    "CHART_HEIGHT",
    "HERE",
    "LIVE_COALESCE",
    "LIVE_LIMIT",
    "LIVE_PER_USER",
    "LIVE_SECONDS",
    "LIVE_STREAMS",
    "LOGIN_FORM_BYTES",
    "MAX_PAGE",
    "PAGE_SIZE",
    "BadFilter",
    "Pages",
    "message_filter",
    "number",
]

HERE = Path(__file__).parent
PAGE_SIZE = 50
LOGIN_FORM_BYTES = 16 * 1024  # a login or logout form: names, a password, a token
LIVE_PER_USER = 5  # live streams one user may hold open at once
MAX_PAGE = 2000  # the suppressions page pages by number, up to 100,000 addresses deep
LIVE_SECONDS = 5.0  # how often an open overview's counts are sent again
LIVE_COALESCE = 0.5  # after a NOTIFY, the wait for more before reading the counts once
LIVE_LIMIT = 600.0  # a live stream ends after this and the browser opens another
LIVE_STREAMS = 50  # live streams one console process serves at once
_REVIEW = {"bounce_rate": 0.05, "complaint_rate": 0.001}  # the rates SES reviews an account at


class BadFilter(ValueError):
    """A filter value no page takes: said on a 400 page."""


def message_filter(params: QueryParams | FormData, *, prefixes: bool = True) -> store.Filter:
    """The messages a page's filters (its query, or a form that repeats them) mean; a status
    that is not one, or a date that is not one, is ignored. ``prefixes``: a key ending in
    ``*`` matches as a prefix (operators; a viewer looks up exact keys only, so the key
    filter cannot spell out a key the page masks; nor do they search by recipient).
    Refuses control characters."""
    values = [str(v) for _, v in params.multi_items()]
    if any(ch < " " or ch == "\x7f" for value in values for ch in value):
        raise BadFilter("a filter holds a control character")
    known = {m.value for m in Status}
    key = str(params.get("key") or "") or None
    if key is not None and key.endswith("*") and not prefixes:
        raise BadFilter("viewers look up exact keys only (no prefix*)")
    recipient = str(params.get("recipient") or "").strip().lower() or None
    if recipient is not None and not prefixes:
        raise BadFilter("viewers cannot search by recipient (it would spell out the addresses)")
    delivery = str(params.get("delivery") or "") or None
    return store.Filter(
        recipient=recipient,
        delivery_status=delivery,
        statuses=tuple(s for s in params.getlist("status") if s in known),
        categories=tuple(str(c) for c in params.getlist("category") if c),
        key=key,
        error_code=str(params.get("error") or "") or None,
        created_after=_day(str(params.get("from") or "")),
        created_before=_day(str(params.get("until") or "")),
    )


def _when(value: Any) -> str:
    if not isinstance(value, datetime):
        return "" if value is None else str(value)
    moment: datetime = value if value.tzinfo else value.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") + "Z"


_ID = re.compile(r"[0-9]{1,18}", re.ASCII)


def number(text: str | None) -> int | None:
    """A positive id from a URL or a form (ASCII digits only), else None."""
    return int(text) if text and _ID.fullmatch(text) else None


def _day(text: str | None) -> datetime | None:
    try:
        return datetime.fromisoformat(text).replace(tzinfo=UTC) if text else None
    except ValueError:
        return None


_Handler = Callable[[Request], Awaitable[Response]]


class Pages:
    """The pages of one console: its engine, its sessions and its templates."""

    def __init__(self, engine: sa.Engine, sessions: Sessions, throttle: LoginThrottle) -> None:
        self.engine = engine
        self.sessions = sessions
        self.throttle = throttle
        self.templates = Environment(
            loader=FileSystemLoader(HERE / "templates"),
            autoescape=select_autoescape(default=True, default_for_string=True),
        )
        self.templates.filters["when"] = _when
        self.templates.filters["iso"] = lambda v: v.isoformat() if isinstance(v, datetime) else ""
        self.streams = 0  # live pages open now (one event loop: no lock needed)
        self.wake = LiveWake(engine)
        self.streams_of: dict[str, int] = {}  # live streams open per user

    # -- rendering and access ----------------------------------------------------------------

    def render(
        self, request: Request, name: str, session: Session | None, status: int = 200, **data: Any
    ) -> HTMLResponse:
        viewer = session is None or session.user.role is not Role.OPERATOR
        page = self.templates.get_template(name).render(
            request=request,
            session=session,
            operator=not viewer,
            pii=Shown(viewer=viewer),
            base=request.scope.get("root_path", ""),
            **data,
        )
        return HTMLResponse(page, status_code=status)

    def page(
        self, role: Role, handler: Callable[[Request, Session], Awaitable[Response]]
    ) -> _Handler:
        """``handler`` behind a session of at least ``role``: no session goes to the login
        page; a viewer asking for an operator's page is refused."""

        async def guarded(request: Request) -> Response:
            session = self.sessions.current(request)
            if session is None:
                base = request.scope.get("root_path", "")
                return RedirectResponse(f"{base}/login", status_code=303)
            if role is Role.OPERATOR and session.user.role is not Role.OPERATOR:
                return self.render(
                    request, "refused.html", session, 403, why="Only an operator may see this."
                )
            return await handler(request, session)

        return guarded

    def read(self, work: Callable[[sa.Connection], Any]) -> Awaitable[Any]:
        """Run ``work`` on a connection in a worker thread (the store is synchronous)."""

        def run() -> Any:
            with self.engine.connect() as conn:
                return work(conn)

        return run_in_threadpool(run)

    # -- login -------------------------------------------------------------------------------

    async def login_form(self, request: Request) -> Response:
        if self.sessions.auth.users_file is None:
            return self.render(
                request, "refused.html", None, 403, why="Sign in through your proxy."
            )
        return self._login_page(request, None)

    def _login_page(self, request: Request, error: str | None, status: int = 200) -> Response:
        nonce = secrets.token_urlsafe(24)
        response = self.render(request, "login.html", None, status, error=error, nonce=nonce)
        options = self.sessions.cookie_options(request, self.sessions.login_cookie)
        response.set_cookie(value=nonce, max_age=1800, **options)
        return response

    async def login(self, request: Request) -> Response:
        users = self.sessions.auth.users_file
        nonce = self.sessions.cookie(request, self.sessions.login_cookie)
        if users is None or cross_site(request) or not nonce:  # before the body is read
            return self.render(
                request, "refused.html", None, 403, why="Refused: not this site's form."
            )
        form = await read_form(request, LOGIN_FORM_BYTES)
        if isinstance(form, Response):
            return form
        if form.get("nonce") != nonce:
            return self.render(
                request, "refused.html", None, 403, why="Refused: not this site's form."
            )
        name, password = str(form.get("name", "")), str(form.get("password", ""))
        keys = self.throttle.keys(name, self.sessions.auth.client(request))
        wait = self.throttle.start(keys)
        if wait > 0:
            response = self._login_page(request, "Too many failed logins: wait and try again.", 429)
            response.headers["Retry-After"] = str(int(wait) + 1)
            return response

        def check() -> User | bool | None:
            # a bounded number of hashes at once; False: too busy to check now
            if not self.throttle.checks.acquire(timeout=10):
                return False
            try:
                return users.authenticate(name, password)
            finally:
                self.throttle.checks.release()

        user = await run_in_threadpool(check)
        if user is False:
            response = self._login_page(request, "Too many logins at once: try again.", 503)
            response.headers["Retry-After"] = "5"
            return response
        if not isinstance(user, User):
            return self._login_page(request, "Wrong name or password.", 401)
        self.throttle.succeeded(keys)
        cookie, _ = self.sessions.issue(user)
        base = request.scope.get("root_path", "")
        response = RedirectResponse(f"{base}/", status_code=303)
        sessions = self.sessions
        response.set_cookie(
            value=cookie, **sessions.cookie_options(request, sessions.session_cookie)
        )
        gone = sessions.cookie_options(request, sessions.login_cookie)
        response.delete_cookie(
            **{k: gone[k] for k in ("key", "path", "secure", "httponly", "samesite")}
        )
        return response

    async def logout(self, request: Request) -> Response:
        session = self.sessions.current(request)
        form = (
            None
            if session is None or cross_site(request)
            else await read_form(request, LOGIN_FORM_BYTES)
        )
        if isinstance(form, Response):
            return form
        token = None if form is None else form.get("csrf")
        if (
            session is None
            or form is None
            or session.by_header
            or not csrf_matches(session, token if isinstance(token, str) else None)
        ):
            return self.render(
                request, "refused.html", session, 403, why="Refused: not this site's form."
            )
        self.sessions.end(session)
        base = request.scope.get("root_path", "")
        response = RedirectResponse(f"{base}/login", status_code=303)
        gone = self.sessions.cookie_options(request, self.sessions.session_cookie)
        response.delete_cookie(
            **{k: gone[k] for k in ("key", "path", "secure", "httponly", "samesite")}
        )
        return response

    # -- pages -------------------------------------------------------------------------------

    async def overview(self, request: Request, session: Session) -> Response:
        def work(conn: sa.Connection) -> dict[str, Any]:
            summary = store.read_view(conn, "outbox_status_summary")
            totals: dict[str, int] = {}
            for row in summary:
                totals[row["status"]] = totals.get(row["status"], 0) + int(row["message_count"])
            return {
                "totals": [(s.value, totals.get(s.value, 0)) for s in Status],
                "summary": sorted(summary, key=lambda r: (r["category"], r["status"])),
                "lag": store.read_view(conn, "outbox_lag"),
                "delivery": ops.read_delivery_summary(conn),
                "intake": ops.read_event_intake(conn),
                "relays": _relays(conn),
                "hourly": ops.read_hourly_outcomes(conn, now=read_database_time(conn)),
            }

        data = await self.read(work)
        chart = _bars(data.pop("hourly"))
        return self.render(request, "overview.html", session, review=_REVIEW, chart=chart, **data)

    async def live(self, request: Request, session: Session) -> Response:
        """GET /live: the overview's counts by status as server-sent events, every
        ``LIVE_SECONDS`` while the page is open (the page's script closes it while its tab is
        hidden). Ends when the client goes, when its session ends (a removed user), or after
        ``LIVE_LIMIT`` seconds (the browser reconnects). At most ``LIVE_STREAMS`` at once."""
        user = session.user.name
        if self.streams >= LIVE_STREAMS or self.streams_of.get(user, 0) >= LIVE_PER_USER:
            return Response("too many live pages", status_code=503, headers={"Retry-After": "30"})

        def totals(conn: sa.Connection) -> dict[str, int]:
            counts = dict.fromkeys((s.value for s in Status), 0)
            for row in store.read_view(conn, "outbox_status_summary"):
                counts[row["status"]] = counts.get(row["status"], 0) + int(row["message_count"])
            return counts

        async def events() -> AsyncIterator[str]:
            self.streams += 1
            self.streams_of[user] = self.streams_of.get(user, 0) + 1
            wake = self.wake.open()
            try:
                yield "retry: 10000\n\n"
                started = time.monotonic()
                while time.monotonic() - started < LIVE_LIMIT:
                    if await request.is_disconnected() or self.sessions.current(request) is None:
                        return
                    yield f"event: totals\ndata: {json.dumps(await self.read(totals))}\n\n"
                    try:  # the next poll, or sooner when a commit enqueued (PostgreSQL)
                        await asyncio.wait_for(wake.wait(), LIVE_SECONDS)
                        await asyncio.sleep(LIVE_COALESCE)  # a burst of commits: one read
                    except TimeoutError:
                        pass
                    wake.clear()
            finally:
                self.wake.close(wake)
                self.streams -= 1
                self.streams_of[user] -= 1
                if not self.streams_of[user]:
                    del self.streams_of[user]

        return StreamingResponse(events(), media_type="text/event-stream")

    async def messages(self, request: Request, session: Session) -> Response:
        q = request.query_params
        try:
            flt = message_filter(q, prefixes=session.user.role is Role.OPERATOR)
        except BadFilter as bad:
            return self.render(request, "refused.html", session, 400, why=str(bad))
        before = number(q.get("before"))

        def work(conn: sa.Connection) -> list[dict[str, Any]]:
            rows = store.list_messages(
                conn, flt, limit=PAGE_SIZE + 1, before_id=before, newest_first=True
            )
            return [dict(r._mapping) for r in rows]

        rows = await self.read(work)
        more = len(rows) > PAGE_SIZE
        rows = rows[:PAGE_SIZE]
        return self.render(
            request,
            "messages.html",
            session,
            rows=rows,
            query=q,
            statuses=[s.value for s in Status],
            deliveries=[d.value for d in DeliveryStatus],
            chosen=set(flt.statuses),
            filters=[(k, v) for k, v in q.multi_items() if k != "before"],
            next_before=rows[-1]["id"] if more else None,
        )

    async def message(self, request: Request, session: Session) -> Response:
        message_id = number(request.path_params["message_id"])

        def work(conn: sa.Connection) -> dict[str, Any] | None:
            if message_id is None:
                return None
            row, history = store.get_message(conn, message_id)
            if row is None:
                return None
            return {
                "message": dict(row._mapping),
                "attempts": [dict(a._mapping) for a in history],
                "events": ops.events_of(conn, message_id),
                "actions": ops.actions_on(conn, message_id),
            }

        found = await self.read(work)
        if found is None:
            return self.render(request, "refused.html", session, 404, why="No such message.")
        message = found["message"]
        payload = message.pop("payload") or {}
        return self.render(
            request,
            "message.html",
            session,
            m=message,
            headers=_headers(payload),
            attachments=[
                (a.get("filename"), a.get("content_type")) for a in payload.get("attachments", [])
            ],
            has_html=bool(payload.get("html")) and message["body_dropped_at"] is None,
            text_body=payload.get("text") if message["body_dropped_at"] is None else None,
            timeline=_timeline(
                message, found, Shown(viewer=session.user.role is not Role.OPERATOR)
            ),
            can=_actions_for(message["status"]),
        )

    async def body(self, request: Request, session: Session) -> Response:
        """The email's HTML on its own, for the sandboxed frame of the message page: no
        script runs and nothing is fetched (remote images stay out: no tracking pixel)."""
        message_id = number(request.path_params["message_id"])

        def work(conn: sa.Connection) -> Any:
            row, _ = store.get_message(conn, message_id) if message_id is not None else (None, [])
            return None if row is None or row.body_dropped_at else row.payload

        payload = await self.read(work)
        html = (payload or {}).get("html")
        if not isinstance(html, str):
            return Response("no html body", status_code=404, media_type="text/plain")
        return HTMLResponse(
            await run_in_threadpool(clean_email_html, html),
            headers={
                "Content-Security-Policy": "sandbox; default-src 'none'; "
                "style-src 'unsafe-inline'; img-src data:; frame-ancestors 'self'",
                "X-Frame-Options": "SAMEORIGIN",
            },
        )

    async def suppressions(self, request: Request, session: Session) -> Response:
        # paged by number, never by an address in the URL: a viewer must not read one there,
        # nor spell one out by asking what comes after a guess
        page = min(number(request.query_params.get("page")) or 1, MAX_PAGE)

        def work(conn: sa.Connection) -> list[dict[str, Any]]:
            return ops.list_suppressions(
                conn, reasons=(), limit=PAGE_SIZE + 1, after=None, offset=(page - 1) * PAGE_SIZE
            )

        rows = await self.read(work)
        more = len(rows) > PAGE_SIZE and page < MAX_PAGE
        return self.render(
            request,
            "suppressions.html",
            session,
            rows=rows[:PAGE_SIZE],
            next_page=page + 1 if more else None,
        )

    async def relays(self, request: Request, session: Session) -> Response:
        rows = await self.read(_relays)
        paused = [r for r in rows if r["pauses"].count or r["pauses"].unreadable]
        return self.render(request, "relays.html", session, rows=rows, paused=paused)


def _relays(conn: sa.Connection) -> list[dict[str, Any]]:
    """The relays as ``outbox_relay_health`` shows them, each with its scoped pauses
    (``pauses``, a :class:`relay.store.RelayPauses`) read from its row."""
    pauses = store.relay_pauses(conn)
    rows = store.read_view(conn, "outbox_relay_health")
    return [{**row, "pauses": pauses.get(row["relay_id"], store.RelayPauses())} for row in rows]


CHART_HEIGHT = 120  # the overview's chart, in SVG units: 24 hours of two bars each


def _bars(hourly: list[tuple[datetime, int, int]]) -> list[dict[str, Any]]:
    """The overview chart's bars: each hour's sent and failed counts scaled to the tallest."""
    top = max((max(sent, failed) for _, sent, failed in hourly), default=0) or 1
    return [
        {
            "x": n * 30,
            "hour": start.strftime("%H"),
            "at": _when(start),
            "sent": sent,
            "failed": failed,
            "sent_height": round(sent / top * CHART_HEIGHT),
            "failed_height": round(failed / top * CHART_HEIGHT),
        }
        for n, (start, sent, failed) in enumerate(hourly)
    ]


def _actions_for(status: str) -> set[str]:
    """The actions the message page offers an operator for a message in ``status`` (the
    change re-checks it: the status may move before the form is sent)."""
    can = set()
    if status in store.REQUEUEABLE:
        can |= {"requeue", "resolve_not_delivered"}
    if status in store.CANCELLABLE:
        can.add("cancel")
    if status not in (Status.PROCESSING.value, Status.SENT.value, Status.CANCELLED.value):
        can.add("resolve_delivered")
    return can


def _headers(payload: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The email's headers as the message page lists them: (name, value, kind), the kind
    saying how a viewer sees it (addresses masked, a subject, free text withheld)."""
    shown = []
    for field, label, kind in (
        ("sender", "From", "addresses"),
        ("to", "To", "addresses"),
        ("cc", "Cc", "addresses"),
        ("bcc", "Bcc", "addresses"),
        ("reply_to", "Reply-To", "addresses"),
        ("subject", "Subject", "subject"),
        ("configuration_set", "Configuration set", "plain"),
        ("template", "Template", "text"),
    ):
        value = payload.get(field)
        if isinstance(value, list):
            value = ", ".join(str(v) for v in value)
        if value:
            shown.append((label, str(value), kind))
    custom = payload.get("headers")
    pairs = (
        custom.items() if isinstance(custom, dict) else custom if isinstance(custom, list) else ()
    )
    for pair in pairs:
        if isinstance(pair, list | tuple) and len(pair) == 2:
            shown.append((str(pair[0]), str(pair[1]), "text"))
    return shown


def _timeline(message: dict[str, Any], found: dict[str, Any], pii: Shown) -> list[dict[str, Any]]:
    """Everything that happened to a message, oldest first; free text withheld from a
    viewer (error messages, event details and their addresses, operators' reasons)."""

    def joined(*parts: Any) -> str:
        return " ".join(str(p) for p in parts if p)

    entries: list[dict[str, Any]] = [
        {"at": message["created_at"], "what": "enqueued", "detail": message["category"]}
    ]
    for a in found["attempts"]:
        detail = joined(
            pii.actor(a["relay_id"]),
            a["error_code"],
            pii.text(a["error_message"]),
            a["provider_message_id"],
        )
        entries.append(
            {
                "at": a["started_at"] or a["finished_at"],
                "what": f"attempt: {a['outcome']}",
                "detail": detail,
            }
        )
    for e in found["events"]:
        detail = joined(pii.text(e["detail"]), pii.addresses(e["recipients"]), e["effect"])
        entries.append(
            {"at": e["event_at"], "what": f"SES event: {e['event_type']}", "detail": detail}
        )
    for o in found["actions"]:
        detail = joined(pii.actor(o["actor"]), pii.text(o["reason"]))
        entries.append({"at": o["at"], "what": f"operator: {o['action']}", "detail": detail})
    if message.get("body_dropped_at"):
        entries.append(
            {"at": message["body_dropped_at"], "what": "body dropped", "detail": "prune"}
        )
    far = datetime.min.replace(tzinfo=UTC)

    def moment(entry: dict[str, Any]) -> datetime:
        at = entry["at"]
        if not isinstance(at, datetime):
            return far
        return at if at.tzinfo else at.replace(tzinfo=UTC)

    return sorted(entries, key=moment)
