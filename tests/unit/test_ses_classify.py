"""The SES error table: every class of answer (or silence) and what it means for a message."""

from __future__ import annotations

import botocore.exceptions as bex
import pytest

from outbox import Attachment, Email
from relay.senders import Ambiguous, Disabled, OutgoingMessage, Permanent, Transient
from relay.senders.ses import build_request, classify


def client_error(code: str, status: int, message: str = "") -> bex.ClientError:
    return bex.ClientError(
        {
            "Error": {"Code": code, "Message": message},
            "ResponseMetadata": {"HTTPStatusCode": status},
        },
        "SendEmail",
    )


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            client_error("TooManyRequestsException", 429),
            Transient(code="TooManyRequestsException", throttled=True),
        ),
        (
            client_error("Throttling", 400, "Maximum sending rate exceeded."),
            Transient(code="Throttling", message="Maximum sending rate exceeded.", throttled=True),
        ),
        (client_error("SomethingNew", 429), Transient(code="SomethingNew", throttled=True)),
        (client_error("InternalFailure", 500), Transient(code="InternalFailure")),
        (client_error("ServiceUnavailable", 503), Transient(code="ServiceUnavailable")),
        (
            client_error("Throttling", 400, "Daily message quota exceeded."),
            Disabled(
                code="DailyQuotaExceeded", message="Daily message quota exceeded.", pause=True
            ),
        ),
        (
            client_error("LimitExceededException", 400, "Daily message quota exceeded"),
            Disabled(code="DailyQuotaExceeded", message="Daily message quota exceeded", pause=True),
        ),
        (
            client_error("SendingPausedException", 400),
            Disabled(code="SendingPausedException", pause=True),
        ),
        (
            client_error("AccountSendingPausedException", 400),
            Disabled(code="AccountSendingPausedException", pause=True),
        ),
        (
            client_error("ConfigurationSetSendingPausedException", 400),
            Disabled(code="ConfigurationSetSendingPausedException", pause=True),
        ),
        (
            client_error("AccountSuspendedException", 400),
            Disabled(code="AccountSuspendedException", pause=True),
        ),
        (
            client_error("UnrecognizedClientException", 403),
            Disabled(code="UnrecognizedClientException", pause=True),
        ),
        (
            client_error("MessageRejected", 400, "Email address is not verified."),
            Permanent(code="MessageRejected", message="Email address is not verified."),
        ),
        (client_error("BadRequestException", 400), Permanent(code="BadRequestException")),
        (client_error("InvalidParameterValue", 400), Permanent(code="InvalidParameterValue")),
        (
            client_error("MailFromDomainNotVerifiedException", 400),
            Permanent(code="MailFromDomainNotVerifiedException", config_error=True),
        ),
        (
            client_error("NotFoundException", 404),
            Permanent(code="NotFoundException", config_error=True),
        ),
        (
            client_error("ConfigurationSetDoesNotExist", 400),
            Permanent(code="ConfigurationSetDoesNotExist", config_error=True),
        ),
        (client_error("SomethingNew", 400), Permanent(code="SomethingNew")),
    ],
    ids=lambda v: (
        v.response["Error"]["Code"] + str(v.response["ResponseMetadata"]["HTTPStatusCode"])
        if isinstance(v, bex.ClientError)
        else ""
    ),
)
def test_answers_from_ses(error, expected):
    assert classify(error) == expected


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (bex.ConnectTimeoutError(endpoint_url="https://email.x"), Transient),
        (bex.EndpointConnectionError(endpoint_url="https://email.x"), Transient),
        (bex.ProxyConnectionError(proxy_url="http://proxy"), Transient),
        (bex.SSLError(endpoint_url="https://email.x", error="handshake"), Transient),
        (bex.ReadTimeoutError(endpoint_url="https://email.x"), Ambiguous),
        (bex.ConnectionClosedError(endpoint_url="https://email.x"), Ambiguous),
        (bex.HTTPClientError(error="boom"), Ambiguous),
        (bex.ResponseStreamingError(error="cut"), Ambiguous),
        (RuntimeError("unexpected"), Ambiguous),
        (bex.NoCredentialsError(), Disabled),
        (bex.ParamValidationError(report="bad"), Permanent),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else "",
)
def test_no_answer_is_transient_only_when_the_request_never_left(error, kind):
    outcome = classify(error)
    assert type(outcome) is kind
    assert outcome.code == type(error).__name__ or kind is Permanent


def message(**kw) -> OutgoingMessage:
    fields = {
        "sender": "Shop <shop@example.com>",
        "to": ["a@example.com"],
        "subject": "Hi",
        "text": "plain",
    }
    fields.update(kw)
    return OutgoingMessage(
        id=42, key="k", category="transactional", attempt=1, email=Email(**fields)
    )


def test_request_for_a_rich_email():
    msg = message(
        cc=["c@example.com"],
        bcc=["b@example.com"],
        reply_to=["help@example.com"],
        html="<p>x</p>",
        headers={"X-Ref": "7"},
        tags={"campaign": "spring"},
        configuration_set="events",
        attachments=[Attachment(filename="r.pdf", content=b"%PDF", content_type="application/pdf")],
    )
    req = build_request(msg, configuration_set="default-set")
    assert req["FromEmailAddress"] == "Shop <shop@example.com>"
    assert req["Destination"] == {
        "ToAddresses": ["a@example.com"],
        "CcAddresses": ["c@example.com"],
        "BccAddresses": ["b@example.com"],
    }
    assert req["ReplyToAddresses"] == ["help@example.com"]
    assert req["ConfigurationSetName"] == "events"
    assert req["EmailTags"] == [
        {"Name": "campaign", "Value": "spring"},
        {"Name": "outbox_message_id", "Value": "42"},
        {"Name": "outbox_category", "Value": "transactional"},
    ]
    simple = req["Content"]["Simple"]
    assert simple["Subject"] == {"Data": "Hi", "Charset": "UTF-8"}
    assert simple["Body"] == {
        "Text": {"Data": "plain", "Charset": "UTF-8"},
        "Html": {"Data": "<p>x</p>", "Charset": "UTF-8"},
    }
    assert simple["Headers"] == [{"Name": "X-Ref", "Value": "7"}]
    assert simple["Attachments"] == [
        {
            "FileName": "r.pdf",
            "RawContent": b"%PDF",
            "ContentType": "application/pdf",
            "ContentDisposition": "ATTACHMENT",
            "ContentTransferEncoding": "BASE64",
        }
    ]


def test_request_for_a_plain_email_has_no_empty_fields():
    req = build_request(message())
    assert set(req) == {"FromEmailAddress", "Destination", "EmailTags", "Content"}
    assert req["Destination"] == {"ToAddresses": ["a@example.com"]}
    assert set(req["Content"]["Simple"]) == {"Subject", "Body"}
    assert build_request(message(), configuration_set="dflt")["ConfigurationSetName"] == "dflt"


def test_request_for_a_template():
    msg = message(subject=None, text=None, template="welcome", template_data={"name": "Ada"})
    req = build_request(msg)
    assert req["Content"] == {
        "Template": {"TemplateName": "welcome", "TemplateData": '{"name": "Ada"}'}
    }
