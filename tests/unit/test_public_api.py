"""The public API is a decision: these lists change only on purpose."""

from __future__ import annotations

import importlib

import pytest

EXPORTS = {
    "outbox": [
        "NOTIFY_CHANNEL",
        "AmbiguityPolicy",
        "Attachment",
        "AttemptOutcome",
        "Category",
        "ConfigurationError",
        "Email",
        "EnqueueError",
        "EnqueueResult",
        "HeaderInjection",
        "InvalidAddress",
        "InvalidArgument",
        "InvalidEmail",
        "InvalidKey",
        "MessageTooLarge",
        "Outbox",
        "OutboxError",
        "RecipientCountError",
        "RelayState",
        "Status",
        "UnknownCategory",
    ],
    "outbox.sqlite": ["enable_savepoints"],
    "outbox.signals": ["duplicate_skipped", "enqueued"],
    "relay.senders": [
        "Accepted",
        "Ambiguous",
        "BaseSender",
        "Disabled",
        "Outcome",
        "OutgoingMessage",
        "Permanent",
        "Sender",
        "Transient",
        "as_sender",
    ],
    "relay.policy": [
        "THROTTLE_FLOOR_SECONDS",
        "Action",
        "Decision",
        "LeaseExpired",
        "MessageState",
        "backoff_seconds",
        "decide",
    ],
    "relay.testing": [
        "DatabaseInUse",
        "FakeSender",
        "RelayNotIdle",
        "read_deliveries",
        "run_until_idle",
        "sender_from_env",
    ],
    "relay.worker": ["Relay"],
    "relay.db": ["CONNECT_TIMEOUT", "READ_COMMITTED", "make_engine"],
    "relay.http": ["Server", "start_http_server"],
    "relay.metrics": ["CLAIM_BUCKETS", "SEND_BUCKETS", "RelayMetrics"],
}


@pytest.mark.parametrize("module", sorted(EXPORTS))
def test_exports(module):
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(EXPORTS[module])
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.{name} is exported but missing"


def test_statuses_are_the_documented_list():
    from outbox import Status

    assert [s.value for s in Status] == [
        "pending",
        "retrying",
        "processing",
        "sent",
        "failed",
        "unknown_outcome",
        "cancelled",
        "expired",
    ]
