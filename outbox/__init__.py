"""sqlalchemy-outbox: email written in your transaction, delivered after it commits."""

from outbox.category import Category
from outbox.enqueue import NOTIFY_CHANNEL, EnqueueResult
from outbox.exceptions import (
    ConfigurationError,
    EnqueueError,
    HeaderInjection,
    InvalidAddress,
    InvalidArgument,
    InvalidEmail,
    InvalidKey,
    MessageTooLarge,
    OutboxError,
    RecipientCountError,
    UnknownCategory,
)
from outbox.message import Attachment, Email
from outbox.schema import AmbiguityPolicy, AttemptOutcome, DeliveryStatus, RelayState, Status
from outbox.session import Outbox

__all__ = [
    "NOTIFY_CHANNEL",
    "AmbiguityPolicy",
    "Attachment",
    "AttemptOutcome",
    "Category",
    "ConfigurationError",
    "DeliveryStatus",
    "Email",
    "EnqueueError",
    "EnqueueResult",
    "HeaderInjection",
    "InvalidAddress",
    "InvalidArgument",
    "InvalidEmail",
    "InvalidKey",
    "MessageTooLarge",
    "Outbox",
    "OutboxError",
    "RecipientCountError",
    "RelayState",
    "Status",
    "UnknownCategory",
]
__version__ = "0.1.0"
