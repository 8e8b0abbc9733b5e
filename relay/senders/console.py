"""A sender that prints each message instead of delivering it: for demos and local work."""

from __future__ import annotations

import sys
import threading
from typing import TextIO

from relay.senders import Accepted, BaseSender, Outcome, OutgoingMessage

__all__ = ["ConsoleSender"]


class ConsoleSender(BaseSender):
    """Writes a short summary of each message (never its body) to ``stream``."""

    name = "console"

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stdout
        self._lock = threading.Lock()

    def send(self, message: OutgoingMessage) -> Outcome:
        email = message.email
        line = (
            f"[outbox] message {message.id} ({message.category}) from {email.sender} "
            f"to {', '.join(email.recipients)}: {email.subject or email.template}\n"
        )
        with self._lock:
            self._stream.write(line)
            self._stream.flush()
        return Accepted(provider_message_id=f"console-{message.id}")
