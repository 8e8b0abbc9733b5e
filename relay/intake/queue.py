"""The intake's SQS calls: its client (:func:`build_client`), what it reads of its queue at
start (:func:`read_queue`) and while busy (:func:`count_waiting`), and the deletes of what
committed (:func:`delete_messages`). The client is passed in; nothing here holds one."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from outbox.exceptions import ConfigurationError

__all__ = ["QueueInfo", "build_client", "count_waiting", "delete_messages", "read_queue"]

_log = logging.getLogger("relay.intake")

_MISSING_QUEUE = frozenset(
    {"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist", "InvalidAddress"}
)


@dataclass(frozen=True, kw_only=True, slots=True)
class QueueInfo:
    """What the intake read of its queue at start: its dead-letter queue's ARN and
    ``maxReceiveCount`` (None without a redrive policy), and its visibility timeout."""

    dead_letter_arn: str | None
    max_receive_count: int | None
    visibility_timeout: int | None


def build_client(
    queue_url: str, *, wait_seconds: int, connect_timeout: float = 5.0, region: str | None = None
) -> Any:
    """The intake's SQS client, from boto3's standard configuration chain (region,
    credentials, ``AWS_ENDPOINT_URL_SQS``), with botocore's retries off (the loop retries,
    with its own backoff) and a read timeout longer than the long poll. Without a configured
    region the queue URL's (``sqs.<region>.amazonaws.com``) is used."""
    import boto3
    from botocore.config import Config

    session = boto3.session.Session(region_name=region)
    if not session.region_name:
        fallback = os.environ.get("AWS_REGION") or _region_of(queue_url)
        if fallback:
            session = boto3.session.Session(region_name=fallback)
    if not session.region_name:
        raise ConfigurationError(
            "AWS_REGION",
            "no AWS region configured for SQS (AWS_REGION, AWS_DEFAULT_REGION, the profile's "
            "region, or a queue URL of the form https://sqs.<region>.amazonaws.com/...)",
        )
    if session.get_credentials() is None:
        raise ConfigurationError(
            "AWS credentials", "none found in the standard chain (env, profile, role)"
        )
    config = Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=connect_timeout,
        read_timeout=wait_seconds + 10.0,
        tcp_keepalive=True,
    )
    return session.client("sqs", config=config)


def _region_of(queue_url: str) -> str | None:
    host = (urlsplit(queue_url).hostname or "").split(".")
    if len(host) >= 3 and host[0] == "sqs" and host[-2:] == ["amazonaws", "com"]:
        return host[1]
    return None


def read_queue(client: Any, queue_url: str) -> QueueInfo:
    """Read the queue's redrive policy and visibility timeout. A queue that does not exist
    (or cannot be read with these credentials) is a :class:`ConfigurationError` naming its
    URL; without a redrive policy, a warning: malformed messages then come back forever.
    Other SQS errors (endpoint unreachable) raise as botocore's."""
    from botocore.exceptions import ClientError

    try:
        answer = client.get_queue_attributes(
            QueueUrl=queue_url, AttributeNames=["RedrivePolicy", "VisibilityTimeout"]
        )
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in _MISSING_QUEUE:
            raise ConfigurationError(
                "--events-queue-url", f"no SQS queue at {queue_url} ({code})"
            ) from None
        if code in ("AccessDenied", "AccessDeniedException", "InvalidClientTokenId"):
            raise ConfigurationError(
                "--events-queue-url",
                f"cannot read the SQS queue at {queue_url} ({code}): the relay needs "
                "sqs:GetQueueAttributes, sqs:ReceiveMessage and sqs:DeleteMessage on it",
            ) from None
        raise
    info = _queue_info(answer.get("Attributes", {}))
    if info.dead_letter_arn is None:
        _log.warning(
            "the events queue has no redrive policy: a malformed message will be "
            "received again forever; give it a dead-letter queue (RedrivePolicy)",
            extra={"action": "no_dead_letter_queue", "queue": queue_url},
        )
    return info


def _queue_info(attributes: dict[str, Any]) -> QueueInfo:
    policy: dict[str, Any] = {}
    raw = attributes.get("RedrivePolicy")
    if raw:
        try:
            loaded = json.loads(raw)
        except ValueError:
            loaded = {}
        policy = loaded if isinstance(loaded, dict) else {}
    count = policy.get("maxReceiveCount")
    visibility = attributes.get("VisibilityTimeout")
    return QueueInfo(
        dead_letter_arn=policy.get("deadLetterTargetArn") or None,
        max_receive_count=_whole(count),
        visibility_timeout=_whole(visibility),
    )


def _whole(value: object) -> int | None:
    text = str(value) if isinstance(value, int | str) else ""
    return int(text) if text.isascii() and text.isdecimal() else None


def count_waiting(client: Any, queue_url: str) -> int | None:
    """The queue's approximate count of visible and delayed messages; None if it cannot be
    read (an unreadable count proves nothing, and never fails a pass)."""
    try:
        answer = client.get_queue_attributes(
            QueueUrl=queue_url,
            AttributeNames=[
                "ApproximateNumberOfMessages",
                "ApproximateNumberOfMessagesDelayed",
            ],
        )
        counts = answer.get("Attributes") or {}
        waiting = int(counts["ApproximateNumberOfMessages"])
        waiting += int(counts["ApproximateNumberOfMessagesDelayed"])
    except Exception as exc:
        _log.debug("queue counts not read: %s", exc, extra={"action": "queue_count"})
        return None
    return waiting


def delete_messages(client: Any, queue_url: str, handles: list[str]) -> bool:
    """Delete the messages whose effect committed; False (logged) if SQS deleted not all of
    them: those will be received again, as duplicates."""
    from botocore.exceptions import BotoCoreError, ClientError

    if not handles:
        return True
    entries = [{"Id": str(i), "ReceiptHandle": h} for i, h in enumerate(handles)]
    try:
        answer = client.delete_message_batch(QueueUrl=queue_url, Entries=entries)
    except (BotoCoreError, ClientError) as exc:
        _log.warning(
            "cannot delete %d applied messages (%s): they will be received again, as duplicates",
            len(entries),
            exc,
            extra={"action": "delete_failed"},
        )
        return False
    failed = answer.get("Failed") or []
    if failed:
        _log.warning(
            "SQS did not delete %d applied messages (%s): they will be received again, "
            "as duplicates",
            len(failed),
            ", ".join(sorted({str(f.get("Code")) for f in failed})),
            extra={"action": "delete_failed"},
        )
        return False
    return True
