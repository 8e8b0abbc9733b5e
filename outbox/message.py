"""The :class:`Email` value object: checked when built, stored as a payload, rendered as MIME.

Every check runs in the constructor, before anything touches the database, so a bad address or
an injected header surfaces as an :class:`~outbox.exceptions.InvalidEmail` in the caller's code
instead of as a poison row in the relay. The relay rebuilds the message from its row with
:meth:`Email.from_payload`, which runs the same checks again, and sends it through SES either as
simple or template content or as the raw MIME from :meth:`Email.to_mime`.

Addresses are stored in a canonical ASCII form (IDN domains in punycode, display names quoted
or RFC 2047 encoded by :func:`email.utils.formataddr`), so what is stored is what SES accepts.
"""

from __future__ import annotations

import base64
import copy
import functools
import importlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from email import policy
from email.message import EmailMessage, MIMEPart
from email.utils import formataddr
from types import MappingProxyType
from typing import Any, Literal, Self

from email_validator import EmailNotValidError, validate_email

from outbox.exceptions import (
    HeaderInjection,
    InvalidAddress,
    InvalidEmail,
    MessageTooLarge,
    RecipientCountError,
)

__all__ = [
    "MAX_HEADERS",
    "MAX_MESSAGE_BYTES",
    "MAX_RECIPIENTS",
    "RESERVED_TAGS",
    "TRACE_KEY",
    "Attachment",
    "Email",
    "validate_address",
]

MAX_RECIPIENTS = 50
MAX_MESSAGE_BYTES = 40_000_000
MAX_HEADERS = 15
RESERVED_TAGS = frozenset({"outbox_message_id", "outbox_category", "outbox_attempt"})

TRACE_KEY = "trace"  # the payload's optional W3C trace context of the enqueue (outbox.tracing)

_PAYLOAD_VERSION = 1
_PAYLOAD_KEYS = frozenset(
    {"v", "sender", "to", "cc", "bcc", "reply_to", "subject", "text", "html", "headers"}
    | {"attachments", "configuration_set", "tags", "template", "template_data", TRACE_KEY}
)
_ATTACHMENT_KEYS = frozenset(
    {"filename", "content_type", "disposition", "content_id", "content_b64"}
)
_MAX_TEMPLATE_DATA_BYTES = 262_144
_MESSAGE_OVERHEAD = 1_000
_PART_OVERHEAD = 400
_EMPTY: Mapping[str, Any] = MappingProxyType({})
# 7bit keeps the rendered message pure ASCII; "none" keeps pre-folded raw headers intact
_POLICY = policy.SMTP.clone(cte_type="7bit", refold_source="none")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
# the decoder the email package writes headers with (private, and without type stubs)
_encoded_words: Any = importlib.import_module("email._encoded_words")
# white space inside a word breaks RFC 2047 but not Python's decoder, which reads up to "?="
_ENCODED_WORD = re.compile(r"=\?[^?]*\?[bBqQ]\?[^?]*\?=")
_FOLD = re.compile(r"\r?\n(?=[ \t])")  # a folded header's line break, before its white space
_HEADER_NAME = re.compile(r"[!-9;-@A-~]{1,126}")
_HEADER_VALUE = re.compile(r"[ -~]{1,995}")
_TAG = re.compile(r"[A-Za-z0-9_-]{1,256}")
_CONFIGURATION_SET = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CONTENT_TYPE = re.compile(r"[A-Za-z0-9!#$&^_.+-]+/[A-Za-z0-9!#$&^_.+-]+")
_CONTENT_ID = re.compile(r"[!-;=?-~]{1,78}")
_FIELD_HEADERS = {
    "from": "sender",
    "to": "to",
    "cc": "cc",
    "bcc": "bcc",
    "reply-to": "reply_to",
    "subject": "subject",
}
_LIBRARY_HEADERS = frozenset(
    {"content-type", "content-transfer-encoding", "mime-version", "sender", "return-path", "date"}
)


def _no_strings() -> Mapping[str, str]:
    return _EMPTY


def _show(value: str) -> str:
    return repr(value) if len(value) <= 80 else f"{value[:77]!r}..."


def _require_str(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise InvalidEmail(field, f"expected a str, got {type(value).__name__}")
    return value


def _single_line(value: str, field: str) -> None:
    found = _CONTROL.search(value) or _CONTROL.search(_decoded_words(value))
    if found is not None:
        raise HeaderInjection(
            field,
            f"{_show(value)} contains the control character U+{ord(found.group()):04X} (as "
            "itself or in an RFC 2047 encoded-word); values that end up in mail headers must "
            "be a single line",
        )


def _check_rendered(message: EmailMessage) -> None:
    """Refuse a message any of whose headers, as the email package reads (and may write) it,
    holds a line break that is not a fold: the last guard against a header we did not foresee
    being decoded into a new header line."""
    for part in message.walk():
        for name in part:
            try:
                text = _FOLD.sub(" ", str(part[name]))
            except ValueError as exc:  # the email package refuses to read it (an address)
                raise HeaderInjection(f"headers['{name}']", f"cannot be rendered: {exc}") from None
            found = _CONTROL.search(text) or _CONTROL.search(_decoded_words(text))
            if found is not None:
                raise HeaderInjection(
                    f"headers['{name}']",
                    f"the rendered header holds the control character U+{ord(found.group()):04X}",
                )


def _decoded_words(value: str) -> str:
    """The text of each RFC 2047 encoded-word (``=?utf-8?q?...?=``) in ``value``, decoded
    one by one as Python's email package decodes them when it writes a header (its own
    decoder: a ``charset*lang`` word, bad padding, an unknown charset read as bytes): builds
    without the CVE-2024-6923 fix write a decoded CR/LF as a real line break (a new header).
    A word it cannot decode at all is written as it is, and checked as itself."""
    if "=?" not in value:
        return ""
    text = []
    for word in _ENCODED_WORD.findall(value):
        try:
            decoded, *_ = _encoded_words.decode(word)
        except Exception:  # undecodable: written as it is
            continue
        text.append(decoded)
    return "".join(text)


def _utf8_len(value: str) -> int:
    return len(value) if value.isascii() else len(value.encode("utf-8"))


def _check_utf8(value: str, field: str) -> None:
    try:
        _utf8_len(value)
    except UnicodeEncodeError as exc:
        raise InvalidEmail(
            field, f"contains a lone surrogate at position {exc.start} and cannot be sent as UTF-8"
        ) from None
    if "\x00" in value:
        raise InvalidEmail(
            field,
            f"contains a NUL character (U+0000) at position {value.index(chr(0))}; mail cannot "
            "carry it (and PostgreSQL text cannot store it)",
        )


def _as_tuple(value: object, field: str, expected: str) -> tuple[object, ...]:
    kind = type(value)
    if kind is tuple or kind is list:  # the usual cases, without the ABC checks below
        return tuple(value)  # type: ignore[arg-type]
    if isinstance(value, str):
        return (value,)
    if isinstance(value, bytes | bytearray | memoryview | Mapping) or not isinstance(
        value, Iterable
    ):
        raise InvalidEmail(field, f"expected {expected}, got {type(value).__name__}")
    return tuple(value)


def _str_pairs(value: object, field: str) -> list[tuple[str, str]]:
    if value is _EMPTY:
        return []
    if type(value) is not dict and not isinstance(value, Mapping):
        raise InvalidEmail(field, f"expected a mapping of str to str, got {type(value).__name__}")
    pairs = []
    for name, item in value.items():
        where = f"{field}[{name!r}]"
        if not isinstance(name, str):
            raise InvalidEmail(where, f"names must be str, got {type(name).__name__}")
        text = _require_str(item, where)
        _single_line(name, where)
        _single_line(text, where)
        pairs.append((name, text))
    return pairs


@functools.lru_cache(maxsize=4096)
def _canonical_address(value: str) -> str:
    result = validate_email(
        value, check_deliverability=False, allow_smtputf8=False, allow_display_name=True
    )
    address = result.ascii_email or result.normalized
    name = " ".join((result.display_name or "").split())
    return formataddr((name, address)) if name else address


def _address(value: object, field: str) -> str:
    text = _require_str(value, field)
    _single_line(text, field)
    try:
        return _canonical_address(text)
    except EmailNotValidError as exc:
        raise InvalidAddress(field, f"{_show(text)} is not a valid email address: {exc}") from None


def validate_address(value: str, field: str) -> str:
    """Check one address and return its canonical form; errors name ``field``.

    ``"Shop <shop@Example.com>"`` and bare ``"shop@example.com"`` forms are accepted. The result
    is ASCII: the domain is lower-cased (IDN in punycode) and a display name is kept through
    :func:`email.utils.formataddr`. Raises :class:`HeaderInjection` for control characters and
    :class:`InvalidAddress` when the address does not parse. No DNS lookup is done.
    """
    return _address(value, field)


def _base64_size(size: int) -> int:
    chars = 4 * math.ceil(size / 3)
    return chars + 2 * math.ceil(chars / 76)


def _header_size(name: str, value_bytes: int) -> int:
    return len(name) + 84 + 3 * value_bytes


def _fold(name: str, value: str) -> str:
    """Fold ``value`` at spaces so header lines stay within 78 characters where possible."""
    pieces: list[str] = []
    width = len(name) + 2
    for index, word in enumerate(value.split(" ")):
        if index and word and width + 1 + len(word) > 78:
            pieces.append("\n " + word)
            width = 1 + len(word)
        else:
            pieces.append(" " + word if index else word)
            width += len(word) + (1 if index else 0)
    return "".join(pieces)


@dataclass(frozen=True, kw_only=True, slots=True)
class Attachment:
    """A file attached to an :class:`Email`; it is checked when the email is built.

    ``content`` may be given as ``bytearray`` or ``memoryview`` and is stored as ``bytes``. An
    ``inline`` attachment with a ``content_id`` is shown where the html says ``cid:<id>``.
    """

    filename: str
    content: bytes = field(repr=False)
    content_type: str = "application/octet-stream"
    disposition: Literal["attachment", "inline"] = "attachment"
    content_id: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.content, bytearray | memoryview):
            object.__setattr__(self, "content", bytes(self.content))


def _check_attachment(item: object, where: str) -> Attachment:
    if not isinstance(item, Attachment):
        raise InvalidEmail(where, f"expected an Attachment, got {type(item).__name__}")
    filename = _require_str(item.filename, f"{where}.filename")
    _single_line(filename, f"{where}.filename")
    if not filename.strip() or len(filename) > 255:
        raise InvalidEmail(f"{where}.filename", "a file name is 1 to 255 characters, not blank")
    _check_utf8(filename, f"{where}.filename")
    content_type = _require_str(item.content_type, f"{where}.content_type")
    _single_line(content_type, f"{where}.content_type")
    if len(content_type) > 78 or not _CONTENT_TYPE.fullmatch(content_type):
        raise InvalidEmail(
            f"{where}.content_type",
            f"{_show(content_type)} is not a MIME type of the form type/subtype (max 78 chars)",
        )
    if content_type.lower().startswith("multipart/"):
        raise InvalidEmail(f"{where}.content_type", "an attachment cannot be multipart/*")
    if item.disposition not in ("attachment", "inline"):
        raise InvalidEmail(
            f"{where}.disposition", f"{item.disposition!r} is not 'attachment' or 'inline'"
        )
    if item.content_id is not None:
        content_id = _require_str(item.content_id, f"{where}.content_id")
        _single_line(content_id, f"{where}.content_id")
        if not _CONTENT_ID.fullmatch(content_id):
            raise InvalidEmail(
                f"{where}.content_id",
                f"{_show(content_id)} is not 1 to 78 printable ASCII characters without spaces "
                "or angle brackets (html refers to it as cid:<content_id>)",
            )
    if not isinstance(item.content, bytes):
        raise InvalidEmail(f"{where}.content", f"expected bytes, got {type(item.content).__name__}")
    return item


def _attach(part: MIMEPart, item: Attachment, *, related: bool) -> None:
    maintype, subtype = item.content_type.split("/")
    add = part.add_related if related else part.add_attachment
    add(
        item.content,
        maintype,
        subtype,
        filename=item.filename,
        disposition=item.disposition,
        cid=None if item.content_id is None else f"<{item.content_id}>",
    )


def _attachment_from_payload(item: object, where: str) -> Attachment:
    if not isinstance(item, Mapping):
        raise InvalidEmail(where, f"expected a mapping in the payload, got {type(item).__name__}")
    for key in item:
        if key not in _ATTACHMENT_KEYS:
            raise InvalidEmail(f"{where}.{key}", "unknown key in an attachment payload")
    encoded = item.get("content_b64")
    if not isinstance(encoded, str):
        raise InvalidEmail(f"{where}.content_b64", "missing, or not base64 text")
    try:
        content = base64.b64decode(encoded, validate=True)
    except ValueError as exc:
        raise InvalidEmail(f"{where}.content_b64", f"is not valid base64: {exc}") from None
    if item.get("filename") is None:
        raise InvalidEmail(f"{where}.filename", "the attachment payload has no filename")
    return Attachment(
        filename=item["filename"],
        content=content,
        content_type=item.get("content_type") or "application/octet-stream",
        disposition=item.get("disposition") or "attachment",
        content_id=item.get("content_id"),
    )


def _checked_headers(value: object) -> Mapping[str, str]:
    pairs = _str_pairs(value, "headers")
    if len(pairs) > MAX_HEADERS:
        raise InvalidEmail("headers", f"{len(pairs)} custom headers; SES accepts {MAX_HEADERS}")
    seen: set[str] = set()
    for name, text in pairs:
        where = f"headers[{name!r}]"
        if not _HEADER_NAME.fullmatch(name):
            raise InvalidEmail(
                where, "a header name is 1 to 126 printable ASCII characters, no ':'"
            )
        lowered = name.lower()
        if lowered in _FIELD_HEADERS or lowered in _LIBRARY_HEADERS:
            own = _FIELD_HEADERS.get(lowered)
            hint = f"use Email.{own} instead" if own else "the library sets it"
            raise InvalidEmail(where, f"{name} cannot be set as a custom header; {hint}")
        if lowered in seen:
            raise InvalidEmail(where, "header names are case-insensitive; this one is given twice")
        seen.add(lowered)
        if not _HEADER_VALUE.fullmatch(text):
            raise InvalidEmail(where, "a header value is 1 to 995 printable ASCII characters")
    return MappingProxyType(dict(pairs)) if pairs else _EMPTY


def _checked_tags(value: object) -> Mapping[str, str]:
    pairs = _str_pairs(value, "tags")
    for name, text in pairs:
        where = f"tags[{name!r}]"
        if not _TAG.fullmatch(name) or not _TAG.fullmatch(text):
            raise InvalidEmail(
                where, "tag names and values are 1 to 256 ASCII letters, digits, '_' or '-'"
            )
        if name in RESERVED_TAGS:
            raise InvalidEmail(where, f"the tag {name} is reserved: the relay sets it")
    return MappingProxyType(dict(pairs)) if pairs else _EMPTY


def _has_nul(value: object) -> bool:
    """Whether a NUL character is in any string (key or value) of JSON-like ``value``."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, Mapping):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_has_nul(item) for item in value)
    return False


def _checked_template_data(value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidEmail("template_data", f"expected a mapping, got {type(value).__name__}")
    try:
        encoded = json.dumps(dict(value), allow_nan=False, ensure_ascii=False)
        size = len(encoded.encode("utf-8"))
    except (TypeError, ValueError) as exc:
        raise InvalidEmail("template_data", f"is not JSON-serializable: {exc}") from None
    if size > _MAX_TEMPLATE_DATA_BYTES:
        raise InvalidEmail(
            "template_data", f"{size:,} bytes as JSON; SES accepts {_MAX_TEMPLATE_DATA_BYTES:,}"
        )
    if _has_nul(value):
        raise InvalidEmail(
            "template_data", "contains a NUL character (U+0000), which mail cannot carry"
        )
    return MappingProxyType(json.loads(encoded))


@dataclass(frozen=True, kw_only=True, slots=True)
class Email:
    """One email, validated completely at construction.

    Give either ``template`` (an SES template name, with optional ``template_data``) or a
    ``subject`` with ``text`` and/or ``html``. Address fields take one address as a str or any
    iterable of addresses and are stored as tuples of canonical addresses; ``headers``, ``tags``
    and ``template_data`` are stored as read-only copies. Any problem raises the most specific
    :class:`~outbox.exceptions.InvalidEmail` subclass, with ``.field`` naming the field
    (``"to[1]"``, ``"headers['X-Ref']"``, ``"attachments[0].filename"``).
    """

    sender: str
    to: Sequence[str] = ()  # any sequence (or one str); stored as a tuple
    cc: Sequence[str] = ()  # any sequence (or one str); stored as a tuple
    bcc: Sequence[str] = ()  # any sequence (or one str); stored as a tuple
    reply_to: Sequence[str] = ()  # any sequence (or one str); stored as a tuple
    subject: str | None = None
    text: str | None = None
    html: str | None = None
    headers: Mapping[str, str] = field(default_factory=_no_strings)
    attachments: Sequence[Attachment] = ()  # stored as a tuple
    configuration_set: str | None = None
    tags: Mapping[str, str] = field(default_factory=_no_strings)
    template: str | None = None
    template_data: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        store = functools.partial(object.__setattr__, self)
        store("sender", _address(self.sender, "sender"))
        kinds = ("to", "cc", "bcc", "reply_to")
        given = {kind: _as_tuple(getattr(self, kind), kind, "a str or strs") for kind in kinds}
        count = len(given["to"]) + len(given["cc"]) + len(given["bcc"])
        if count == 0:
            raise RecipientCountError(
                "to", "an email needs at least one recipient in to, cc or bcc"
            )
        if count > MAX_RECIPIENTS:
            raise RecipientCountError(
                "to", f"{count} recipients in to, cc and bcc; SES accepts {MAX_RECIPIENTS}"
            )
        for kind, items in given.items():
            store(kind, tuple(_address(item, f"{kind}[{i}]") for i, item in enumerate(items)))
        self._check_content()
        store("headers", _checked_headers(self.headers))
        store("tags", _checked_tags(self.tags))
        if self.configuration_set is not None:
            name = _require_str(self.configuration_set, "configuration_set")
            _single_line(name, "configuration_set")
            if not _CONFIGURATION_SET.fullmatch(name):
                raise InvalidEmail(
                    "configuration_set", "SES names are 1 to 64 ASCII letters, digits, '_' or '-'"
                )
        items = _as_tuple(self.attachments, "attachments", "an iterable of Attachment")
        store(
            "attachments",
            tuple(_check_attachment(a, f"attachments[{i}]") for i, a in enumerate(items)),
        )
        self._check_size()

    def _check_content(self) -> None:
        if self.template is not None:
            name = _require_str(self.template, "template")
            _single_line(name, "template")
            if not name.strip():
                raise InvalidEmail("template", "the template name must not be blank")
            for part in ("subject", "text", "html"):
                if getattr(self, part) is not None:
                    raise InvalidEmail(part, f"a template email takes its {part} from SES; omit it")
            if self.template_data is not None:
                object.__setattr__(
                    self, "template_data", _checked_template_data(self.template_data)
                )
            return
        if self.template_data is not None:
            raise InvalidEmail("template_data", "template_data is only used with a template")
        if self.subject is None:
            raise InvalidEmail("subject", "an email needs a subject (or a template)")
        subject = _require_str(self.subject, "subject")
        _single_line(subject, "subject")
        if not subject.strip():
            raise InvalidEmail("subject", "the subject must not be blank")
        _check_utf8(subject, "subject")
        for part in ("text", "html"):
            body = getattr(self, part)
            if body is not None:
                if not _require_str(body, part):
                    raise InvalidEmail(part, f"{part} must not be empty; leave it None to omit it")
                _check_utf8(body, part)
        if self.text is None and self.html is None:
            raise InvalidEmail("text", "an email needs text or html (or a template)")

    def _check_size(self) -> None:
        if self.rendered_size() <= MAX_MESSAGE_BYTES:
            return
        if self.attachments:
            where = "attachments"
        else:
            where = "html" if len(self.html or "") >= len(self.text or "") else "text"
        if self.template is not None:
            size = sum(_base64_size(len(a.content)) for a in self.attachments)
            what = "the attachments alone encode to"
        else:
            size = len(self.to_mime().as_bytes())
            what = "the rendered message is"
        if size > MAX_MESSAGE_BYTES:
            raise MessageTooLarge(
                where, f"{what} {size:,} bytes; SES accepts at most {MAX_MESSAGE_BYTES:,}"
            )

    @property
    def recipients(self) -> tuple[str, ...]:
        """All envelope recipients: ``to``, then ``cc``, then ``bcc``."""
        return (*self.to, *self.cc, *self.bcc)

    def rendered_size(self) -> int:
        """A cheap upper bound, in bytes, of ``len(self.to_mime().as_bytes())``.

        Bodies count four bytes per UTF-8 byte (quoted-printable can triple them and adds soft
        line breaks), attachments their exact base64 size. For a template email only the parts
        known before SES renders the template are counted.
        """
        size = _MESSAGE_OVERHEAD + _header_size("From", len(self.sender))
        for name, addresses in (("To", self.to), ("Cc", self.cc), ("Reply-To", self.reply_to)):
            size += _header_size(name, sum(len(a) + 2 for a in addresses))
        if self.subject is not None:
            size += _header_size("Subject", _utf8_len(self.subject))
        size += sum(_header_size(name, len(value)) for name, value in self.headers.items())
        for body in (self.text, self.html):
            if body is not None:
                size += _PART_OVERHEAD + 4 * _utf8_len(body)
        for item in self.attachments:
            size += _PART_OVERHEAD + _base64_size(len(item.content)) + len(item.content_type)
            size += 5 * _utf8_len(item.filename) + len(item.content_id or "")
        return size

    def to_mime(self) -> EmailMessage:
        """Render the full MIME message (no ``Bcc``, ``Date`` or ``Message-ID`` header).

        text and html become a ``multipart/alternative``; inline attachments are related to the
        html part (or plain inline parts without html); the rest make it ``multipart/mixed``.
        Raises :class:`InvalidEmail` for a template email, which only SES can render.
        """
        if self.template is not None:
            raise InvalidEmail("template", "a template email is rendered by SES, not locally")
        message = EmailMessage(policy=_POLICY)
        message.set_raw("From", _fold("From", self.sender))
        for name, addresses in (("To", self.to), ("Cc", self.cc), ("Reply-To", self.reply_to)):
            if addresses:
                message.set_raw(name, _fold(name, ", ".join(addresses)))
        message["Subject"] = self.subject
        for name, value in self.headers.items():
            message.set_raw(name, _fold(name, value))
        html_part: MIMEPart | None = None
        if self.text is not None:
            message.set_content(self.text)
            if self.html is not None:
                message.add_alternative(self.html, subtype="html")
                html_part = list(message.iter_parts())[-1]
        elif self.html is not None:
            message.set_content(self.html, subtype="html")
            html_part = message
        for item in self.attachments:
            if html_part is not None and item.disposition == "inline":
                _attach(html_part, item, related=True)
        for item in self.attachments:
            if html_part is None or item.disposition != "inline":
                _attach(message, item, related=False)
        _check_rendered(message)
        return message

    def to_payload(self) -> dict[str, Any]:
        """A JSON-serializable dict for the outbox row; empty fields are left out."""
        payload: dict[str, Any] = {"v": _PAYLOAD_VERSION, "sender": self.sender}
        for kind in ("to", "cc", "bcc", "reply_to"):
            if getattr(self, kind):
                payload[kind] = list(getattr(self, kind))
        for name in ("subject", "text", "html", "configuration_set", "template"):
            if getattr(self, name) is not None:
                payload[name] = getattr(self, name)
        if self.headers:
            payload["headers"] = dict(self.headers)
        if self.tags:
            payload["tags"] = dict(self.tags)
        if self.attachments:
            payload["attachments"] = [_attachment_payload(item) for item in self.attachments]
        if self.template_data is not None:
            payload["template_data"] = copy.deepcopy(dict(self.template_data))
        return payload

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> Self:
        """Rebuild an email from :meth:`to_payload` output, running every check again.

        Keys may be missing or ``None`` for empty fields. An unknown version, unknown key or
        malformed value raises :class:`InvalidEmail` naming it (``"payload.v"``, ``"sender"``).
        :data:`TRACE_KEY` (the enqueue's trace context, not part of the email) is left out
        unread, whatever it holds: tracing never fails a delivery.
        """
        if type(payload) is not dict and not isinstance(payload, Mapping):
            raise InvalidEmail("payload", f"expected a mapping, got {type(payload).__name__}")
        version = payload.get("v")
        if type(version) is not int or version != _PAYLOAD_VERSION:
            raise InvalidEmail(
                "payload.v", f"unsupported payload version {version!r}; expected {_PAYLOAD_VERSION}"
            )
        for key in payload:
            if key not in _PAYLOAD_KEYS:
                raise InvalidEmail(f"payload.{key}", "unknown key in an email payload")
        if payload.get("sender") is None:
            raise InvalidEmail("sender", "the payload has no sender")
        kwargs = {
            key: value
            for key, value in payload.items()
            if key not in ("v", TRACE_KEY) and value is not None
        }
        tags = kwargs.get("tags")
        if isinstance(tags, Mapping) and not RESERVED_TAGS.isdisjoint(tags):
            # Stored before the name was reserved: the relay sets its own value for it.
            kwargs["tags"] = {k: v for k, v in tags.items() if k not in RESERVED_TAGS}
        if "attachments" in kwargs:
            items = kwargs["attachments"]
            if not isinstance(items, list | tuple):
                raise InvalidEmail("attachments", f"expected a list, got {type(items).__name__}")
            kwargs["attachments"] = tuple(
                _attachment_from_payload(item, f"attachments[{i}]") for i, item in enumerate(items)
            )
        return cls(**kwargs)


def _attachment_payload(item: Attachment) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "filename": item.filename,
        "content_type": item.content_type,
        "disposition": item.disposition,
        "content_b64": base64.b64encode(item.content).decode("ascii"),
    }
    if item.content_id is not None:
        payload["content_id"] = item.content_id
    return payload
