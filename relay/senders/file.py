"""A sender that writes each message as an ``.eml`` file into a folder: for local work only.

Nothing is delivered and every message written is marked sent (:class:`Accepted`: delivered
locally), so ``outbox-relay run`` uses it only when asked by name (``--sender file
--mail-dir DIR``) and says so at start. A file is the whole message as the SMTP sender sends
it (headers, text, html, attachments, CRLF line ends), so any mail client opens it. It
appears whole or not at all: written under a hidden temporary name, then renamed. A write
that fails (the folder gone or read-only, a full disk) is :class:`Transient`: nothing was
written, and the message is tried again later.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from email.generator import BytesGenerator
from email.message import EmailMessage
from email.utils import formatdate, parseaddr
from pathlib import Path

from outbox.exceptions import ConfigurationError, InvalidEmail
from relay.senders import Accepted, BaseSender, Outcome, OutgoingMessage, Permanent, Transient

__all__ = ["FileSender", "file_name", "render"]

_OUTBOX_ID_HEADER = "X-Outbox-Message-Id"  # smtp.OUTBOX_ID_HEADER (senders import no sender)


def _utcnow() -> datetime:
    return datetime.now(UTC)


def render(message: OutgoingMessage, *, now: datetime) -> bytes:
    """``message`` as the bytes the SMTP sender sends for it: :meth:`Email.to_mime` with a
    ``Message-ID`` (the same on every attempt), a ``Date`` (``now``) and the outbox id
    header, with CRLF line ends. Raises :class:`InvalidEmail` for a template email."""
    mime: EmailMessage = message.email.to_mime()
    # the headers SmtpSender._mime adds; unit/test_file_sender.py holds both to the same bytes
    if "Message-ID" not in mime:
        domain = parseaddr(message.email.sender)[1].rpartition("@")[2] or "localhost"
        digest = hashlib.sha256(message.key.encode()).hexdigest()[:16]
        mime["Message-ID"] = f"<outbox.{message.id}.{digest}@{domain}>"
    if "Date" not in mime:
        mime["Date"] = formatdate(now.timestamp(), usegmt=True)
    del mime[_OUTBOX_ID_HEADER]
    mime[_OUTBOX_ID_HEADER] = str(message.id)
    with io.BytesIO() as buffer:
        BytesGenerator(buffer).flatten(mime, linesep="\r\n")
        return buffer.getvalue()


def file_name(message: OutgoingMessage, now: datetime) -> str:
    """``20261205T120000.123Z-42-1.eml``: the UTC time (so names sort by it), the outbox id
    and the attempt."""
    at = now.astimezone(UTC)
    return f"{at:%Y%m%dT%H%M%S}.{at.microsecond // 1000:03d}Z-{message.id}-{message.attempt}.eml"


class FileSender(BaseSender):
    """Writes each message to ``directory`` as an ``.eml`` file, readable by its owner only.

    The folder is created if missing (readable by its owner only) and checked by writing a
    file there: a folder that cannot be used is a :class:`ConfigurationError` naming
    ``--mail-dir``, before the relay starts. ``clock`` names the files (UTC)."""

    name = "file"
    delivers = False

    def __init__(
        self, directory: str | os.PathLike[str], *, clock: Callable[[], datetime] = _utcnow
    ) -> None:
        path = Path(directory).absolute()
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".outbox-probe-", dir=path)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            why = "it is not a folder" if path.exists() and not path.is_dir() else exc.strerror
            raise ConfigurationError(
                "--mail-dir", f"{str(path)!r} cannot be created or written to: {why or exc}"
            ) from None
        self.directory = path
        self._clock = clock

    def __repr__(self) -> str:
        return f"FileSender({str(self.directory)!r})"

    def send(self, message: OutgoingMessage) -> Outcome:
        if message.email.template is not None:
            return Permanent(
                code="template_not_supported_by_file",
                message=f"template {message.email.template!r} is rendered by SES; "
                "the file sender cannot write it",
            )
        now = self._clock()
        try:
            data = render(message, now=now)
        except InvalidEmail as exc:  # refused while rendering (as SMTP classifies it)
            return Permanent(code="invalid_payload", message=str(exc))
        name = file_name(message, now)
        try:
            self._write(name, data)
        except OSError as exc:  # nothing was renamed into place: nothing was written
            return Transient(
                code="file_write_failed", message=f"cannot write {self.directory / name}: {exc}"
            )
        return Accepted(provider_message_id=f"file-{name}")

    def _write(self, name: str, data: bytes) -> None:
        """``data`` as ``name``, atomically: to a hidden temporary file (mode 0600) in the
        same folder, flushed to disk, then renamed."""
        fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.directory / name)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    def where(self) -> dict[str, str]:
        return {"mail_dir": str(self.directory)}
