"""Unit tests for outbox.message: validation, canonical addresses, payloads, MIME and size."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from email import policy
from email.parser import BytesParser
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox.exceptions import (
    HeaderInjection,
    InvalidAddress,
    InvalidEmail,
    MessageTooLarge,
    RecipientCountError,
)
from outbox.message import (
    MAX_HEADERS,
    MAX_MESSAGE_BYTES,
    MAX_RECIPIENTS,
    RESERVED_TAGS,
    Attachment,
    Email,
    validate_address,
)
from tests.support.factories import INVALID, PDF, SENDER, attach, make, template


def parse(message: Email) -> Any:
    return BytesParser(policy=policy.default).parsebytes(message.to_mime().as_bytes())


def full_email() -> Email:
    return make(
        sender='"Shop, Inc." <shop@example.com>',
        to=["bob@example.com", "Carol <carol@example.org>"],
        cc="dave@example.net",
        bcc=("secret@example.com",),
        reply_to="support@example.com",
        subject="Your order #42 — shipped",
        text="Hi Bob,\nyour order shipped.",
        html='<p>Hi Bob</p><img src="cid:logo">',
        headers={"X-Ref": "order-42", "List-Unsubscribe": "<https://example.com/u/abc>"},
        attachments=[
            PDF,
            Attachment(
                filename="logo.png",
                content=bytes(range(256)),
                content_type="image/png",
                disposition="inline",
                content_id="logo",
            ),
        ],
        configuration_set="transactional",
        tags={"campaign": "order-shipped"},
    )


@pytest.mark.parametrize(("overrides", "error", "field"), INVALID)
def test_invalid_field_raises_the_specific_error(
    overrides: dict[str, Any], error: type[InvalidEmail], field: str
) -> None:
    with pytest.raises(InvalidEmail) as info:
        make(**overrides)
    assert type(info.value) is error
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


INJECTIONS = [
    pytest.param({"sender": "a@example.com\r\nBcc: x@evil.com"}, "sender", id="sender"),
    pytest.param({"to": ["ok@example.com", "a@example.com\nBcc: x@evil.com"]}, "to[1]", id="to"),
    pytest.param({"cc": "a@example.com\rX: y"}, "cc[0]", id="cc"),
    pytest.param({"bcc": "a@example.com\r\n"}, "bcc[0]", id="bcc"),
    pytest.param({"reply_to": "Evil\n <a@example.com>"}, "reply_to[0]", id="reply-to"),
    pytest.param({"subject": "Hi\r\nBcc: x@evil.com"}, "subject", id="subject-crlf"),
    pytest.param({"subject": "Hi\nthere"}, "subject", id="subject-lf"),
    pytest.param({"subject": "Hi\x00"}, "subject", id="subject-nul"),
    pytest.param({"subject": "Hi\x7f"}, "subject", id="subject-del"),
    pytest.param({"subject": "Hi\u2028there"}, "subject", id="subject-line-separator"),
    pytest.param({"headers": {"X-Ref": "1\r\nBcc: x@evil.com"}}, "headers['X-Ref']", id="hval"),
    pytest.param({"headers": {"X-Ref\r\nBcc": "x"}}, "headers['X-Ref\\r\\nBcc']", id="hname"),
    pytest.param({"tags": {"campaign": "a\nb"}}, "tags['campaign']", id="tag-value"),
    pytest.param({"tags": {"a\rb": "x"}}, "tags['a\\rb']", id="tag-name"),
    pytest.param(
        {"attachments": attach(filename="a.pdf\r\nX-Evil: 1")},
        "attachments[0].filename",
        id="filename",
    ),
    pytest.param(
        {"attachments": attach(content_type="text/plain\r\nX-Evil: 1")},
        "attachments[0].content_type",
        id="content-type",
    ),
    pytest.param(
        {"attachments": attach(content_id="logo\n")}, "attachments[0].content_id", id="cid"
    ),
    pytest.param({"configuration_set": "cs\r\n"}, "configuration_set", id="configuration-set"),
    pytest.param(template(template="welcome\n"), "template", id="template"),
    # RFC 2047 encoded-words that decode to a line break: Python's email package decodes them
    # when it writes a header (builds without the CVE-2024-6923 fix write a real CRLF)
    pytest.param(
        {"subject": "=?utf-8?q?Hi=0D=0ABcc:_spy@example.com?="}, "subject", id="subject-ew-q"
    ),
    pytest.param(
        {"subject": "Re: =?utf-8?b?SGkNCkJjYzogc3B5QGV4YW1wbGUuY29t?="},
        "subject",
        id="subject-ew-b",
    ),
    pytest.param({"subject": "=?x-unknown?q?Hi=0ABcc:_x?="}, "subject", id="subject-ew-charset"),
    pytest.param({"subject": "=?utf-8?q?Hi=E2=80=A8there?="}, "subject", id="subject-ew-u2028"),
    pytest.param(
        {"attachments": attach(filename="=?utf-8?q?f=0D=0AReply-To:_x@evil.com?=.txt")},
        "attachments[0].filename",
        id="filename-ew",
    ),
    pytest.param(
        {"reply_to": '"=?utf-8?q?A=0ABcc:_x@evil.com?=" <a@example.com>'},
        "reply_to[0]",
        id="display-name-ew",
    ),
    pytest.param(
        {"headers": {"X-Ref": "=?utf-8?q?1=0D=0ABcc:_x@evil.com?="}},
        "headers['X-Ref']",
        id="hval-ew",
    ),
    # an undecodable word first must not hide the next one; a charset*language word decodes
    pytest.param(
        {"subject": "=?utf-8?b?A?= =?utf-8?q?=0D=0ABcc:_v@x.com?="},
        "subject",
        id="subject-ew-after-bad",
    ),
    pytest.param({"subject": "=?iso-8859-1*en?q?a=85b?="}, "subject", id="subject-ew-lang-nel"),
    # white space inside the word: against RFC 2047, decoded all the same; its CRLF before a
    # space looked like a fold and wrote a header line of white space alone
    pytest.param(
        {"subject": "x =?utf-8?q?a b=0D=0A_=0D=0A_X:_1?="}, "subject", id="subject-ew-spaces"
    ),
    pytest.param(
        {"attachments": attach(filename="=?utf-8?q?f g=0D=0A_Bcc:_x@evil.com?=.txt")},
        "attachments[0].filename",
        id="filename-ew-spaces",
    ),
    pytest.param(
        {"to": ['"=?utf-8?b?A?= =?utf-8?q?=0D=0AX?=" <a@example.com>']},
        "to[0]",
        id="to-ew-after-bad",
    ),
]


@pytest.mark.parametrize(("overrides", "field"), INJECTIONS)
def test_control_characters_raise_header_injection(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(HeaderInjection) as info:
        make(**overrides)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("subject", "shown"),
    [("=?utf-8?q?caf=C3=A9?= ok", "café ok"), ("=?iso-2022-jp?b?GyRCJEskWyQzGyhC?=", "にほこ")],
)
def test_encoded_words_without_control_characters_are_kept(subject: str, shown: str) -> None:
    assert make(subject=subject).to_mime()["Subject"] == shown


def test_a_rendered_header_that_decodes_to_a_line_break_is_refused() -> None:
    """The last guard, past validation: whatever the email package decodes, no header it
    writes may hold a line break that is not a fold."""
    message = make()
    object.__setattr__(message, "subject", "=?utf-8?q?Hi=0D=0ABcc:_spy@example.com?=")
    with pytest.raises(HeaderInjection) as info:
        message.to_mime()
    assert info.value.field == "headers['Subject']"
    object.__setattr__(message, "subject", "ok")
    object.__setattr__(message, "to", ('"=?utf-8?q?A=0D=0AX?=" <a@example.com>',))
    with pytest.raises(HeaderInjection) as info:  # not a bare ValueError: a retry never helps
        message.to_mime()
    assert info.value.field == "headers['To']"


def test_tab_is_allowed_in_subject() -> None:
    assert make(subject="Order\t42").subject == "Order\t42"


def test_address_error_message_names_field_value_and_reason() -> None:
    with pytest.raises(InvalidAddress) as info:
        make(to=["a@example.com", "bob@"])
    assert str(info.value) == (
        "to[1]: 'bob@' is not a valid email address: There must be something after the @-sign."
    )


def test_no_recipient_raises() -> None:
    with pytest.raises(RecipientCountError) as info:
        make(to=(), reply_to="r@example.com")
    assert info.value.field == "to"


def test_too_many_recipients_counts_to_cc_and_bcc() -> None:
    to = [f"to{i}@example.com" for i in range(20)]
    cc = [f"cc{i}@example.com" for i in range(20)]
    bcc = [f"bcc{i}@example.com" for i in range(MAX_RECIPIENTS + 1 - 40)]
    with pytest.raises(RecipientCountError) as info:
        make(to=to, cc=cc, bcc=bcc)
    assert info.value.field == "to"
    assert "51" in info.value.reason
    assert "50" in info.value.reason


def test_fifty_recipients_are_accepted() -> None:
    to = [f"user{i}@example.com" for i in range(MAX_RECIPIENTS)]
    message = make(to=to, reply_to=["r1@example.com", "r2@example.com"])
    assert len(message.recipients) == MAX_RECIPIENTS


def test_recipients_are_to_then_cc_then_bcc() -> None:
    message = make(to="a@example.com", cc="b@example.com", bcc=["c@example.com", "d@example.com"])
    assert message.recipients == (
        "a@example.com",
        "b@example.com",
        "c@example.com",
        "d@example.com",
    )


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("shop@example.com", "shop@example.com"),
        ("shop@EXAMPLE.Com", "shop@example.com"),
        ("Shop@example.com", "Shop@example.com"),
        ("<shop@example.com>", "shop@example.com"),
        ("Shop <shop@Example.COM>", "Shop <shop@example.com>"),
        ('"Shop, Inc." <shop@example.com>', '"Shop, Inc." <shop@example.com>'),
        ('"Zoë" <zoe@example.com>', "=?utf-8?q?Zo=C3=AB?= <zoe@example.com>"),
        ('"  Shop   Team " <shop@example.com>', "Shop Team <shop@example.com>"),
        ("user@bücher.de", "user@xn--bcher-kva.de"),
        ("Bücher <info@BÜCHER.de>", None),
        ('"Bücher" <info@BÜCHER.de>', "=?utf-8?q?B=C3=BCcher?= <info@xn--bcher-kva.de>"),
    ],
)
def test_validate_address_returns_canonical_ascii_form(given: str, canonical: str | None) -> None:
    if canonical is None:
        with pytest.raises(InvalidAddress) as info:
            validate_address(given, "default_sender")
        assert info.value.field == "default_sender"
        return
    assert validate_address(given, "sender") == canonical
    assert validate_address(canonical, "sender") == canonical
    assert canonical.isascii()


def test_idn_recipient_is_stored_in_punycode() -> None:
    assert make(to="anna@münchen.de").to == ("anna@xn--mnchen-3ya.de",)


def test_display_name_survives_into_mime() -> None:
    parsed = parse(make(sender='"Zoë, Inc." <zoe@example.com>'))
    (sender,) = parsed["From"].addresses
    assert sender.display_name == "Zoë, Inc."
    assert sender.addr_spec == "zoe@example.com"


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("bob@example.com", ("bob@example.com",)),
        (["a@example.com", "b@example.com"], ("a@example.com", "b@example.com")),
        ((f"{c}@example.com" for c in "ab"), ("a@example.com", "b@example.com")),
        ((), ()),
    ],
)
def test_address_fields_coerce_to_tuples(given: Any, stored: tuple[str, ...]) -> None:
    message = make(cc=given)
    assert message.cc == stored
    assert type(message.cc) is tuple


def test_attachment_content_accepts_buffers() -> None:
    for content in (bytearray(b"abc"), memoryview(b"abc")):
        item = Attachment(filename="a.bin", content=content)  # type: ignore[arg-type]
        assert type(item.content) is bytes
        assert item.content == b"abc"


def test_attachments_accept_any_iterable() -> None:
    message = make(attachments=iter([PDF]))
    assert message.attachments == (PDF,)


def test_email_is_frozen() -> None:
    message = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.subject = "changed"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        PDF.filename = "other.pdf"  # type: ignore[misc]


def test_mappings_are_read_only() -> None:
    message = make(headers={"X-Ref": "1"}, tags={"campaign": "a"})
    with pytest.raises(TypeError):
        message.headers["X-Ref"] = "2"  # type: ignore[index]
    with pytest.raises(TypeError):
        message.tags["campaign"] = "b"  # type: ignore[index]


def test_mutating_callers_objects_does_not_change_the_email() -> None:
    headers = {"X-Ref": "1"}
    tags = {"campaign": "a"}
    to = ["a@example.com"]
    message = make(to=to, headers=headers, tags=tags)
    headers["X-Ref"] = "2"
    headers["X-New"] = "3"
    tags["campaign"] = "b"
    to.append("b@example.com")
    assert dict(message.headers) == {"X-Ref": "1"}
    assert dict(message.tags) == {"campaign": "a"}
    assert message.to == ("a@example.com",)


def test_template_data_is_copied_deeply() -> None:
    data: dict[str, Any] = {"items": [1, 2], "user": {"name": "Bob"}}
    message = make(**template(template_data=data))
    data["items"].append(3)
    data["user"]["name"] = "Eve"
    assert message.template_data == {"items": [1, 2], "user": {"name": "Bob"}}
    with pytest.raises(TypeError):
        message.template_data["items"] = []  # type: ignore[index]


def test_template_email_needs_no_subject_or_body() -> None:
    message = make(**template(template_data={"name": "Bob"}))
    assert message.template == "welcome"
    assert message.subject is None
    assert message.text is None


def test_reserved_tags_are_the_relays() -> None:
    assert {"outbox_message_id", "outbox_category", "outbox_attempt"} == RESERVED_TAGS
    for tag in sorted(RESERVED_TAGS):
        with pytest.raises(InvalidEmail) as info:
            make(tags={tag: "x"})
        assert info.value.field == f"tags[{tag!r}]"


def test_payload_round_trip_full_email() -> None:
    message = full_email()
    payload = message.to_payload()
    assert payload["v"] == 1
    assert payload["attachments"][1]["content_b64"] == base64.b64encode(bytes(range(256))).decode()
    restored = Email.from_payload(json.loads(json.dumps(payload)))
    assert restored == message
    assert restored.attachments[1].content == bytes(range(256))


def test_payload_round_trip_template_email() -> None:
    message = make(
        **template(template_data={"name": "Bob", "items": [1, 2.5, None, True], "n": {"a": "b"}}),
        configuration_set="marketing",
        attachments=[PDF],
    )
    assert Email.from_payload(json.loads(json.dumps(message.to_payload()))) == message


def test_payload_omits_empty_fields() -> None:
    assert make().to_payload() == {
        "v": 1,
        "sender": SENDER,
        "to": ["bob@example.com"],
        "subject": "Your order",
        "text": "Thanks for your order.",
    }


def test_from_payload_accepts_explicit_nulls_and_empties() -> None:
    payload = {
        "v": 1,
        "sender": SENDER,
        "to": ["bob@example.com"],
        "cc": None,
        "bcc": [],
        "reply_to": None,
        "subject": "Your order",
        "text": "Thanks for your order.",
        "html": None,
        "headers": None,
        "tags": {},
        "attachments": None,
        "configuration_set": None,
        "template": None,
        "template_data": None,
    }
    assert Email.from_payload(payload) == make()


def test_from_payload_fills_attachment_defaults() -> None:
    payload = make(attachments=attach()).to_payload()
    del payload["attachments"][0]["content_type"]
    del payload["attachments"][0]["disposition"]
    assert Email.from_payload(payload).attachments == attach()


GOOD = {"v": 1, "sender": SENDER, "to": ["bob@example.com"], "subject": "S", "text": "T"}
B64 = {"filename": "a.txt", "content_b64": "aGVsbG8="}


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        pytest.param({k: v for k, v in GOOD.items() if k != "v"}, "payload.v", id="no-version"),
        pytest.param({**GOOD, "v": 2}, "payload.v", id="future-version"),
        pytest.param({**GOOD, "v": "1"}, "payload.v", id="str-version"),
        pytest.param({**GOOD, "v": True}, "payload.v", id="bool-version"),
        pytest.param({**GOOD, "bogus": 1}, "payload.bogus", id="unknown-key"),
        pytest.param({k: v for k, v in GOOD.items() if k != "sender"}, "sender", id="no-sender"),
        pytest.param({**GOOD, "sender": 5}, "sender", id="sender-type"),
        pytest.param({**GOOD, "to": 5}, "to", id="to-type"),
        pytest.param({**GOOD, "to": [None]}, "to[0]", id="to-item"),
        pytest.param({**GOOD, "headers": "x"}, "headers", id="headers-type"),
        pytest.param({**GOOD, "attachments": "x"}, "attachments", id="attachments-type"),
        pytest.param({**GOOD, "attachments": [5]}, "attachments[0]", id="attachment-type"),
        pytest.param(
            {**GOOD, "attachments": [{**B64, "content_b64": "!!"}]},
            "attachments[0].content_b64",
            id="bad-base64",
        ),
        pytest.param(
            {**GOOD, "attachments": [{"filename": "a"}]},
            "attachments[0].content_b64",
            id="no-content",
        ),
        pytest.param(
            {**GOOD, "attachments": [B64, {"content_b64": ""}]},
            "attachments[1].filename",
            id="no-filename",
        ),
        pytest.param(
            {**GOOD, "attachments": [{**B64, "size": 5}]}, "attachments[0].size", id="att-key"
        ),
        pytest.param(
            {**GOOD, "attachments": [{**B64, "filename": 7}]},
            "attachments[0].filename",
            id="filename-type",
        ),
    ],
)
def test_from_payload_rejects_garbage(payload: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidEmail) as info:
        Email.from_payload(payload)
    assert info.value.field == field


def test_from_payload_rejects_non_mapping() -> None:
    with pytest.raises(InvalidEmail) as info:
        Email.from_payload([1, 2])  # type: ignore[arg-type]
    assert info.value.field == "payload"


def test_to_mime_headers_and_parts() -> None:
    message = full_email()
    raw = message.to_mime().as_bytes()
    parsed = BytesParser(policy=policy.default).parsebytes(raw)
    assert raw.isascii()
    assert b"secret@example.com" not in raw
    assert "Bcc" not in parsed
    assert parsed["From"].addresses[0].display_name == "Shop, Inc."
    assert [a.addr_spec for a in parsed["To"].addresses] == ["bob@example.com", "carol@example.org"]
    assert parsed["Cc"] == "dave@example.net"
    assert parsed["Reply-To"] == "support@example.com"
    assert parsed["Subject"] == "Your order #42 — shipped"
    assert parsed["X-Ref"] == "order-42"
    assert parsed["List-Unsubscribe"] == "<https://example.com/u/abc>"
    assert parsed.get_content_type() == "multipart/mixed"
    types = [part.get_content_type() for part in parsed.walk()]
    assert types == [
        "multipart/mixed",
        "multipart/alternative",
        "text/plain",
        "multipart/related",
        "text/html",
        "image/png",
        "application/pdf",
    ]
    plain, html = parsed.get_body(("plain",)), parsed.get_body(("html",))
    assert plain is not None
    assert html is not None
    assert plain.get_content().splitlines() == [
        "Hi Bob,",
        "your order shipped.",
    ]
    assert html.get_content().strip() == '<p>Hi Bob</p><img src="cid:logo">'
    logo = next(p for p in parsed.walk() if p.get_content_type() == "image/png")
    assert logo["Content-ID"] == "<logo>"
    assert logo.get_content_disposition() == "inline"
    assert logo.get_content() == bytes(range(256))
    pdf = next(p for p in parsed.walk() if p.get_content_type() == "application/pdf")
    assert pdf.get_filename() == "invoice.pdf"
    assert pdf.get_content_disposition() == "attachment"
    assert pdf.get_content() == PDF.content


@pytest.mark.parametrize(
    ("fields", "content_type"),
    [
        ({"text": "plain"}, "text/plain"),
        ({"text": None, "html": "<p>x</p>"}, "text/html"),
        ({"html": "<p>x</p>"}, "multipart/alternative"),
        ({"attachments": [PDF]}, "multipart/mixed"),
    ],
)
def test_to_mime_structure(fields: dict[str, Any], content_type: str) -> None:
    assert parse(make(**fields)).get_content_type() == content_type


def test_inline_attachment_without_html_stays_inline() -> None:
    parsed = parse(make(attachments=attach(disposition="inline", content_id="x1")))
    part = next(p for p in parsed.walk() if p.get_filename() == "a.txt")
    assert part.get_content_disposition() == "inline"
    assert part["Content-ID"] == "<x1>"


def test_long_custom_header_is_not_encoded() -> None:
    url = "<https://example.com/unsubscribe?token=" + "t" * 300 + ">"
    raw = make(headers={"List-Unsubscribe": url}).to_mime().as_bytes()
    assert f"List-Unsubscribe: {url}\r\n".encode() in raw


def test_long_address_list_is_folded() -> None:
    to = [f"recipient{i}@example.com" for i in range(10)]
    raw = make(to=to).to_mime().as_bytes()
    header = raw.split(b"\r\nSubject:")[0].split(b"To: ")[1]
    assert all(len(line) <= 78 for line in header.split(b"\r\n"))
    assert [a.addr_spec for a in parse(make(to=to))["To"].addresses] == to


def test_to_mime_refuses_template_email() -> None:
    with pytest.raises(InvalidEmail) as info:
        make(**template()).to_mime()
    assert type(info.value) is InvalidEmail
    assert info.value.field == "template"


BOUND_CASES = [
    pytest.param({}, id="minimal"),
    pytest.param({"text": None, "html": "<p>é</p>" * 500}, id="html-only-unicode"),
    pytest.param({"text": ("a" * 100 + "\n") * 10 + "é=" * 5000}, id="quoted-printable-worst"),
    pytest.param({"text": "\r" * 3000 + "😀" * 500}, id="bare-carriage-returns"),
    pytest.param({"subject": "é " * 400 + "x" * 300}, id="long-unicode-subject"),
    pytest.param(
        {"to": [f'"Ünïcödé Ñame {i}" <user{i}@bücher.de>' for i in range(MAX_RECIPIENTS)]},
        id="fifty-display-names",
    ),
    pytest.param(
        {"headers": {f"X-H{i}": ("w" * 20 + " ") * 47 for i in range(MAX_HEADERS)}},
        id="fifteen-long-headers",
    ),
    pytest.param(
        {
            "html": "<img src=cid:i>",
            "attachments": [
                Attachment(filename='"\\' * 127, content=os.urandom(1000)),
                Attachment(filename="é" * 255, content=b"", content_type="image/png"),
                Attachment(
                    filename="i.png", content=b"x" * 57, disposition="inline", content_id="i"
                ),
            ],
        },
        id="nasty-filenames",
    ),
    pytest.param(
        {"attachments": [Attachment(filename=f"{n}.bin", content=b"z" * n) for n in range(60)]},
        id="many-small-attachments",
    ),
]


@pytest.mark.parametrize("fields", BOUND_CASES)
def test_rendered_size_is_an_upper_bound(fields: dict[str, Any]) -> None:
    message = make(**fields)
    assert message.rendered_size() >= len(message.to_mime().as_bytes())


def test_small_email_is_never_rendered(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(self: Email) -> Any:
        raise AssertionError("to_mime called while constructing a small email")

    monkeypatch.setattr(Email, "to_mime", fail)
    assert make(attachments=[PDF]).rendered_size() < MAX_MESSAGE_BYTES


def test_attachment_over_the_limit_raises() -> None:
    content = os.urandom(29_300_000)
    with pytest.raises(MessageTooLarge) as info:
        make(attachments=[Attachment(filename="big.bin", content=content)])
    assert info.value.field == "attachments"
    assert "40,000,000" in info.value.reason


def test_attachment_clearly_under_the_limit_passes() -> None:
    message = make(attachments=[Attachment(filename="big.bin", content=os.urandom(25_000_000))])
    assert message.rendered_size() < MAX_MESSAGE_BYTES


def test_template_attachment_over_the_limit_raises() -> None:
    big = Attachment(filename="big.bin", content=bytes(30_000_000))
    with pytest.raises(MessageTooLarge) as info:
        make(**template(), attachments=[big])
    assert info.value.field == "attachments"


def test_loose_bound_falls_back_to_the_exact_size(monkeypatch: pytest.MonkeyPatch) -> None:
    html = ("<p>" + "x" * 70 + "</p>\n") * 150_000
    rendered: list[int] = []
    original = Email.to_mime

    def spy(self: Email) -> Any:
        rendered.append(1)
        return original(self)

    monkeypatch.setattr(Email, "to_mime", spy)
    message = make(html=html)
    assert message.rendered_size() > MAX_MESSAGE_BYTES
    assert rendered == [1]


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"text": None, "html": "<p>x</p>\n" * 4_500_000}, "html"),
        ({"text": "line of text\n" * 3_200_000, "html": "<p>x</p>"}, "text"),
    ],
)
def test_body_over_the_limit_names_the_bigger_body(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(MessageTooLarge) as info:
        make(**fields)
    assert info.value.field == field


NAME = st.text(alphabet="abcXYZ 019.,;:'\"\\()<>@=?éüßДж中\u00a0", max_size=16)
LOCAL = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,10}[A-Za-z0-9]", fullmatch=True).filter(
    lambda s: ".." not in s
)
DOMAIN = st.sampled_from(["example.com", "Example.ORG", "bücher.de", "mail.example.co.uk"])


@st.composite
def addresses(draw: st.DrawFn) -> str:
    address = f"{draw(LOCAL)}@{draw(DOMAIN)}"
    name = draw(NAME)
    if not name.strip():
        return address
    escaped = name.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}" <{address}>'


SAFE_TEXT = st.characters(exclude_categories=("Cc", "Cs", "Zl", "Zp"))
HEADERS = st.dictionaries(
    st.from_regex(r"X-[A-Za-z0-9-]{1,20}", fullmatch=True),
    st.from_regex(r"[ -~]{1,120}", fullmatch=True),
    max_size=MAX_HEADERS,
).filter(lambda h: len({k.lower() for k in h}) == len(h))
ATTACHMENTS = st.builds(
    Attachment,
    filename=st.text(SAFE_TEXT, min_size=1, max_size=40).filter(str.strip),
    content=st.binary(max_size=300),
    content_type=st.sampled_from(["application/pdf", "image/png", "text/csv"]),
    disposition=st.sampled_from(["attachment", "inline"]),
    content_id=st.none() | st.from_regex(r"[a-z0-9.@]{1,20}", fullmatch=True),
)
# mail cannot carry U+0000 (refused at construction), and JSON text has no surrogates
NO_NUL = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"))
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | NO_NUL,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NO_NUL, inner, max_size=3),
    max_leaves=10,
)


@st.composite
def emails(draw: st.DrawFn) -> Email:
    fields: dict[str, Any] = {
        "sender": draw(addresses()),
        "to": draw(st.lists(addresses(), min_size=1, max_size=3)),
        "cc": draw(st.lists(addresses(), max_size=2)),
        "bcc": draw(st.lists(addresses(), max_size=2)),
        "reply_to": draw(st.lists(addresses(), max_size=2)),
        "headers": draw(HEADERS),
        "tags": draw(
            st.dictionaries(
                st.from_regex(r"[a-z][a-z0-9_-]{0,9}", fullmatch=True),
                st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True),
                max_size=3,
            ).filter(lambda t: not t.keys() & RESERVED_TAGS)
        ),
        "attachments": draw(st.lists(ATTACHMENTS, max_size=3)),
        "configuration_set": draw(st.none() | st.from_regex(r"[a-z0-9_-]{1,20}", fullmatch=True)),
    }
    if draw(st.booleans()):
        fields["template"] = draw(st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True))
        fields["template_data"] = draw(st.none() | st.dictionaries(NO_NUL, JSON, max_size=4))
    else:
        fields["subject"] = draw(st.text(SAFE_TEXT, min_size=1, max_size=120).filter(str.strip))
        body = st.text(
            st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=400
        )
        fields["text"], fields["html"] = draw(
            st.tuples(body, st.none() | body) | st.tuples(st.none(), body)
        )
    return Email(**fields)


@settings(max_examples=150, deadline=None, database=None)
@given(emails())
def test_payload_round_trip_property(message: Email) -> None:
    payload = json.loads(json.dumps(message.to_payload()))
    assert Email.from_payload(payload) == message
    if message.template is None:
        assert message.rendered_size() >= len(message.to_mime().as_bytes())


@settings(max_examples=150, deadline=None, database=None)
@given(addresses())
def test_canonical_address_is_a_fixed_point(address: str) -> None:
    canonical = validate_address(address, "sender")
    assert canonical.isascii()
    assert validate_address(canonical, "sender") == canonical


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"subject": "s", "text": "pasted\x00text"}, "text"),
        ({"subject": "s", "html": "<p>\x00</p>"}, "html"),
        ({"template": "t", "template_data": {"name": "a\x00"}}, "template_data"),
        ({"template": "t", "template_data": {"k\x00": 1}}, "template_data"),
        ({"template": "t", "template_data": {"list": [{"deep": "\x00"}]}}, "template_data"),
    ],
)
def test_a_nul_character_is_refused_where_it_would_be_stored(fields, field):
    """Mail cannot carry U+0000 and PostgreSQL text cannot store it: refused at construction,
    naming the field, instead of failing the caller's commit."""
    with pytest.raises(InvalidEmail) as info:
        Email(sender="a@example.com", to=["b@example.com"], **fields)
    assert info.value.field == field
    assert "NUL" in info.value.reason


def test_the_six_characters_backslash_u0000_are_ordinary_text():
    message = Email(
        sender="a@example.com", to=["b@example.com"], template="t", template_data={"x": "\\u0000"}
    )
    assert message.template_data["x"] == "\\u0000"
