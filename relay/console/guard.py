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
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from itsdangerous import BadSignature, URLSafeTimedSerializer
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from relay.console.users import Role, User, UsersFile

__all__ = [
    "CONTENT_SECURITY_POLICY",
    "SESSION_COOKIE",
    "SESSION_SECONDS",
    "Auth",
    "LoginThrottle",
    "SecurityHeaders",
    "Session",
    "Sessions",
    "cross_site",
    "csrf_matches",
]

SESSION_COOKIE = "outbox_console"
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
        if self.trusted_header is None or not self.trusts(request):
            return None
        name = request.headers.get(self.trusted_header, "").strip()
        if not name:
            return None
        return User(name, Role.OPERATOR if name in self.operators else Role.VIEWER)


@dataclass(frozen=True, slots=True)
class Session:
    user: User
    csrf: str
    by_header: bool  # the proxy vouched for this request: no login, no logout


class Sessions:
    """Signed session cookies and CSRF tokens under one secret key."""

    def __init__(self, secret_key: bytes, auth: Auth, *, secure: bool = True) -> None:
        self.auth = auth
        self.secure = secure
        self._key = secret_key
        self._signer = URLSafeTimedSerializer(secret_key, salt="outbox-console-session")

    def issue(self, user: User) -> tuple[str, str]:
        """A new session for ``user``: (the cookie's value, its CSRF token)."""
        csrf = secrets.token_urlsafe(32)
        return self._signer.dumps({"u": user.name, "c": csrf}), csrf

    def current(self, request: Request) -> Session | None:
        """Who is asking, or None: the proxy's header first when the request came from a
        trusted proxy, else a valid session cookie of a user the users file still lists."""
        by_header = self.auth.from_header(request)
        if by_header is not None:
            return Session(by_header, self._header_csrf(by_header.name), by_header=True)
        cookie = request.cookies.get(SESSION_COOKIE)
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
        if user is None or not isinstance(csrf, str):
            return None
        return Session(user, csrf, by_header=False)

    def _header_csrf(self, name: str) -> str:
        return hmac.new(self._key, b"csrf\0" + name.encode(), hashlib.sha256).hexdigest()

    def cookie_options(self, request: Request) -> dict[str, Any]:
        return {
            "key": SESSION_COOKIE,
            "path": request.scope.get("root_path") or "/",
            "httponly": True,
            "samesite": "strict",
            "secure": self.secure,
        }


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


def csrf_matches(session: Session, token: str | None) -> bool:
    return token is not None and hmac.compare_digest(session.csrf, token)


class LoginThrottle:
    """At most ``failures`` failed logins per user name and per client address within
    ``window`` seconds; then that name or address waits out the window. In memory: each
    console process keeps its own count."""

    def __init__(self, failures: int = 5, window: float = 900.0, keys: int = 10_000) -> None:
        self.failures = failures
        self.window = window
        self._keys = keys
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, list[float]] = OrderedDict()

    def wait(self, keys: Sequence[str], now: float | None = None) -> float:
        """Seconds until a login under ``keys`` may be tried again; 0: now."""
        now = time.monotonic() if now is None else now
        with self._lock:
            waits = [
                times[0] + self.window - now
                for key in keys
                if len(times := self._recent(key, now)) >= self.failures
            ]
        return max(waits, default=0.0)

    def failed(self, keys: Sequence[str], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            for key in keys:
                self._seen[key] = [*self._recent(key, now), now]
                self._seen.move_to_end(key)
            while len(self._seen) > self._keys:  # forget the quietest, never grow unbounded
                self._seen.popitem(last=False)

    def succeeded(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._seen.pop(key, None)

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
