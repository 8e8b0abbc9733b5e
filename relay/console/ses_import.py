"""The console's import of the SES account suppression list: a dry run shown as a preview,
then, confirmed, the import, logged under the signed-in user. Operators only, each POST
behind the session's CSRF token and the fetch-site check (:class:`Actions`' own).

It runs the command's own :func:`relay.admin.suppressions.import_from_ses`: boto3's standard
chain from the console process's environment (region, credentials,
``AWS_ENDPOINT_URL_SESV2``), the same batches and log rows, off the event loop and within
``SES_BOUNDS``. A refusal (no boto3, no region or credentials, SES unreachable, slow or
refusing, a database error) is one line on the page, never an error page."""

from __future__ import annotations

import click
import sqlalchemy as sa
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from relay.admin.output import some
from relay.admin.suppressions import Imported, SesBounds, import_from_ses
from relay.cli_options import first_line
from relay.console.actions import Actions
from relay.console.guard import Session

__all__ = ["PREVIEW_ADDRESSES", "SES_BOUNDS", "SesImport"]

# how long an import's request waits on SES: a proxy in front of the console gives up at
# about a minute (nginx's default), so a request to SES tries 3 times, each giving up after
# 5 s connecting or 10 s waiting for its answer (an unreachable or hung SES: under 35 s),
# and the listing stops starting pages after 30 s (some 30,000 addresses: a longer list is
# the command's job)
SES_BOUNDS = SesBounds(connect=5.0, read=10.0, attempts=3, total=30.0)
PREVIEW_ADDRESSES = 20  # the addresses a preview names of those it would add


class SesImport:
    """The import routes of one console, over its :class:`Actions` (their form check and
    result page)."""

    def __init__(self, actions: Actions) -> None:
        self.actions = actions
        self.pages = actions.pages

    async def _import(
        self, request: Request, session: Session, *, dry_run: bool
    ) -> Imported | Response:
        """The import (``dry_run``: its count), or the page refusing the form or the import."""
        form = await self.actions._form(request, session)
        if isinstance(form, Response):
            return form
        engine, actor = self.pages.engine, session.user.name
        try:
            return await run_in_threadpool(
                import_from_ses, engine, actor=actor, dry_run=dry_run, bounds=SES_BOUNDS
            )
        except click.ClickException as refused:
            said = refused.format_message()
        except sa.exc.DBAPIError as exc:
            # as the command says it: the batches before are committed, a rerun goes on
            said = f"database error: {first_line(exc)}"
        return self.actions._result(
            request, session, 409, outcome=said, back=None, to="suppressions"
        )

    async def preview(self, request: Request, session: Session) -> Response:
        """POST /suppressions/import/preview: what an import would add, and its confirm form.
        A POST, not a GET: it calls SES, which a prefetch or a link must not do."""
        done = await self._import(request, session, dry_run=True)
        if isinstance(done, Response):
            return done
        return self.pages.render(
            request, "suppressions.html", session, ses_preview=done,
            would_add=done.added[:PREVIEW_ADDRESSES], skipped=some(done.skipped),
        )  # fmt: skip

    async def apply(self, request: Request, session: Session) -> Response:
        """POST /suppressions/import: the import. It lists SES again and adds what is not
        suppressed by then (the preview's counts may have moved): sent twice, the second
        adds nothing."""
        done = await self._import(request, session, dry_run=False)
        if isinstance(done, Response):
            return done
        skipped = f"; skipped, not email addresses: {some(done.skipped)}" if done.skipped else ""
        return self.actions._result(
            request, session, 200, outcome=done.summary + skipped, back=None, to="suppressions"
        )
