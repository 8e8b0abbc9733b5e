"""The SES error table: every class of answer (or silence) and what it means for a message,
given how far the call got (:class:`Progress`)."""

from __future__ import annotations

import contextlib
import ssl

import botocore.exceptions as bex
import pytest
import urllib3.exceptions

from outbox import Attachment, Email
from relay.pause import Scope, ScopeKind
from relay.senders import Ambiguous, Disabled, OutgoingMessage, Permanent, Transient
from relay.senders.ses import Progress, build_request, classify, pause_scope

PREPARING, SIGNING, SENT = Progress.PREPARING, Progress.SIGNING, Progress.SENT
URL = "https://email.us-east-1.amazonaws.com/v2/email/outbound-emails"


def client_error(
    code: str,
    status: int,
    message: str = "",
    *,
    request_id: str | None = "a1b2c3d4-5678-90ab-cdef-111111111111",
    operation: str = "SendEmail",
) -> bex.ClientError:
    """A ``ClientError`` as botocore builds it from an error answer; by default SES's own
    (its error code and its request id)."""
    metadata: dict = {"HTTPStatusCode": status}
    if request_id is not None:
        metadata["RequestId"] = request_id
    return bex.ClientError(
        {"Error": {"Code": code, "Message": message}, "ResponseMetadata": metadata}, operation
    )


def foreign_answer(status: int, reason: str) -> bex.ClientError:
    """What botocore makes of an answer without SES's error shape (a proxy's HTML 502): the
    bare status as the code, the reason phrase as the message, no request id."""
    return client_error(str(status), status, reason, request_id=None)


def handshake_failure() -> ssl.SSLError:
    """A real TLS handshake failure, raised inside ``ssl``'s ``do_handshake``: the client
    hello answered in plain HTTP."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(
        incoming, outgoing, server_hostname="email.us-east-1.amazonaws.com"
    )
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()  # the client hello, into ``outgoing``
    incoming.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    try:
        tls.do_handshake()
    except ssl.SSLError as exc:
        return exc
    raise AssertionError("the handshake did not fail")


def ssl_error(error: BaseException) -> bex.SSLError:
    """botocore's ``SSLError`` around urllib3's, around the ``ssl`` module's, as raised."""
    return bex.SSLError(endpoint_url=URL, error=urllib3.exceptions.SSLError(error))


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
    assert classify(error, progress=SENT) == expected


def test_an_answer_to_send_email_is_one_whatever_progress_was_recorded():
    """An answer means the request was sent: a hook that did not fire cannot make SES's own
    refusal look like a local failure."""
    error = client_error("MessageRejected", 400, "Email address is not verified.")
    expected = Permanent(code="MessageRejected", message="Email address is not verified.")
    assert classify(error, progress=PREPARING) == expected
    assert classify(error, progress=SIGNING) == expected


class NovelError(Exception):
    """An exception class this module has never heard of."""


class NovelConnectionError(bex.EndpointConnectionError):
    """A botocore subclass of a "never connected" error that may one day mean more."""


SENT_BUT_NO_ANSWER_OF_SES = [
    pytest.param(bex.ReadTimeoutError(endpoint_url=URL), "ReadTimeoutError", id="read-timeout"),
    pytest.param(bex.ConnectionClosedError(endpoint_url=URL), "ConnectionClosedError", id="closed"),
    pytest.param(bex.HTTPClientError(error="boom"), "HTTPClientError", id="http-client-error"),
    pytest.param(bex.ResponseStreamingError(error="cut"), "ResponseStreamingError", id="cut"),
    pytest.param(
        ssl_error(ssl.SSLError(1, "[SSL: DECRYPTION_FAILED_OR_BAD_RECORD_MAC] bad record mac")),
        "SSLError",
        id="tls-error-reading-the-answer",
    ),
    pytest.param(
        bex.SSLError(endpoint_url=URL, error="handshake"), "SSLError", id="tls-error-no-detail"
    ),
    pytest.param(foreign_answer(502, "Bad Gateway"), "http_502", id="502-from-a-proxy"),
    pytest.param(foreign_answer(504, "Gateway Timeout"), "http_504", id="504-from-a-proxy"),
    pytest.param(foreign_answer(503, "Service Unavailable"), "http_503", id="503-no-ses-shape"),
    pytest.param(foreign_answer(400, "Bad Request"), "http_400", id="400-no-ses-shape"),
    pytest.param(
        client_error("InternalFailure", 500, request_id=None),
        "http_500",
        id="ses-code-without-request-id",
    ),
    pytest.param(
        client_error("503", 503, "upstream down"), "http_503", id="request-id-but-no-ses-code"
    ),
    pytest.param(
        client_error("InvalidIdentityToken", 400, operation="AssumeRoleWithWebIdentity"),
        "http_400",
        id="another-operations-answer-after-sending",
    ),
    pytest.param(RuntimeError("unexpected"), "RuntimeError", id="runtime-error"),
    pytest.param(NovelError("new"), "NovelError", id="a-new-exception-class"),
    pytest.param(
        NovelConnectionError(endpoint_url=URL), "NovelConnectionError", id="a-new-subclass"
    ),
    pytest.param(bex.NoCredentialsError(), "NoCredentialsError", id="credentials-after-sending"),
]


@pytest.mark.parametrize(("error", "code"), SENT_BUT_NO_ANSWER_OF_SES)
def test_sent_and_no_answer_of_ses_is_ambiguous(error, code):
    outcome = classify(error, progress=SENT)
    assert isinstance(outcome, Ambiguous), outcome
    assert outcome.code == code


SENT_BUT_NEVER_WRITTEN = [
    pytest.param(bex.ConnectTimeoutError(endpoint_url=URL), id="connect-timeout"),
    pytest.param(bex.EndpointConnectionError(endpoint_url=URL), id="refused-or-dns"),
    pytest.param(bex.ProxyConnectionError(proxy_url="http://proxy"), id="proxy-unreachable"),
    pytest.param(
        ssl_error(ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED]")),
        id="certificate-not-trusted",
    ),
    pytest.param(ssl_error(handshake_failure()), id="handshake-failed"),
    pytest.param(
        bex.ConnectionClosedError(
            endpoint_url=URL,
            error=urllib3.exceptions.ProtocolError("Connection aborted.", handshake_failure()),
        ),
        id="closed-in-the-handshake",
    ),
]


@pytest.mark.parametrize("error", SENT_BUT_NEVER_WRITTEN)
def test_sent_but_provably_never_written_is_transient(error):
    outcome = classify(error, progress=SENT)
    assert outcome == Transient(code=type(error).__name__, message=outcome.message)
    assert not outcome.throttled


CREDENTIAL_FAILURES = [
    pytest.param(bex.NoCredentialsError(), "NoCredentialsError", id="none"),
    pytest.param(
        bex.PartialCredentialsError(provider="env", cred_var="AWS_SECRET_ACCESS_KEY"),
        "PartialCredentialsError",
        id="partial",
    ),
    pytest.param(
        bex.CredentialRetrievalError(provider="container-role", error_msg="timed out"),
        "CredentialRetrievalError",
        id="retrieval-ecs",
    ),
    pytest.param(
        bex.MetadataRetrievalError(error_msg="IMDS unreachable"),
        "MetadataRetrievalError",
        id="retrieval-imds",
    ),
    pytest.param(
        client_error("InvalidIdentityToken", 400, operation="AssumeRoleWithWebIdentity"),
        "InvalidIdentityToken",
        id="sts-400-during-refresh",
    ),
    pytest.param(
        client_error("Throttling", 400, "Rate exceeded", operation="AssumeRole"),
        "Throttling",
        id="sts-throttled-during-refresh",
    ),
    pytest.param(
        bex.EndpointConnectionError(endpoint_url="https://sts.us-east-1.amazonaws.com/"),
        "EndpointConnectionError",
        id="sts-unreachable",
    ),
    pytest.param(
        RuntimeError(
            "Credentials were refreshed, but the refreshed credentials are still expired."
        ),
        "RuntimeError",
        id="refreshed-yet-expired",
    ),
]


@pytest.mark.parametrize(("error", "code"), CREDENTIAL_FAILURES)
def test_failing_while_signing_pauses_without_using_an_attempt(error, code):
    """No credentials to sign with: every message would fail alike, and IMDS, ECS or STS
    hiccups pass, so the relay pauses and probes rather than burn attempts."""
    outcome = classify(error, progress=SIGNING)
    assert outcome == Disabled(code=code, message=str(error), pause=True)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        pytest.param(
            bex.ParamValidationError(report="bad"),
            Permanent(code="InvalidRequest", message="Parameter validation failed:\nbad"),
            id="invalid-parameters",
        ),
        pytest.param(
            RuntimeError("serializer"),
            Transient(code="RuntimeError", message="serializer"),
            id="anything-else",
        ),
        pytest.param(
            NovelError("new"), Transient(code="NovelError", message="new"), id="new-class"
        ),
    ],
)
def test_failing_while_preparing_is_the_messages_own_problem(error, expected):
    assert classify(error, progress=PREPARING) == expected


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(p.values[0], id=p.id)
        for p in (*SENT_BUT_NO_ANSWER_OF_SES, *SENT_BUT_NEVER_WRITTEN, *CREDENTIAL_FAILURES)
    ],
)
@pytest.mark.parametrize("progress", [PREPARING, SIGNING])
def test_nothing_sent_is_never_ambiguous(error, progress):
    assert not isinstance(classify(error, progress=progress), Ambiguous)


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


# -- a refusal that names identities (issue 27, item 2) ------------------------------------

NOT_VERIFIED = "Email address is not verified. The following identities failed the check in region"
SHOP = Scope(ScopeKind.IDENTITY, "shop@example.com")


@pytest.mark.parametrize(
    ("sender", "text", "scope"),
    [
        pytest.param(
            "shop@example.com", f"{NOT_VERIFIED} US-EAST-1: shop@example.com", SHOP, id="sender"
        ),
        pytest.param(
            "Shop <Shop@Example.COM>",
            f"{NOT_VERIFIED} US-EAST-1: shop@example.com",
            SHOP,
            id="display-name-and-case-in-the-from",
        ),
        pytest.param(
            "shop@example.com",
            f'{NOT_VERIFIED} EU-WEST-1: "Shop, Ltd" <SHOP@example.com>',
            SHOP,
            id="display-name-in-the-answer-wrong-region",
        ),
        pytest.param(
            "Shop <shop@example.com>",
            f"{NOT_VERIFIED} US-EAST-1: c1@example.org, Shop <shop@example.com>, c2@example.net",
            SHOP,
            id="several-with-the-sender",
        ),
        pytest.param(
            "shop@example.com",
            f"{NOT_VERIFIED} US-EAST-1: example.com",
            Scope(ScopeKind.IDENTITY, "example.com"),
            id="its-domain",
        ),
        pytest.param(
            "shop@example.com", f"{NOT_VERIFIED} US-EAST-1: c1@example.org", None, id="a-recipient"
        ),
        pytest.param(
            "shop@example.com",
            f"{NOT_VERIFIED} US-EAST-1: c1@example.org, c2@example.net.",
            None,
            id="recipients-only",
        ),
        pytest.param(
            "shop@example.com",
            f"{NOT_VERIFIED} US-EAST-1: workshop@example.com, shop@example.com.au",
            None,
            id="look-alikes-are-recipients",
        ),
        pytest.param(
            "o'brien@example.com",
            f"{NOT_VERIFIED} US-EAST-1: o'brien@example.com",
            Scope(ScopeKind.IDENTITY, "o'brien@example.com"),
            id="an-apostrophe-in-the-address",
        ),
        pytest.param(
            "victim@platform.example",
            f'{NOT_VERIFIED} US-EAST-1: "x, platform.example, y" <mallory@platform.example>',
            None,
            id="a-domain-inside-a-display-name-is-no-identity",
        ),
        pytest.param("shop@example.com", "Email address is not verified.", None, id="none-named"),
        pytest.param("", f"{NOT_VERIFIED} US-EAST-1: shop@example.com", None, id="no-sender-known"),
    ],
)
def test_a_refusal_naming_the_sender_pauses_its_identity_one_naming_recipients_fails(
    sender, text, scope
):
    """The From identity unverified in the region sent to (or AWS_REGION wrong) refuses every
    message from it alike: its scope pauses, no attempt used. Recipients named (the SES
    sandbox) are this message's own problem: it fails, as before."""
    outcome = classify(client_error("MessageRejected", 400, text), progress=SENT, sender=sender)
    if scope is None:
        assert outcome == Permanent(code="MessageRejected", message=text)
    else:
        assert outcome == Disabled(code="MessageRejected", message=text, pause=True, scope=scope)


DENIED_SET = (
    "User `arn:aws:sts::123456789012:assumed-role/relay/i-1' is not authorized to perform "
    "`ses:SendEmail' on resource `arn:aws:ses:us-west-2:123456789012:configuration-set/{}'"
)


@pytest.mark.parametrize(
    ("configuration_set", "sender", "scope"),
    [
        pytest.param(
            None,
            "Promo <Promo@Example.com>",
            Scope(ScopeKind.CONFIGURATION_SET, "tracked", via="promo@example.com"),
            id="an-identity-default-the-message-did-not-name",
        ),
        pytest.param(
            "tracked",
            "promo@example.com",
            Scope(ScopeKind.CONFIGURATION_SET, "tracked"),
            id="the-set-the-message-named",
        ),
    ],
)
def test_an_access_denial_for_a_configuration_set_pauses_that_set_by_name(
    configuration_set, sender, scope
):
    """SES names the set it used (the identity's default when the message named none): the
    pause has that name, never an empty one, and without a set of its own it holds only the
    messages reaching that default through the same From address."""
    text = DENIED_SET.format("tracked")
    outcome = classify(client_error("AccessDenied", 403, text), progress=SENT, sender=sender)
    assert outcome == Disabled(code="AccessDenied", message=text, pause=True)
    found = pause_scope("AccessDenied", text, configuration_set, sender=sender)
    assert found == scope
    assert found.name == "tracked"
    assert str(found).startswith("configuration_set:tracked")
