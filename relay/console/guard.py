"""What keeps the console locked: who is asking (a signed session cookie, or a trusted
proxy's header), the CSRF token and the fetch-site check every action must pass, the login
throttle, and the headers every response carries.

The session is a signed cookie (HttpOnly, SameSite=Strict, Secure unless turned off), issued
anew at each login with a fresh CSRF token, so a cookie planted before login is worthless
(session fixation). It names the user, not their rights: the role is read from the users
file on every request, so removing a user or demoting one takes effect at once.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import threading
import time
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from itsdangerous import BadSignature, URLSafeTimedSerializer
from starlette.datastructures import FormData, UploadFile
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from relay.console.users import Role, User, UsersFile, valid_name

__all__ = [
    "CONTENT_SECURITY_POLICY",
    "LOGIN_COOKIE",
    "SESSION_COOKIE",
    "SESSION_SECONDS",
    "Auth",
    "LoginThrottle",
    "SecurityHeaders",
    "Session",
    "Sessions",
    "cross_site",
    "csrf_matches",
    "read_form",
]

SESSION_COOKIE = "outbox_console"
LOGIN_COOKIE = "outbox_console_login"  # the login form's own CSRF nonce, before any session
SESSION_SECONDS = 8 * 3600  # a session ends 8 hours after its login, used or not
# no inline script or style, nothing from elsewhere, never framed, forms post only here
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-src 'self'; form-action 'self'; frame-ancestors 'none'; "
    "base-uri 'none'"
)
_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "X-DNS-Prefetch-Control": "off",  # no DNS lookups of the hosts an email's links name
}

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, kw_only=True)
class Auth:
    """Where the console learns who is asking; at least one is required.

    ``users_file``: users who log in with a password. ``trusted_header``: the header an
    authenticating proxy sets to the user's name, believed only from ``trusted_proxies``;
    those users are viewers unless named in ``operators``."""

    users_file: UsersFile | None = None
    trusted_header: str | None = None
    trusted_proxies: tuple[_Network, ...] = ()
    operators: frozenset[str] = field(default_factory=frozenset)

    def trusts(self, request: Request) -> bool:
        """Whether ``request`` came straight from one of the trusted proxies."""
        if request.client is None:
            return False
        try:
            address = ipaddress.ip_address(request.client.host)
        except ValueError:
            return False
        return any(address in network for network in self.trusted_proxies)

    def from_header(self, request: Request) -> User | None:
        """The user the trusted proxy names: exactly one header, a valid name; else None
        (a proxy that appends to a client's own header sends two, and none is believed)."""
        if self.trusted_header is None or not self.trusts(request):
            return None
        values = request.headers.getlist(self.trusted_header)
        if len(values) != 1 or not valid_name(name := values[0].strip()):
            return None
        return User(name, Role.OPERATOR if name in self.operators else Role.VIEWER)

    def client(self, request: Request) -> str:
        """The address a request came from: its peer, or, from a trusted proxy, the last
        address of its ``X-Forwarded-For`` (the one that proxy added)."""
        peer = request.client.host if request.client else "?"
        if self.trusts(request):
            forwarded = ",".join(request.headers.getlist("x-forwarded-for")).split(",")
            if last := forwarded[-1].strip():
                return last
        return peer


@dataclass(frozen=True, slots=True)
class Session:
    user: User
    csrf: str
    by_header: bool  # the proxy vouched for this request: no login, no logout


class Sessions:
    """Signed session cookies and CSRF tokens under one secret key.

    The cookies are named ``__Host-...`` when secure: a browser then takes them only from
    this very origin, over HTTPS (or loopback), for path ``/``, so no sibling subdomain or
    host app can plant one to shadow ours. A request that carries two cookies of one name is
    refused all the same (a planted cookie rides beside ours on an insecure bench)."""

    def __init__(self, secret_key: bytes, auth: Auth, *, secure: bool = True) -> None:
        self.auth = auth
        self.secure = secure
        prefix = "__Host-" if secure else ""
        self.session_cookie = prefix + SESSION_COOKIE
        self.login_cookie = prefix + LOGIN_COOKIE
        self._key = secret_key
        self._signer = URLSafeTimedSerializer(secret_key, salt="outbox-console-session")
        self._ended = _Ended()

    def issue(self, user: User) -> tuple[str, str]:
        """A new session for ``user``: (the cookie's value, its CSRF token)."""
        csrf = secrets.token_urlsafe(32)
        return self._signer.dumps({"u": user.name, "c": csrf, "p": user.stamp}), csrf

    def end(self, session: Session) -> None:
        """Log ``session`` out: its cookie is refused by this process from now on, even if
        it was copied before (another replica learns it only from a removed user or a new
        password, which end every session)."""
        self._ended.add(session.csrf, time.monotonic() + SESSION_SECONDS)

    def cookie(self, request: Request, name: str) -> str | None:
        """The one cookie called ``name``, or None when there is none or more than one."""
        found = [
            value
            for part in request.headers.get("cookie", "").split(";")
            for key, _, value in [part.strip().partition("=")]
            if key == name
        ]
        return found[0] if len(found) == 1 else None

    def current(self, request: Request) -> Session | None:
        """Who is asking, or None: the proxy's header first when the request came from a
        trusted proxy, else a valid session cookie of a user the users file still lists."""
        by_header = self.auth.from_header(request)
        if by_header is not None:
            return Session(by_header, self._header_csrf(by_header.name), by_header=True)
        cookie = self.cookie(request, self.session_cookie)
        if not cookie or self.auth.users_file is None:
            return None
        try:
            data: Any = self._signer.loads(cookie, max_age=SESSION_SECONDS)
        except BadSignature:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("u"), str):
            return None
        user = self.auth.users_file.user(data["u"])
        csrf = data.get("c")
        if user is None or not isinstance(csrf, str) or self._ended.has(csrf):
            return None
        if not hmac.compare_digest(str(data.get("p", "")), user.stamp):
            return None  # the password changed, or the user was removed and added again
        return Session(user, csrf, by_header=False)

    def _header_csrf(self, name: str) -> str:
        return hmac.new(self._key, b"csrf\0" + name.encode(), hashlib.sha256).hexdigest()

    def cookie_options(self, request: Request, key: str) -> dict[str, Any]:
        """How ``key`` is set: ``__Host-`` cookies must have path ``/``; an insecure bench's
        are scoped to the console's own prefix."""
        return {
            "key": key,
            "path": "/" if self.secure else request.scope.get("root_path") or "/",
            "httponly": True,
            "samesite": "strict",
            "secure": self.secure,
        }


class _Ended:
    """The sessions logged out here, until they would have expired anyway."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until: dict[str, float] = {}

    def add(self, token: str, until: float) -> None:
        with self._lock:
            now = time.monotonic()
            self._until = {t: u for t, u in self._until.items() if u > now}
            self._until[token] = until

    def has(self, token: str) -> bool:
        with self._lock:
            return self._until.get(token, 0.0) > time.monotonic()


def cross_site(request: Request) -> bool:
    """Whether an unsafe request came from another site: the browser's ``Sec-Fetch-Site``
    when it sends one; else its ``Origin`` against the request's own host."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site not in ("same-origin", "none")
    origin = request.headers.get("origin")
    if origin is None:
        return False  # not a browser's cross-site form: it would send one of the two
    host = request.headers.get("host", "")
    return origin.split("://", 1)[-1] != host


async def read_form(request: Request, limit: int) -> FormData | Response:
    """A URL-encoded form of at most ``limit`` bytes, read only that far: anything else (a
    multipart upload Starlette would spool to disk, a body past the limit) is refused before
    it is stored. The console's forms are all URL-encoded."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        return Response("a form, URL-encoded", status_code=415, media_type="text/plain")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return Response("too large", status_code=413, media_type="text/plain")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return Response("too large", status_code=413, media_type="text/plain")
    fields: list[tuple[str, str | UploadFile]] = list(
        parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True)
    )
    return FormData(fields)


def csrf_matches(session: Session, token: str | None) -> bool:
    return token is not None and hmac.compare_digest(session.csrf, token)


class LoginThrottle:
    """Failed logins, counted per (name, address), per name and per address within
    ``window`` seconds; past a key's limit the key waits out the window (429).

    An attempt counts as a failure from the moment it starts, under the lock, so concurrent
    guesses cannot all pass the check before the first is counted; a success takes back its
    own count only, never earlier failures. The limits differ so that guessing is bounded
    while a stranger cannot easily lock a user out: a name and an address together, 5; one
    name from anywhere, 50; one address for any names, 100. At most ``checks`` password
    hashes are verified at once (each takes memory and a core). In memory: per process."""

    def __init__(
        self,
        *,
        pair: int = 5,
        name: int = 50,
        address: int = 100,
        window: float = 900.0,
        checks: int = 4,
        keys: int = 10_000,
    ) -> None:
        self.limits = {"pair": pair, "name": name, "address": address}
        self.window = window
        self.checks = threading.BoundedSemaphore(checks)
        self._keys = keys
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, list[float]] = OrderedDict()

    @staticmethod
    def keys(name: str, address: str) -> dict[str, str]:
        """The keys of a login as ``name`` from ``address``: a name that is none a user can
        have counts as one (``""``), and names are kept as digests (a huge one costs
        nothing to keep)."""
        folded = unicodedata.normalize("NFKC", name[:256]).strip().casefold()
        folded = hashlib.sha256((folded if valid_name(folded) else "").encode()).hexdigest()
        return {
            "pair": f"pair:{folded}\0{address}",
            "name": f"name:{folded}",
            "address": f"address:{address}",
        }

    def start(self, keys: dict[str, str], now: float | None = None) -> float:
        """Count an attempt under ``keys``: 0 when it may go on (counted as a failure until
        :meth:`succeeded`), else the seconds until it may be tried again (not counted)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            waits = [
                times[0] + self.window - now
                for kind, key in keys.items()
                if len(times := self._recent(key, now)) >= self.limits[kind]
            ]
            if waits:
                return max(waits)
            for key in keys.values():
                self._seen[key] = [*self._recent(key, now), now]
                self._seen.move_to_end(key)
            while len(self._seen) > self._keys:  # forget the quietest, never grow unbounded
                self._seen.popitem(last=False)
            return 0.0

    def succeeded(self, keys: dict[str, str]) -> None:
        """Take back the count of the attempt that just succeeded, and only that."""
        with self._lock:
            for key in keys.values():
                times = self._seen.get(key)
                if times:
                    times.pop()

    def _recent(self, key: str, now: float) -> list[float]:
        return [t for t in self._seen.get(key, ()) if t > now - self.window]


class SecurityHeaders:
    """Adds the console's security headers to every response that does not set its own."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app  # the console's Starlette app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                wanted = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, **_HEADERS}
                headers += [
                    (name.lower().encode(), value.encode())
                    for name, value in wanted.items()
                    if name.lower().encode() not in present
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)
