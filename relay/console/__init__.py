"""The operator console: a web UI over the outbox, locked by default.

:func:`create_app` builds it as an ASGI application, served by ``outbox-relay ui`` or mounted
in a FastAPI or Starlette app (``app.mount("/outbox", create_app(engine, auth=...))``). It
refuses to be built without an authentication source (:class:`Auth`): a users file of
hashed passwords with a role each, or the header of an authenticating proxy believed only
from the addresses named. The pages are in :mod:`relay.console.views`, what guards them in
:mod:`relay.console.guard`, the users file in :mod:`relay.console.users`.
"""

from __future__ import annotations

import secrets

import sqlalchemy as sa
from starlette.applications import Starlette
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from outbox.exceptions import ConfigurationError
from relay.console.actions import Actions
from relay.console.guard import Auth, LoginThrottle, SecurityHeaders, Sessions
from relay.console.ses_import import SesImport
from relay.console.users import Role, User, UsersFile, add_user, remove_user
from relay.console.views import HERE, Pages

__all__ = ["Auth", "Role", "User", "UsersFile", "add_user", "create_app", "remove_user"]


def create_app(
    engine: sa.Engine,
    *,
    auth: Auth,
    secret_key: bytes | None = None,
    secure_cookies: bool = True,
) -> SecurityHeaders:
    """The console over ``engine``, as an ASGI application.

    ``secret_key`` signs the session cookies: give every replica behind one address the same
    key (at least 32 bytes); None makes a random one, so sessions end when the process does.
    ``secure_cookies=False`` lets the session cookie travel over plain HTTP to a host other
    than this machine: only for a test bench."""
    if auth.users_file is None and auth.trusted_header is None:
        raise ConfigurationError(
            "the console's authentication",
            "none given: a users file (OUTBOX_UI_USERS_FILE) or a trusted proxy header "
            "(--trusted-header)",
        )
    if auth.trusted_header is not None and not auth.trusted_proxies:
        raise ConfigurationError(
            "--trusted-proxy",
            "--trusted-header needs the addresses of the proxy that sets it (anyone else "
            "could send the header)",
        )
    if secret_key is not None and len(secret_key) < 32:
        raise ConfigurationError("the console's secret key", "use at least 32 bytes")
    sessions = Sessions(secret_key or secrets.token_bytes(32), auth, secure=secure_cookies)
    pages = Pages(engine, sessions, LoginThrottle())
    actions = Actions(pages)
    ses = SesImport(actions)
    viewer, operator = Role.VIEWER, Role.OPERATOR
    routes = [
        Route("/login", pages.login_form, methods=["GET"]),
        Route("/login", pages.login, methods=["POST"]),
        Route("/logout", pages.logout, methods=["POST"]),
        Route("/", pages.page(viewer, pages.overview)),
        Route("/live", pages.page(viewer, pages.live)),
        Route("/messages", pages.page(viewer, pages.messages)),
        Route("/messages/{message_id}", pages.page(viewer, pages.message)),
        Route("/messages/{message_id}/body", pages.page(operator, pages.body)),
        Route("/messages/{message_id}/act", pages.page(operator, actions.one), methods=["POST"]),
        Route("/actions/preview", pages.page(operator, actions.preview)),
        Route("/actions/apply", pages.page(operator, actions.apply), methods=["POST"]),
        Route("/actions/jobs/{token}", pages.page(operator, actions.job)),
        Route("/suppressions", pages.page(viewer, pages.suppressions)),
        Route("/suppressions/add", pages.page(operator, actions.suppress), methods=["POST"]),
        Route("/suppressions/remove", pages.page(operator, actions.suppress), methods=["POST"]),
        Route("/suppressions/import/preview", pages.page(operator, ses.preview), methods=["POST"]),
        Route("/suppressions/import", pages.page(operator, ses.apply), methods=["POST"]),
        Route("/relays", pages.page(viewer, pages.relays)),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes)
    app.state.pages = pages  # what a test or a probe may look at: live streams open
    return SecurityHeaders(app)
