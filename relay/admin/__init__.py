"""Operator commands of ``outbox-relay``: status, list, show, requeue, cancel, resolve,
prune and suppressions.

Each command checks everything it was given before it changes anything: a bad id, status or
filter stops it with a message and no change. Bulk changes (filters instead of ids) need
``--yes``. Requeue, cancel and resolve record the operator's reason as an attempt row. Every
change an operator makes (requeue, cancel, resolve, suppressions, prune) is also written to
the operators' log, ``outbox_operator_actions``, in the transaction of the change itself: a
change that rolls back leaves no log row, and a log row that cannot be written rolls its
change back.

The commands by what they act on: :mod:`relay.admin.inspect` (status, list, show),
:mod:`relay.admin.change` (requeue, cancel, resolve), :mod:`relay.admin.pruning` and
:mod:`relay.admin.suppressions`; what they share in :mod:`relay.admin.options`,
:mod:`relay.admin.output` and :mod:`relay.admin.batches`; their statements in
:mod:`relay.store.operator`.
"""

from __future__ import annotations

from relay.admin.batches import CHANGE_BATCH
from relay.admin.change import cancel, requeue, resolve
from relay.admin.inspect import list_, show, status
from relay.admin.options import parse_duration
from relay.admin.pruning import prune
from relay.admin.suppressions import (
    suppressions_,
    suppressions_add,
    suppressions_import,
    suppressions_list,
    suppressions_remove,
)

__all__ = [
    "CHANGE_BATCH",
    "COMMANDS",
    "cancel",
    "list_",
    "parse_duration",
    "prune",
    "requeue",
    "resolve",
    "show",
    "status",
    "suppressions_",
    "suppressions_add",
    "suppressions_import",
    "suppressions_list",
    "suppressions_remove",
]

COMMANDS = (status, list_, show, requeue, cancel, resolve, prune, suppressions_)
