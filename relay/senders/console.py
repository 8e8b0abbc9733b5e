"""A sender that prints one line per message instead of delivering it: for local work only.

Nothing is delivered and every message is marked sent, so ``outbox-relay run`` uses it only
when asked by name (``--sender console``) and says so at start. The line never shows a body
or a subject (a password-reset code), and recipients are masked (``a***@example.com``).
"""

from __future__ import annotations

import sys
import threading
from email.utils import parseaddr
from typing import TextIO

from relay.senders import Accepted, BaseSender, Outcome, OutgoingMessage

__all__ = ["ConsoleSender", "masked"]


# The recipients a line names, and the characters of each (the count says how many): one
# short line whatever a row holds (10,000 recipients, a 1 MB address).
_SHOWN = 5
_ADDRESS_CHARS = 80


def masked(address: str) -> str:
    """``address`` with its local part hidden but its first character: ``a***@example.com``;
    at most 80 characters, none a line break or control character (each shown as ``?``)."""
    local, _, domain = parseaddr(address)[1].rpartition("@")
    text = f"{local[:1]}***@{domain}"
    if len(text) > _ADDRESS_CHARS:
        text = text[: _ADDRESS_CHARS - 3] + "..."
    return "".join(c if c.isprintable() else "?" for c in text)


class ConsoleSender(BaseSender):
    """Writes a short, masked summary of each message to ``stream``."""

    name = "console"
    delivers = False

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stdout
        self._lock = threading.Lock()

    def send(self, message: OutgoingMessage) -> Outcome:
        recipients = message.email.recipients
        shown = [masked(a) for a in recipients[:_SHOWN]]
        if len(recipients) > _SHOWN:
            shown.append(f"and {len(recipients) - _SHOWN} more")
        line = (
            f"[outbox] message {message.id} ({message.category}) to {len(recipients)} "
            f"recipient(s) {', '.join(shown)}: not delivered (console sender)\n"
        )
        with self._lock:
            self._stream.write(line)
            self._stream.flush()
        return Accepted(provider_message_id=f"console-{message.id}")
