"""The one key a recipient address is compared by: suppressions, SES events, the send screen."""

from __future__ import annotations

__all__ = ["address_key"]


def address_key(address: str) -> str:
    """The lower-cased addr-spec of a canonical address (``a@x.com``, or ``Name <a@x.com>``
    as :class:`~outbox.Email` stores it): the form ``outbox_suppressions`` keys on."""
    if address.endswith(">") and "<" in address:
        address = address[address.rindex("<") + 1 : -1]
    return address.strip().lower()
