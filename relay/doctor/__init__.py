"""Preflight: the checks of ``outbox-relay doctor`` and the test message of ``outbox-relay
send-test``.

Each check reads and never writes: the database (reachable, migrated to head, the role's
grants), then the sender (SES: region, account, each sending identity, the configuration set
and the way its events reach the intake's queue; SMTP: one session opened and closed). What a
check cannot see (an emulator that does not answer a call, a role's grants the server does not
show) is a ``warn`` that says "could not check", never an ``ok``. The AWS clients are built
by the command line and passed in (:class:`Clients`).

The checks by what they look at: :mod:`relay.doctor.database` (schema, grants),
:mod:`relay.doctor.ses` (region, account, identities), :mod:`relay.doctor.destination`
(configuration set, event destination, queue) and :mod:`relay.doctor.smtp`, on what
:mod:`relay.doctor.report` and :mod:`relay.doctor.aws` define; all of them in order in
:mod:`relay.doctor.diagnosis`; send-test's message in :mod:`relay.doctor.sendtest`.
"""

from __future__ import annotations

from relay.doctor.aws import Clients
from relay.doctor.database import RELAY_GRANTS, check_database, check_grants, identities_in_use
from relay.doctor.destination import check_queue
from relay.doctor.diagnosis import diagnose
from relay.doctor.report import Check, Level, render
from relay.doctor.sendtest import TEST_CATEGORY, Outcome, enqueue_test, watch
from relay.doctor.ses import check_ses
from relay.doctor.smtp import check_smtp

__all__ = [
    "RELAY_GRANTS",
    "TEST_CATEGORY",
    "Check",
    "Clients",
    "Level",
    "Outcome",
    "check_database",
    "check_grants",
    "check_queue",
    "check_ses",
    "check_smtp",
    "diagnose",
    "enqueue_test",
    "identities_in_use",
    "render",
    "watch",
]
