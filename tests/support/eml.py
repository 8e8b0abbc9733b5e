"""An email with every part the file sender must keep, and the check that an ``.eml`` file
(or any raw MIME) reads back as it."""

from __future__ import annotations

import email
import email.policy
from email.message import EmailMessage

from outbox.message import Attachment, Email

__all__ = ["RICH", "assert_reads_back_as", "parse"]

RICH = Email(
    sender="Shop <shop@example.com>",
    to=["ana@example.com"],
    cc=["ben@example.com"],
    subject="Votre reçu ✓ — 注文 42",
    text="Merci !\nTotal : 12,50 €\n",
    html="<p>Merci&nbsp;! <b>12,50 €</b></p>\n",
    headers={"X-Ref": "order-42"},
    attachments=[
        Attachment(
            filename="reçu.pdf", content=bytes(range(256)) * 4, content_type="application/pdf"
        ),
        Attachment(filename="data.csv", content=b"a,b\r\n1,\xe9\n", content_type="text/csv"),
    ],
)


def parse(data: bytes) -> EmailMessage:
    message = email.message_from_bytes(data, policy=email.policy.default)
    assert isinstance(message, EmailMessage)
    return message


def assert_reads_back_as(data: bytes, mail: Email) -> EmailMessage:
    """``data`` parsed by the standard library has ``mail``'s subject, text and html (their
    lines: MIME carries text with CRLF line ends) and its attachments byte for byte."""
    read = parse(data)
    assert read["Subject"] == mail.subject
    assert read["From"] == mail.sender
    assert read["X-Ref"] == mail.headers.get("X-Ref")
    for subtype, body in (("plain", mail.text), ("html", mail.html)):
        part = read.get_body((subtype,))
        assert part is not None, subtype
        assert part.get_content().replace("\r\n", "\n") == body
    assert [
        (a.get_filename(), a.get_content_type(), a.get_payload(decode=True))
        for a in read.iter_attachments()
    ] == [(a.filename, a.content_type, a.content) for a in mail.attachments]
    return read
