"""A strict logfmt parser for the tests, written from the grammar that logfmt tools share
(go-logfmt's decoder, which Loki, Vector and friends follow), not from the relay's writer:

    line    = pair *( " " pair )
    pair    = key "=" value
    key     = 1*( any printable character but space, "=" and '"' )
    value   = bare / quoted
    bare    = 1*( any printable character but space, "=", '"' and "\\" )
    quoted  = '"' *( printable character but '"' and "\\" / escape ) '"'
    escape  = "\\" ( '"' / "\\" / "/" / "b" / "f" / "n" / "r" / "t" / "u" 4HEXDIG )

Quoted values are decoded as JSON strings (the escapes are JSON's). It is stricter than the
tools: one space between pairs, no empty bare value, no key twice, no unprintable character
anywhere, so whatever it accepts every logfmt reader reads the same way.
"""

from __future__ import annotations

import json
import re

__all__ = ["LogfmtError", "parse", "parse_pairs"]

_KEY = re.compile(r'[^\s="]+')
_BARE = re.compile(r'[^\s="\\]+')
_QUOTED = re.compile(r'"(?:[^"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"')


class LogfmtError(ValueError):
    """The line is not strict logfmt; the message says where."""


def parse_pairs(line: str) -> list[tuple[str, str]]:
    """The ``(key, value)`` pairs of one logfmt line, in order, values decoded."""
    if not line.isprintable():
        bad = next(c for c in line if not c.isprintable())
        raise LogfmtError(f"unprintable character {bad!r} in {line!r}")
    pairs: list[tuple[str, str]] = []
    pos = 0
    while True:
        key = _KEY.match(line, pos)
        if key is None or line[key.end() : key.end() + 1] != "=":
            raise LogfmtError(f"expected key= at {pos} in {line!r}")
        pos = key.end() + 1
        if line.startswith('"', pos):
            quoted = _QUOTED.match(line, pos)
            if quoted is None:
                raise LogfmtError(f"unterminated or badly escaped value at {pos} in {line!r}")
            value = json.loads(quoted.group())
        else:
            bare = _BARE.match(line, pos)
            if bare is None:
                raise LogfmtError(f"empty or invalid bare value at {pos} in {line!r}")
            quoted, value = bare, bare.group()
        pairs.append((key.group(), value))
        pos = quoted.end()
        if pos == len(line):
            return pairs
        if line[pos] != " " or pos + 1 == len(line):
            raise LogfmtError(f"expected one space then a pair at {pos} in {line!r}")
        pos += 1


def parse(line: str) -> dict[str, str]:
    """One logfmt line as a dict; a key given twice is an error."""
    pairs = parse_pairs(line)
    keys = [k for k, _ in pairs]
    twice = {k for k in keys if keys.count(k) > 1}
    if twice:
        raise LogfmtError(f"keys given twice: {sorted(twice)} in {line!r}")
    return dict(pairs)
