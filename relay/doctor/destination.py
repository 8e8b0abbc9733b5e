"""How SES events reach the intake: the configuration set (:func:`events_checks`), its event
destination and the SNS topic's subscription of the queue, and the events queue itself
(:func:`check_queue`)."""

from __future__ import annotations

from typing import Any

from relay.doctor.aws import NOT_FOUND, Clients, aws_error, unchecked
from relay.doctor.report import Check, Level

__all__ = ["check_queue", "events_checks"]


def check_queue(clients: Clients, queue_url: str) -> tuple[Check, str | None]:
    """The events queue answers ``GetQueueAttributes``; its ARN, for the subscription."""
    name = "events queue"
    try:
        attributes = clients.sqs(queue_url).get_queue_attributes(
            QueueUrl=queue_url, AttributeNames=["QueueArn", "RedrivePolicy"]
        )["Attributes"]
    except Exception as exc:
        code, text = aws_error(exc)
        return Check(
            check=name,
            status=Level.FAIL,
            found=f"{queue_url}: {code}: {text}",
            fix="check --events-queue-url, the queue's region and sqs:GetQueueAttributes",
        ), None
    arn = attributes.get("QueueArn")
    if not attributes.get("RedrivePolicy"):
        return Check(
            check=name,
            status=Level.WARN,
            found=f"{queue_url} reachable, no dead-letter queue",
            fix="give it a redrive policy: what is not an SES event stays on it until then",
        ), arn
    return Check(check=name, status=Level.OK, found=f"{queue_url} reachable"), arn


def _destinations(
    clients: Clients, ses: Any, region: str, name: str
) -> tuple[list[dict[str, Any]], str]:
    """The configuration set's event destinations in SES v2's form, and a note. An endpoint
    that does not answer the v2 call (moto) is asked SES v1's DescribeConfigurationSet, which
    reads the same configuration set; v1 knows only SNS and CloudWatch destinations."""
    try:
        found: list[dict[str, Any]] = ses.get_configuration_set_event_destinations(
            ConfigurationSetName=name
        )["EventDestinations"]
        return found, ""
    except Exception as exc:
        if not aws_error(exc)[0].isdigit():
            raise
    answer = clients.aws("ses", region).describe_configuration_set(
        ConfigurationSetName=name, ConfigurationSetAttributeNames=["eventDestinations"]
    )
    converted = [
        {
            "Name": d.get("Name"),
            "Enabled": d.get("Enabled", False),
            "MatchingEventTypes": [t.upper() for t in d.get("MatchingEventTypes", [])],
            **(
                {"SnsDestination": {"TopicArn": d["SNSDestination"]["TopicARN"]}}
                if d.get("SNSDestination")
                else {}
            ),
        }
        for d in answer.get("EventDestinations", [])
    ]
    return converted, " (read through SES v1: the endpoint does not answer the v2 call)"


_WANTED_EVENTS = ("DELIVERY", "BOUNCE", "COMPLAINT")


def events_checks(
    clients: Clients,
    ses: Any,
    region: str,
    configuration_set: str | None,
    queue: tuple[Check, str | None] | None,
    topic_arn: str | None,
) -> list[Check]:
    if configuration_set is None:
        if queue is None:
            return []
        return [
            Check(
                check="ses configuration set",
                status=Level.WARN,
                found="no --ses-configuration-set: events reach the queue only for mail whose "
                "identity has a default configuration set, or that names one",
                fix="pass --ses-configuration-set NAME (the set whose destination feeds the queue)",
            )
        ]
    name = f"ses configuration set {configuration_set}"
    try:
        found = ses.get_configuration_set(ConfigurationSetName=configuration_set)
    except Exception as exc:
        if aws_error(exc)[0] not in NOT_FOUND:
            return [unchecked(name, "GetConfigurationSet", exc, region=region)]
        return [
            Check(
                check=name,
                status=Level.FAIL,
                found=f"does not exist in {region}: SES refuses every message sent with it",
                fix=f"create it (aws sesv2 create-configuration-set --configuration-set-name "
                f"{configuration_set} --region {region}) or fix --ses-configuration-set",
            )
        ]
    checks = []
    if (found.get("SendingOptions") or {}).get("SendingEnabled") is False:
        checks.append(
            Check(
                check=name,
                status=Level.FAIL,
                found=f"exists in {region}, sending disabled: its messages are refused",
                fix="aws sesv2 put-configuration-set-sending-options --configuration-set-name "
                f"{configuration_set} --sending-enabled",
            )
        )
    else:
        checks.append(Check(check=name, status=Level.OK, found=f"exists in {region}"))
    checks.append(_destination_check(clients, ses, region, configuration_set, queue, topic_arn))
    return checks


def _destination_check(
    clients: Clients,
    ses: Any,
    region: str,
    configuration_set: str,
    queue: tuple[Check, str | None] | None,
    topic_arn: str | None,
) -> Check:
    """An enabled destination of the set that reaches the queue: an SNS topic with an SQS
    subscription of the queue's ARN; an EventBridge bus is a warning (its rules are not
    followed)."""
    name = "ses event destination"
    try:
        destinations, note = _destinations(clients, ses, region, configuration_set)
    except Exception as exc:
        return unchecked(name, "GetConfigurationSetEventDestinations", exc, region=region)
    enabled = [d for d in destinations if d.get("Enabled")]
    add = (
        f"add an SNS event destination to {configuration_set} (events DELIVERY, BOUNCE, "
        "COMPLAINT, ...) whose topic the events queue subscribes to"
    )
    if not enabled:
        return Check(
            check=name,
            status=Level.FAIL if queue is not None else Level.WARN,
            found=f"{configuration_set} has no enabled event destination{note}: the relay never "
            "hears of deliveries, bounces or complaints",
            fix=add,
        )
    if queue is None:
        return Check(
            check=name,
            status=Level.WARN,
            found=f"{configuration_set} publishes events{note}, but no --events-queue-url: the "
            "relay takes none of them",
            fix="pass --events-queue-url (run) or run `outbox-relay events`",
        )
    queue_arn = queue[1]
    if queue_arn is None:
        return Check(
            check=name,
            status=Level.WARN,
            found=f"could not check: the events queue's ARN is unknown{note}",
            fix="fix the events queue line first",
        )
    seen: list[str] = []
    for destination in enabled:
        types = set(destination.get("MatchingEventTypes") or [])
        lacking = [t for t in _WANTED_EVENTS if t not in types]
        topic = (destination.get("SnsDestination") or {}).get("TopicArn")
        bus = (destination.get("EventBridgeDestination") or {}).get("EventBusArn")
        if topic:
            unreached = _subscribed(clients, topic, queue_arn)
            if unreached is not None:
                seen.append(f"{destination.get('Name')} -> {topic}: {unreached}")
                continue
            if topic_arn is not None and topic != topic_arn:
                return Check(
                    check=name,
                    status=Level.FAIL,
                    found=f"{destination.get('Name')} publishes to {topic}, but "
                    f"--events-topic-arn is {topic_arn}: every event would be foreign",
                    fix=f"set --events-topic-arn {topic} (or unset it)",
                )
            return Check(
                check=name,
                status=Level.WARN if lacking else Level.OK,
                found=f"{destination.get('Name')} -> {topic} -> {queue_arn}{note}"
                + (f", without event types {', '.join(lacking)}" if lacking else ""),
                fix=f"add {', '.join(lacking)} to its event types" if lacking else None,
            )
        if bus:
            return Check(
                check=name,
                status=Level.WARN,
                found=f"{destination.get('Name')} -> EventBridge {bus}: could not check that a "
                "rule on it targets the queue (rules are not followed)",
                fix=f"make sure a rule on {bus} matching source aws.ses targets {queue_arn}",
            )
        seen.append(f"{destination.get('Name')} (neither SNS nor EventBridge)")
    return Check(
        check=name,
        status=Level.FAIL,
        found=f"no destination of {configuration_set} reaches {queue_arn}{note}: "
        + "; ".join(seen),
        fix="subscribe the queue to the destination's topic (aws sns subscribe --protocol sqs "
        f"--notification-endpoint {queue_arn} --topic-arn TOPIC) and allow the topic in the "
        "queue's policy, or " + add,
    )


def _subscribed(clients: Clients, topic: str, queue_arn: str) -> str | None:
    """None if ``topic`` has a confirmed SQS subscription of ``queue_arn``, else why not."""
    region = topic.split(":")[3] if topic.count(":") >= 5 else ""
    try:
        sns = clients.aws("sns", region)
        pages = sns.get_paginator("list_subscriptions_by_topic").paginate(TopicArn=topic)
        subscriptions = [s for page in pages for s in page.get("Subscriptions", [])]
    except Exception as exc:
        code, text = aws_error(exc)
        return f"could not list its subscriptions: {code}: {text}"
    mine = [
        s for s in subscriptions if s.get("Protocol") == "sqs" and s.get("Endpoint") == queue_arn
    ]
    if not mine:
        return "the queue is not subscribed to it"
    if all(s.get("SubscriptionArn") == "PendingConfirmation" for s in mine):
        return "the queue's subscription is pending confirmation"
    return None
