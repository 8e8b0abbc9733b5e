"""Every exception the outbox raises.

The hierarchy splits at the top into errors the *caller* sees while enqueueing (bad input,
raised before anything touches the database, so the caller's transaction stays usable) and
errors of configuration::

    OutboxError
    ├── EnqueueError                 raised by Email(...) / Outbox.enqueue, before the commit
    │   ├── InvalidEmail             a field of the Email is wrong; ``.field`` names it
    │   │   ├── InvalidAddress       address syntax (sender, to, cc, bcc, reply_to)
    │   │   ├── HeaderInjection      CR or LF in a header value, address or subject
    │   │   ├── RecipientCountError  no recipient, or more than 50 in total
    │   │   └── MessageTooLarge      rendered message over the size limit
    │   ├── InvalidArgument          a bad enqueue option; ``.field`` names it
    │   │   └── InvalidKey           idempotency key empty or too long
    │   └── UnknownCategory          the category is not configured on the Outbox
    └── ConfigurationError           a bad option on Outbox or the relay; ``.setting`` names it

``InvalidEmail`` and its children are also ``ValueError`` so generic validation code catches
them.
"""

from __future__ import annotations

__all__ = [
    "ConfigurationError",
    "EnqueueError",
    "HeaderInjection",
    "InvalidAddress",
    "InvalidArgument",
    "InvalidEmail",
    "InvalidKey",
    "MessageTooLarge",
    "OutboxError",
    "RecipientCountError",
    "UnknownCategory",
]


class OutboxError(Exception):
    """Base class of every error raised by sqlalchemy-outbox."""


class EnqueueError(OutboxError):
    """Bad input at enqueue time; nothing was written and the transaction is still usable."""


class InvalidEmail(EnqueueError, ValueError):
    """A field of an :class:`outbox.Email` is invalid.

    ``field`` is the name of the offending field (``"to[2]"``, ``"headers['X-Ref']"``,
    ``"subject"``), ``reason`` says what is wrong with it.
    """

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class InvalidAddress(InvalidEmail):
    """An email address does not parse as a deliverable address."""


class HeaderInjection(InvalidEmail):
    """A CR or LF character in a value that ends up in a mail header."""


class RecipientCountError(InvalidEmail):
    """No recipient at all, or more recipients than SES accepts in one message."""


class MessageTooLarge(InvalidEmail):
    """The rendered message is larger than the provider (or the database) accepts."""


class InvalidArgument(EnqueueError, ValueError):
    """An option passed to ``enqueue`` (priority, not_before, expires_at, ...) is invalid."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class InvalidKey(InvalidArgument):
    """The idempotency key is empty or longer than the column allows."""


class UnknownCategory(EnqueueError, LookupError):
    """The category passed to ``enqueue`` is not configured on the :class:`outbox.Outbox`."""

    def __init__(self, category: str, known: list[str]) -> None:
        self.category = category
        super().__init__(
            f"category: {category!r} is not configured (known: {', '.join(sorted(known))})"
        )


class ConfigurationError(OutboxError, ValueError):
    """A configuration value is invalid; ``setting`` names it."""

    def __init__(self, setting: str, reason: str) -> None:
        self.setting = setting
        self.reason = reason
        super().__init__(f"{setting}: {reason}")
