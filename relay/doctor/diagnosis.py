"""Every check of ``doctor``, in order (:func:`diagnose`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import sqlalchemy as sa

from outbox.exceptions import ConfigurationError
from relay.doctor.aws import Clients
from relay.doctor.database import check_database, check_grants, identities_in_use
from relay.doctor.destination import check_queue
from relay.doctor.report import Check, Level
from relay.doctor.ses import check_ses
from relay.doctor.smtp import check_smtp

__all__ = ["diagnose"]


def diagnose(
    engine: sa.Engine,
    *,
    sender: str,
    clients: Callable[[], Clients],
    smtp: tuple[Callable[[], str], str] | None,
    identities: Sequence[str],
    configuration_set: str | None,
    queue_url: str | None,
    topic_arn: str | None,
) -> list[Check]:
    """Every check, in order: the database, its grants, then the sender's (``identities``:
    the From addresses given, to which those of the newest messages are added)."""
    database, usable = check_database(engine)
    checks = [database]
    wanted = dict.fromkeys(a.lower() for a in identities)
    if usable:
        checks.append(check_grants(engine, intake=queue_url is not None))
        wanted.update(dict.fromkeys(identities_in_use(engine)[0]))
    if sender == "smtp" and smtp is not None:
        checks.append(check_smtp(*smtp))
    elif sender != "ses":
        checks.append(
            Check(
                check="sender",
                status=Level.WARN,
                found=f"could not check: doctor checks ses and smtp, not {sender}",
            )
        )
    if sender != "ses" and queue_url is None:
        return checks
    try:
        built = clients()
    except ConfigurationError as exc:
        return [*checks, Check(check="aws", status=Level.FAIL, found=str(exc), fix=exc.reason)]
    if sender == "ses":
        return checks + check_ses(
            built,
            identities=list(wanted),
            configuration_set=configuration_set,
            queue_url=queue_url,
            topic_arn=topic_arn,
        )
    assert queue_url is not None
    return [*checks, check_queue(built, queue_url)[0]]
