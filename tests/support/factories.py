"""Building test data: numbered emails, enqueued through the app-side API, and the table of
invalid Email fields.

``email(n)`` and ``enqueue(engine, count)`` stand in for every test's own mail; ``make`` builds
the single email of the message unit tests, and ``INVALID`` lists, per field, the values an
Email refuses and the error it raises.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Outbox
from outbox.exceptions import InvalidAddress, InvalidEmail
from outbox.message import MAX_HEADERS, Attachment, Email

__all__ = ["INVALID", "PDF", "SENDER", "attach", "email", "enqueue", "make", "template"]


def email(n: int = 1, *, short: bool = False, **fields: Any) -> Email:
    """Email number ``n``: from ``Shop <shop@example.com>`` to ``customer{n}@example.com``,
    "Order {n}", "Thanks for order {n}."; ``short``: from ``shop@example.com`` to
    ``c{n}@example.com``, "#{n}", "hello". ``fields`` override any Email field."""
    if short:
        values: dict[str, Any] = {
            "sender": "shop@example.com",
            "to": [f"c{n}@example.com"],
            "subject": f"#{n}",
            "text": "hello",
        }
    else:
        values = {
            "sender": "Shop <shop@example.com>",
            "to": [f"customer{n}@example.com"],
            "subject": f"Order {n}",
            "text": f"Thanks for order {n}.",
        }
    return Email(**{**values, **fields})


def enqueue(
    engine: sa.Engine,
    emails: int | Iterable[Email] = 1,
    *,
    outbox: Outbox | None = None,
    prefix: str | None = None,
    key: str | None = None,
    category: str | None = None,
    priority: int = 0,
    not_before: datetime | None = None,
    expires_at: datetime | None = None,
    per_transaction: int | None = None,
    short: bool = False,
    fairness_key: str | None = None,
    **fields: Any,
) -> list[int]:
    """Enqueue through ``outbox.enqueue`` (a plain ``Outbox()`` by default) and commit; return
    the ids in order.

    ``emails`` is a count (``email(i, short=short, **fields)`` for i from 0) or the Emails
    themselves. The i-th gets the key ``f"{prefix}:{i}"`` with ``prefix``, else ``key`` (None:
    a generated one); ``category``, ``priority``, ``not_before`` and ``expires_at`` go to every
    enqueue, and ``fairness_key`` too. With ``per_transaction`` the rows are committed that
    many at a time.
    """
    if prefix is not None and key is not None:
        raise TypeError("give prefix or key, not both")
    if isinstance(emails, int):
        mails: Sequence[Email] = [email(i, short=short, **fields) for i in range(emails)]
    elif fields or short:
        raise TypeError("email fields go with a count of emails, not with given Emails")
    else:
        mails = list(emails)
    ob = outbox if outbox is not None else Outbox()
    step = per_transaction or max(len(mails), 1)
    ids: list[int] = []
    for start in range(0, len(mails), step):
        with Session(engine) as session, session.begin():
            for i in range(start, min(len(mails), start + step)):
                result = ob.enqueue(
                    session,
                    mails[i],
                    key=f"{prefix}:{i}" if prefix is not None else key,
                    category=category,
                    priority=priority,
                    not_before=not_before,
                    expires_at=expires_at,
                    fairness_key=fairness_key,
                )
                ids.append(result.id)
    return ids


SENDER = "shop@example.com"
PDF = Attachment(filename="invoice.pdf", content=b"%PDF-1.7 ...", content_type="application/pdf")


def make(**overrides: Any) -> Email:
    """Bob's order email (from ``SENDER``), with ``overrides`` of any Email field."""
    fields: dict[str, Any] = {
        "sender": SENDER,
        "to": ("bob@example.com",),
        "subject": "Your order",
        "text": "Thanks for your order.",
    }
    fields.update(overrides)
    return Email(**fields)


def attach(**overrides: Any) -> tuple[Attachment, ...]:
    """A one-attachment tuple: ``a.txt`` saying hello, with ``overrides``."""
    fields: dict[str, Any] = {"filename": "a.txt", "content": b"hello"}
    fields.update(overrides)
    return (Attachment(**fields),)


def template(**overrides: Any) -> dict[str, Any]:
    """Email fields for the SES template ``welcome`` (no subject or body), with ``overrides``."""
    fields: dict[str, Any] = {"subject": None, "text": None, "template": "welcome"}
    fields.update(overrides)
    return fields


INVALID = [
    pytest.param({"sender": "not-an-address"}, InvalidAddress, "sender", id="sender-syntax"),
    pytest.param({"sender": ""}, InvalidAddress, "sender", id="sender-empty"),
    pytest.param({"sender": 5}, InvalidEmail, "sender", id="sender-type"),
    pytest.param({"to": ["a@example.com", "bob@"]}, InvalidAddress, "to[1]", id="to-syntax"),
    pytest.param({"to": "a@localhost"}, InvalidAddress, "to[0]", id="to-no-dot"),
    pytest.param({"to": "a@x.com, b@y.com"}, InvalidAddress, "to[0]", id="to-two-in-one"),
    pytest.param({"cc": ["nope"]}, InvalidAddress, "cc[0]", id="cc-syntax"),
    pytest.param({"bcc": ["x@y.com", "@y.com"]}, InvalidAddress, "bcc[1]", id="bcc-syntax"),
    pytest.param({"reply_to": "r@"}, InvalidAddress, "reply_to[0]", id="reply-to-syntax"),
    pytest.param({"to": [1]}, InvalidEmail, "to[0]", id="to-item-type"),
    pytest.param({"to": 5}, InvalidEmail, "to", id="to-type"),
    pytest.param({"to": b"bob@example.com"}, InvalidEmail, "to", id="to-bytes"),
    pytest.param({"cc": {"a@example.com": 1}}, InvalidEmail, "cc", id="cc-mapping"),
    pytest.param({"subject": None}, InvalidEmail, "subject", id="subject-missing"),
    pytest.param({"subject": "   "}, InvalidEmail, "subject", id="subject-blank"),
    pytest.param({"subject": 5}, InvalidEmail, "subject", id="subject-type"),
    pytest.param({"subject": "a\ud800"}, InvalidEmail, "subject", id="subject-surrogate"),
    pytest.param({"text": None}, InvalidEmail, "text", id="no-body"),
    pytest.param({"text": ""}, InvalidEmail, "text", id="text-empty"),
    pytest.param({"text": 5}, InvalidEmail, "text", id="text-type"),
    pytest.param({"html": b"<p>"}, InvalidEmail, "html", id="html-type"),
    pytest.param({"html": "x\udfff"}, InvalidEmail, "html", id="html-surrogate"),
    pytest.param({"template_data": {"a": 1}}, InvalidEmail, "template_data", id="data-no-tpl"),
    pytest.param(template(subject="Hi"), InvalidEmail, "subject", id="template-subject"),
    pytest.param(template(text="Hi"), InvalidEmail, "text", id="template-text"),
    pytest.param(template(html="<p>"), InvalidEmail, "html", id="template-html"),
    pytest.param(template(template=" "), InvalidEmail, "template", id="template-blank"),
    pytest.param(template(template=5), InvalidEmail, "template", id="template-type"),
    pytest.param(
        template(template_data={"x": object()}), InvalidEmail, "template_data", id="data-json"
    ),
    pytest.param(
        template(template_data={"x": float("nan")}), InvalidEmail, "template_data", id="data-nan"
    ),
    pytest.param(template(template_data=[1]), InvalidEmail, "template_data", id="data-type"),
    pytest.param(
        template(template_data={"x": "\ud800"}), InvalidEmail, "template_data", id="data-utf8"
    ),
    pytest.param(
        template(template_data={"x": "y" * 262_144}), InvalidEmail, "template_data", id="data-big"
    ),
    pytest.param(
        {"headers": {f"X-H{i}": "v" for i in range(MAX_HEADERS + 1)}},
        InvalidEmail,
        "headers",
        id="headers-count",
    ),
    pytest.param({"headers": [("X-A", "b")]}, InvalidEmail, "headers", id="headers-type"),
    pytest.param({"headers": {"X Ref": "1"}}, InvalidEmail, "headers['X Ref']", id="hname-space"),
    pytest.param({"headers": {"X:Ref": "1"}}, InvalidEmail, "headers['X:Ref']", id="hname-colon"),
    pytest.param({"headers": {"": "1"}}, InvalidEmail, "headers['']", id="hname-empty"),
    pytest.param({"headers": {"X" * 127: "1"}}, InvalidEmail, f"headers['{'X' * 127}']", id="hl"),
    pytest.param({"headers": {1: "1"}}, InvalidEmail, "headers[1]", id="hname-type"),
    pytest.param({"headers": {"X-Ref": ""}}, InvalidEmail, "headers['X-Ref']", id="hval-empty"),
    pytest.param({"headers": {"X-Ref": "é"}}, InvalidEmail, "headers['X-Ref']", id="hval-ascii"),
    pytest.param({"headers": {"X-Ref": "v" * 996}}, InvalidEmail, "headers['X-Ref']", id="hv-long"),
    pytest.param({"headers": {"X-Ref": 1}}, InvalidEmail, "headers['X-Ref']", id="hval-type"),
    pytest.param({"headers": {"From": "a@b.com"}}, InvalidEmail, "headers['From']", id="h-from"),
    pytest.param({"headers": {"bcc": "a@b.com"}}, InvalidEmail, "headers['bcc']", id="h-bcc"),
    pytest.param(
        {"headers": {"Reply-To": "a@b.c"}}, InvalidEmail, "headers['Reply-To']", id="h-rt"
    ),
    pytest.param({"headers": {"Date": "today"}}, InvalidEmail, "headers['Date']", id="h-date"),
    pytest.param(
        {"headers": {"content-type": "text/x"}},
        InvalidEmail,
        "headers['content-type']",
        id="h-content-type",
    ),
    pytest.param(
        {"headers": {"X-Ref": "1", "x-ref": "2"}}, InvalidEmail, "headers['x-ref']", id="h-dup"
    ),
    pytest.param({"tags": "campaign"}, InvalidEmail, "tags", id="tags-type"),
    pytest.param({"tags": {"bad tag": "x"}}, InvalidEmail, "tags['bad tag']", id="tag-name"),
    pytest.param({"tags": {"campaign": "a.b"}}, InvalidEmail, "tags['campaign']", id="tag-val"),
    pytest.param({"tags": {"campaign": ""}}, InvalidEmail, "tags['campaign']", id="tag-empty"),
    pytest.param({"tags": {"campaign": 1}}, InvalidEmail, "tags['campaign']", id="tag-val-type"),
    pytest.param({"tags": {"t" * 257: "x"}}, InvalidEmail, f"tags['{'t' * 257}']", id="tag-long"),
    pytest.param(
        {"tags": {"outbox_message_id": "1"}},
        InvalidEmail,
        "tags['outbox_message_id']",
        id="tag-reserved",
    ),
    pytest.param({"configuration_set": ""}, InvalidEmail, "configuration_set", id="cs-empty"),
    pytest.param({"configuration_set": "a b"}, InvalidEmail, "configuration_set", id="cs-space"),
    pytest.param({"configuration_set": "c" * 65}, InvalidEmail, "configuration_set", id="cs-long"),
    pytest.param({"configuration_set": 5}, InvalidEmail, "configuration_set", id="cs-type"),
    pytest.param({"attachments": 5}, InvalidEmail, "attachments", id="att-type"),
    pytest.param({"attachments": [b"x"]}, InvalidEmail, "attachments[0]", id="att-item-type"),
    pytest.param(
        {"attachments": attach(filename="")}, InvalidEmail, "attachments[0].filename", id="fn-0"
    ),
    pytest.param(
        {"attachments": (PDF, *attach(filename="a" * 256))},
        InvalidEmail,
        "attachments[1].filename",
        id="fn-long",
    ),
    pytest.param(
        {"attachments": attach(filename=5)}, InvalidEmail, "attachments[0].filename", id="fn-type"
    ),
    pytest.param(
        {"attachments": attach(content_type="pdf")},
        InvalidEmail,
        "attachments[0].content_type",
        id="ct-form",
    ),
    pytest.param(
        {"attachments": attach(content_type="text/plain; charset=utf-8")},
        InvalidEmail,
        "attachments[0].content_type",
        id="ct-params",
    ),
    pytest.param(
        {"attachments": attach(content_type="multipart/mixed")},
        InvalidEmail,
        "attachments[0].content_type",
        id="ct-multipart",
    ),
    pytest.param(
        {"attachments": attach(content_type="a/" + "b" * 77)},
        InvalidEmail,
        "attachments[0].content_type",
        id="ct-long",
    ),
    pytest.param(
        {"attachments": attach(disposition="bogus")},
        InvalidEmail,
        "attachments[0].disposition",
        id="disposition",
    ),
    pytest.param(
        {"attachments": attach(content_id="<logo>")},
        InvalidEmail,
        "attachments[0].content_id",
        id="cid-brackets",
    ),
    pytest.param(
        {"attachments": attach(content_id="")},
        InvalidEmail,
        "attachments[0].content_id",
        id="cid-empty",
    ),
    pytest.param(
        {"attachments": attach(content_id="c" * 79)},
        InvalidEmail,
        "attachments[0].content_id",
        id="cid-long",
    ),
    pytest.param(
        {"attachments": attach(content="text")},
        InvalidEmail,
        "attachments[0].content",
        id="content-type",
    ),
]
