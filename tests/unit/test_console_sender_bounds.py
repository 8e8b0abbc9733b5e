"""The console sender's line, whatever the recipients: one line, of a bounded length, every
recipient masked, and no crash.

A valid :class:`~outbox.Email` holds at most 50 recipients of at most 254 characters; the
larger lists here are put into one past its checks (as a row written by hand, or a later
change to those checks, would), so the sender's bound is its own.
"""

from __future__ import annotations

import io

import pytest

from outbox import Email
from relay.senders import Accepted, OutgoingMessage
from relay.senders.console import ConsoleSender

LINE_CHARS = 1_000  # the longest line the sender may write, whatever the recipients


def message(recipients: tuple[str, ...] | None = None, **fields: object) -> OutgoingMessage:
    """A message to ``fields``' recipients (a valid Email), or to ``recipients`` put into
    the Email past its checks."""
    email = Email(
        sender="shop@example.com",
        subject="Your reset code is 424242",
        text="424242",
        **{"to": ["a@example.com"], **fields},  # type: ignore[arg-type]
    )
    if recipients is not None:
        object.__setattr__(email, "to", recipients)
    return OutgoingMessage(id=7, key="k", category="transactional", attempt=1, email=email)


def printed(outgoing: OutgoingMessage) -> str:
    out = io.StringIO()
    assert isinstance(ConsoleSender(out).send(outgoing), Accepted)
    return out.getvalue()


def assert_one_bounded_line(text: str, count: int) -> str:
    assert text.endswith("\n")
    assert len(text.splitlines()) == 1, text[:2000]
    line = text.rstrip("\n")
    assert len(line) <= LINE_CHARS, f"{len(line)} characters: {line[:300]}..."
    assert f"to {count} recipient(s)" in line
    assert "not delivered (console sender)" in line
    assert "424242" not in line  # neither the subject nor the body
    return line


def test_fifty_of_the_longest_valid_addresses_make_one_short_masked_line() -> None:
    domain = ".".join(["d" * 60] * 3) + ".example"  # 191 characters
    to = [f"u{n:02d}{'x' * 60}@{domain}" for n in range(50)]  # 254 characters each
    line = assert_one_bounded_line(printed(message(to=to)), 50)
    for address in to:
        assert len(address) == 254
        assert address.split("@")[0][1:20] not in line
    assert line.count("***@") >= 1


def test_ten_thousand_recipients_make_one_short_masked_line() -> None:
    to = tuple(f"person{n:05d}@example.com" for n in range(10_000))
    line = assert_one_bounded_line(printed(message(to)), 10_000)
    assert "p***@example.com" in line
    assert "person" not in line
    assert "more" in line  # says that it did not name them all


@pytest.mark.parametrize(
    "recipient",
    [
        "jane@" + "d" * 1_000_000 + ".example",  # a 1 MB address
        ", ".join(f"person{n:05d}@example.com" for n in range(40_001)),  # a 1 MB address list
        "jane.doe" * 125_000 + "@example.com",  # a 1 MB local part
    ],
    ids=["domain", "list", "local_part"],
)
def test_a_one_megabyte_recipient_makes_one_short_masked_line(recipient: str) -> None:
    assert len(recipient) >= 1_000_000
    line = assert_one_bounded_line(printed(message((recipient,))), 1)
    for local_part in ("person", "ane"):
        assert local_part not in line


@pytest.mark.parametrize("separator", ["\n", "\r", "\u2028", "\x85", "\x1b[2J"])
def test_a_line_break_or_control_in_a_recipient_stays_on_the_line(separator: str) -> None:
    forged = f"jane@example.com{separator}[outbox] message 8 (transactional) to 1 recipient(s)"
    odd = f"jane@exa{separator}mple.com"
    line = assert_one_bounded_line(printed(message((forged, odd))), 2)
    assert separator not in line
    assert "jane" not in line
