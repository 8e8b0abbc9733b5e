"""``SesSender`` through real boto3 and botocore, against moto behind a fault-injecting proxy.

Every SES answer (and every way of not answering) is produced on the wire, so what is tested is
the whole chain: botocore's parsing of a restJson1 error, its retry settings, its timeouts and
connection handling, and ``classify``. Each send must be exactly one HTTP request: a hidden
retry of a request SES may already have taken is how a duplicate email is born.
"""

from __future__ import annotations

import base64
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import botocore.exceptions as bex
import pytest

from outbox.exceptions import ConfigurationError
from outbox.message import Attachment
from relay.senders import Accepted, Ambiguous, Disabled, Permanent, Transient
from relay.senders.ses import SesSender, build_client
from tests.support.ses import AWS_VARIABLES, FaultPlan, FaultServer, aws_env, outgoing

# The read timeout of the client under test: long enough for moto's answer on a loaded machine
# (a CI run saw one take over 0.5 s: the client gave up before the answer, a pass looked like
# a hang); a "hang" holds its answer well past it.
SEND_TIMEOUT = 2.0
HANG_SECONDS = 6.0


@pytest.fixture
def ses(moto):
    """A fresh moto (sender verified, nothing sent) behind a fault server that passes all."""
    with FaultServer(moto.url, FaultPlan(hang_seconds=HANG_SECONDS)) as server:
        yield server


def _clear_aws(monkeypatch, tmp_path):
    for name in AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def endpoint(monkeypatch, tmp_path):
    """Point the standard AWS chain (env only) at a URL: ``endpoint(url)``."""
    _clear_aws(monkeypatch, tmp_path)

    def point(url):
        for name, value in aws_env(url).items():
            monkeypatch.setenv(name, value)

    return point


@pytest.fixture
def sender(ses, endpoint):
    endpoint(ses.url)
    return SesSender(build_client(send_timeout=SEND_TIMEOUT, concurrency=1))


def send_one(ses, sender, msg):
    """Send ``msg``; check it made exactly one SendEmail request and no other request."""
    before, others = len(ses.sends), ses.other_requests
    outcome = sender.send(msg)
    sends = ses.sends[before:]
    assert len(sends) == 1, (
        f"{len(sends)} HTTP requests for one send: {[s.kind for s in sends]}, "
        f"outcome {outcome!r}, proxy errors {ses.errors}"
    )
    assert ses.other_requests == others
    assert sends[0].outbox_id == msg.id
    return outcome, sends[0]


def test_a_pass_is_accepted_with_the_message_id_moto_returned(ses, sender, moto):
    outcome, request = send_one(ses, sender, outgoing(1))

    assert request.kind == "pass"
    held = moto.messages()
    assert len(held) == 1
    assert held[0]["subject"] == "msg key-1"
    assert held[0]["destinations"] == {"ToAddresses": ["customer1@example.com"]}
    assert outcome == Accepted(provider_message_id=held[0]["id"])
    assert request.message_id == held[0]["id"]


ANSWERED = [
    pytest.param(
        "throttle",
        Transient(code="TooManyRequestsException", message="Too many requests.", throttled=True),
        id="429-TooManyRequests",
    ),
    pytest.param(
        "throttling_v1",
        Transient(code="Throttling", message="Maximum sending rate exceeded.", throttled=True),
        id="400-Throttling-v1",
    ),
    pytest.param(
        "server_error",
        Transient(code="InternalFailure", message="An internal failure occurred."),
        id="500-InternalFailure",
    ),
    pytest.param(
        "rejected",
        Permanent(code="MessageRejected", message="Email address is on the suppression list."),
        id="400-MessageRejected",
    ),
    pytest.param(
        "sending_paused",
        Disabled(
            code="SendingPausedException",
            message="Sending is paused for this account.",
            pause=True,
        ),
        id="400-SendingPaused",
    ),
]


@pytest.mark.parametrize(("kind", "expected"), ANSWERED)
def test_an_error_answer_is_classified_from_its_code_after_one_request(
    ses, sender, moto, kind, expected
):
    ses.plan.script(kind)
    outcome, request = send_one(ses, sender, outgoing(2))

    assert request.kind == kind
    assert outcome == expected
    assert moto.messages() == []  # SES answered with an error: it did not take the message


def test_a_hang_past_the_read_timeout_is_ambiguous_and_ses_did_take_it(ses, sender, moto):
    ses.plan.script("hang")
    started = time.monotonic()
    outcome, request = send_one(ses, sender, outgoing(3))
    took = time.monotonic() - started

    assert isinstance(outcome, Ambiguous)
    assert outcome.code == "ReadTimeoutError"
    assert SEND_TIMEOUT <= took < HANG_SECONDS  # the client's read timeout ended it
    assert request.accepted
    assert [m["id"] for m in moto.messages()] == [request.message_id]  # delivered all the same


def test_a_reset_after_ses_took_the_message_is_ambiguous(ses, sender, moto):
    ses.plan.script("reset")
    outcome, request = send_one(ses, sender, outgoing(4))

    assert isinstance(outcome, Ambiguous), outcome
    assert outcome.code == "ConnectionClosedError"
    assert request.accepted
    assert [m["id"] for m in moto.messages()] == [request.message_id]


def test_a_reset_before_forwarding_is_ambiguous_too_since_the_client_cannot_tell(ses, sender, moto):
    ses.plan.script("reset_before")
    outcome, request = send_one(ses, sender, outgoing(5))

    assert isinstance(outcome, Ambiguous), outcome
    assert outcome.code == "ConnectionClosedError"
    assert not request.accepted
    assert moto.messages() == []


@pytest.mark.parametrize("kind", ["reset", "hang", "server_error"])
def test_the_next_send_on_the_same_client_is_clean_after_a_broken_one(ses, sender, moto, kind):
    """A broken or error-answered connection must not poison botocore's pool: the next send
    is again one request, and accepted."""
    ses.plan.script(kind)
    send_one(ses, sender, outgoing(6))
    outcome, request = send_one(ses, sender, outgoing(7))

    assert request.kind == "pass"
    assert outcome == Accepted(provider_message_id=request.message_id)


def test_ses_itself_rejects_an_unverified_sender_as_permanent(ses, sender, moto):
    """moto's own refusal (not the fault server's), as SES answers mail from an identity
    that is not verified: a permanent MessageRejected."""
    outcome, request = send_one(ses, sender, outgoing(13, sender="Other <other@example.org>"))

    assert request.kind == "pass"
    assert request.status == 400
    assert isinstance(outcome, Permanent)
    assert outcome.code == "MessageRejected"
    assert moto.messages() == []


def test_a_verified_domain_covers_every_address_in_it(ses, sender, moto):
    moto.verify("example.org")
    outcome, _ = send_one(ses, sender, outgoing(14, sender="News <news@example.org>"))

    assert isinstance(outcome, Accepted)
    assert [m["source"] for m in moto.messages()] == ["News <news@example.org>"]


def test_connection_refused_is_transient_the_request_never_left(endpoint, moto):
    with socket.socket() as closed:  # bound, not listening: the kernel refuses connections
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        endpoint(f"http://127.0.0.1:{port}")
        sender = SesSender(build_client(send_timeout=SEND_TIMEOUT, concurrency=1))
        outcome = sender.send(outgoing(8))

    assert isinstance(outcome, Transient), outcome
    assert outcome.code == "EndpointConnectionError"
    assert not outcome.throttled


def test_a_rich_email_arrives_at_ses_complete(ses, sender, moto):
    pdf = bytes(range(256)) * 4
    msg = outgoing(
        9,
        category="receipts",
        to=["Ann <ann@example.com>", "bob@example.com"],
        cc=["carol@example.com"],
        bcc=["audit@example.com"],
        reply_to=["Help <help@example.com>"],
        subject="msg key-9 ünïcode",
        text="Plain body",
        html="<p>Html body</p>",
        headers={"X-Order-Ref": "A-9"},
        tags={"campaign": "spring"},
        attachments=[
            Attachment(filename="receipt.pdf", content=pdf, content_type="application/pdf")
        ],
    )
    outcome, request = send_one(ses, sender, msg)

    assert isinstance(outcome, Accepted)
    sent = request.request
    assert sent["FromEmailAddress"] == "Shop <shop@example.com>"
    assert sent["Destination"] == {
        "ToAddresses": ["Ann <ann@example.com>", "bob@example.com"],
        "CcAddresses": ["carol@example.com"],
        "BccAddresses": ["audit@example.com"],
    }
    assert request.recipients == 4
    assert sent["ReplyToAddresses"] == ["Help <help@example.com>"]
    assert "ConfigurationSetName" not in sent  # none given: SES's default applies
    assert sorted((t["Name"], t["Value"]) for t in sent["EmailTags"]) == [
        ("campaign", "spring"),
        ("outbox_category", "receipts"),
        ("outbox_message_id", "9"),
    ]
    simple = sent["Content"]["Simple"]
    assert simple["Subject"] == {"Data": "msg key-9 ünïcode", "Charset": "UTF-8"}
    assert simple["Body"] == {
        "Text": {"Data": "Plain body", "Charset": "UTF-8"},
        "Html": {"Data": "<p>Html body</p>", "Charset": "UTF-8"},
    }
    assert simple["Headers"] == [{"Name": "X-Order-Ref", "Value": "A-9"}]
    [attachment] = simple["Attachments"]
    assert base64.b64decode(attachment.pop("RawContent")) == pdf
    assert attachment == {
        "FileName": "receipt.pdf",
        "ContentType": "application/pdf",
        "ContentDisposition": "ATTACHMENT",
        "ContentTransferEncoding": "BASE64",
    }

    [held] = moto.messages()  # moto keeps only these fields of a Simple send
    assert held["id"] == outcome.provider_message_id
    assert held["subject"] == "msg key-9 ünïcode"
    assert held["body"] == "<p>Html body</p>"
    assert held["destinations"] == sent["Destination"]


def test_the_configuration_set_is_sent_when_given_and_the_emails_own_wins(ses, endpoint):
    endpoint(ses.url)
    client = build_client(send_timeout=SEND_TIMEOUT, concurrency=1)

    _, plain = send_one(ses, SesSender(client), outgoing(10))
    _, relay_set = send_one(ses, SesSender(client, configuration_set="relay-set"), outgoing(11))
    _, own_set = send_one(
        ses,
        SesSender(client, configuration_set="relay-set"),
        outgoing(12, configuration_set="email-set"),
    )

    assert "ConfigurationSetName" not in plain.request
    assert relay_set.request["ConfigurationSetName"] == "relay-set"
    assert own_set.request["ConfigurationSetName"] == "email-set"
    assert {s.kind for s in (plain, relay_set, own_set)} == {"pass"}


def test_build_client_refuses_without_a_region(endpoint, monkeypatch):
    endpoint("http://127.0.0.1:9")
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.delenv("AWS_DEFAULT_REGION")

    with pytest.raises(ConfigurationError) as info:
        build_client(send_timeout=SEND_TIMEOUT, concurrency=1)
    assert info.value.setting == "AWS_REGION"


def test_build_client_takes_the_region_from_aws_region_the_variable_its_refusal_names(
    endpoint, monkeypatch
):
    """The refusal tells the operator to set AWS_REGION (the name every AWS SDK but boto3
    reads, and what ECS and Lambda set); setting it must then be enough."""
    endpoint("http://127.0.0.1:9")
    monkeypatch.delenv("AWS_DEFAULT_REGION")

    client = build_client(send_timeout=SEND_TIMEOUT, concurrency=1)
    assert client.meta.region_name == "us-east-1"


def test_build_client_refuses_without_credentials(endpoint, monkeypatch):
    endpoint("http://127.0.0.1:9")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")

    with pytest.raises(ConfigurationError) as info:
        build_client(send_timeout=SEND_TIMEOUT, concurrency=1)
    assert info.value.setting == "AWS credentials"


def test_build_client_takes_its_timeouts_and_pool_from_the_relay_settings(endpoint):
    endpoint("http://127.0.0.1:9")
    client = build_client(send_timeout=7.5, concurrency=32)

    config = client.meta.config
    assert config.read_timeout == 7.5
    assert config.connect_timeout == 5.0
    assert config.max_pool_connections == 32
    assert config.retries["total_max_attempts"] == 1
    assert client.meta.region_name == "us-east-1"
    assert client.meta.endpoint_url == "http://127.0.0.1:9"


# -- credentials that fail while the request is being signed ------------------------------------

CREDENTIAL_PROCESS = """\
import datetime, json, pathlib, sys

calls = pathlib.Path(sys.argv[1])
calls.write_text(calls.read_text() + "call\\n" if calls.exists() else "call\\n")
if calls.read_text().count("call") > 1:
    sys.exit("the instance metadata service did not answer")
expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=1)
print(json.dumps({
    "Version": 1,
    "AccessKeyId": "testing",
    "SecretAccessKey": "testing",
    "SessionToken": "testing",
    "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
}))
"""


def test_credentials_that_cannot_be_refreshed_pause_and_nothing_reaches_ses(
    ses, endpoint, monkeypatch, tmp_path
):
    """A ``credential_process`` gave credentials expiring within a minute, then fails, as an
    IMDS, ECS or IRSA refresh can: botocore refreshes them all alike while it signs the send,
    and raises ``CredentialRetrievalError`` before a byte leaves. Not ambiguous: SES cannot
    have the message."""
    endpoint(ses.url)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    script, calls = tmp_path / "credentials.py", tmp_path / "calls"
    script.write_text(CREDENTIAL_PROCESS)
    config = tmp_path / "aws-config"
    config.write_text(f"[default]\ncredential_process = {sys.executable} {script} {calls}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    sender = SesSender(build_client(send_timeout=SEND_TIMEOUT, concurrency=1))
    assert calls.read_text().count("call") == 1  # credentials at start, good for a minute

    outcome = sender.send(outgoing(15))

    assert calls.read_text().count("call") == 2  # the refresh was tried, and failed
    assert ses.sends == []
    assert ses.other_requests == 0
    assert isinstance(outcome, Disabled), outcome
    assert outcome.pause
    assert outcome.code == "CredentialRetrievalError"


class _StsRefusal(BaseHTTPRequestHandler):
    """STS answering ``AssumeRoleWithWebIdentity`` with its own 400 error."""

    calls: list[bytes]

    def do_POST(self) -> None:
        self.calls.append(self.rfile.read(int(self.headers["Content-Length"])))
        body = (
            b'<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
            b"<Error><Type>Sender</Type><Code>InvalidIdentityToken</Code>"
            b"<Message>Couldn't retrieve verification key from your identity provider</Message>"
            b"</Error><RequestId>7d1e2f3a-sts</RequestId></ErrorResponse>"
        )
        self.send_response(400)
        self.send_header("Content-Type", "text/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:
        pass


@pytest.fixture
def sts():
    calls: list[bytes] = []
    handler = type("Handler", (_StsRefusal,), {"calls": calls})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", calls
    server.shutdown()
    server.server_close()
    thread.join(10)


def test_an_sts_error_while_refreshing_web_identity_credentials_is_not_an_ses_answer(
    ses, endpoint, monkeypatch, tmp_path, sts
):
    """IRSA: credentials come from ``AssumeRoleWithWebIdentity``, fetched when the send is
    signed. STS's 400 is a ``ClientError`` like SES's own, but from another call, before the
    SES request existed: neither a refusal of the message nor ambiguous."""
    sts_url, sts_calls = sts
    endpoint(ses.url)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    token = tmp_path / "web-identity-token"
    token.write_text("eyJhbGciOiJSUzI1NiJ9.e30.c2lnbmF0dXJl")
    monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/outbox-relay")
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token))
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", sts_url)
    sender = SesSender(build_client(send_timeout=SEND_TIMEOUT, concurrency=1))
    assert sts_calls == []  # botocore fetches these credentials only when it first signs

    outcome = sender.send(outgoing(16))

    assert len(sts_calls) >= 1
    assert b"Action=AssumeRoleWithWebIdentity" in sts_calls[0]
    assert ses.sends == []
    assert ses.other_requests == 0
    assert isinstance(outcome, Disabled), outcome
    assert outcome.pause
    assert outcome.code == "InvalidIdentityToken"
    assert "AssumeRoleWithWebIdentity" in outcome.message


def test_how_far_a_call_got_is_kept_per_thread(ses, sender, moto):
    """One client serves every send thread. While one thread's request is out, waiting for an
    answer that never comes, another thread's send fails while it is signed: each must be
    classified by how far its own call got (the first ambiguous, the second a pause)."""
    ses.plan.script("hang")

    def refuse_to_sign_18(request, **kwargs):
        tags = {t["Name"]: t["Value"] for t in json.loads(request.body)["EmailTags"]}
        if tags["outbox_message_id"] == "18":
            raise bex.CredentialRetrievalError(provider="test", error_msg="no credentials")

    sender.client.meta.events.register("before-sign.sesv2.SendEmail", refuse_to_sign_18)
    outcomes = {}
    first = threading.Thread(target=lambda: outcomes.update({17: sender.send(outgoing(17))}))
    first.start()
    deadline = time.monotonic() + 5
    while not ses.sends and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [s.outbox_id for s in ses.sends] == [17]  # the first request is out, unanswered
    outcomes[18] = sender.send(outgoing(18))
    first.join(10)

    assert isinstance(outcomes[17], Ambiguous), outcomes[17]
    assert outcomes[17].code == "ReadTimeoutError"
    assert outcomes[18] == Disabled(
        code="CredentialRetrievalError",
        message="Error when retrieving credentials from test: no credentials",
        pause=True,
    )
    assert [s.outbox_id for s in ses.sends] == [17]
