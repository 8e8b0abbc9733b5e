"""What a viewer sees of personal data: addresses masked by their structure (display names
dropped, the local part cut to its first character), keys cut to their prefix, free text
(error messages, SES event details, custom headers, operators' reasons) not at all. An
operator sees every value as it is. Masking a finished string by pattern misses quoted local
parts, encoded names, IDN domains and addresses inside keys; this parses what it can and
withholds what it cannot."""

from __future__ import annotations

import re
from email.utils import getaddresses
from typing import Any

__all__ = ["DOT", "HIDDEN", "Shown"]

HIDDEN = "(hidden from viewers)"
DOT = "\u2022\u2022\u2022"
# an address-looking run in free text a viewer is shown (subjects): masked, best effort
_EMAIL = re.compile(r"(\"[^\"]*\"|[^\s<>\"',;:@]+)@([^\s<>\"',;:@]+)")


def _mask_spec(spec: str) -> str:
    local, at, domain = spec.rpartition("@")
    if not at:
        return DOT
    first = local.lstrip('"')[:1] or DOT
    return f"{first}{DOT}@{domain}"


class Shown:
    """How one page shows personal data: ``Shown(viewer=True)`` masks and withholds."""

    def __init__(self, *, viewer: bool) -> None:
        self.viewer = viewer

    def addresses(self, value: Any) -> str:
        """A list of addresses (a recipients column, a To header): each addr-spec masked,
        display names dropped."""
        text = "" if value is None else str(value)
        if not self.viewer:
            return text
        pairs = getaddresses([text.replace("\n", " ")])
        return ", ".join(_mask_spec(spec) for _, spec in pairs if spec) or (DOT if text else "")

    def address(self, value: Any) -> str:
        return self.addresses(value)

    def key(self, value: Any) -> str:
        """An idempotency key: a viewer sees its first part (up to its first ':'), no more:
        what follows is the app's own, and may hold an address or a name."""
        text = "" if value is None else str(value)
        if not self.viewer:
            return text
        prefix, colon, _ = text.partition(":")
        return f"{prefix}{colon}{DOT}" if colon and "@" not in prefix else DOT

    def subject(self, value: Any) -> str:
        """A subject: shown to viewers (it is how a message is told apart), with anything
        that looks like an address masked."""
        text = "" if value is None else str(value)
        if not self.viewer:
            return text
        return _EMAIL.sub(lambda m: _mask_spec(f"{m.group(1)}@{m.group(2)}"), text)

    def text(self, value: Any) -> str:
        """Free text: withheld from viewers."""
        text = "" if value is None else str(value)
        return HIDDEN if self.viewer and text else text

    def actor(self, value: Any) -> str:
        """Who did it: a viewer sees a login name, an address masked."""
        text = "" if value is None else str(value)
        return self.addresses(text) if self.viewer and "@" in text else text
