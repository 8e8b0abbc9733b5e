"""The console's users file: one user a line, ``name:role:argon2 hash``, written by
``outbox-relay ui-user add``; blank lines and ``#`` comments are kept as they are.

Read again whenever the file changes, so removing a user or changing a role takes effect on
that user's next request, without a restart and without ending anyone else's session.
"""

from __future__ import annotations

import enum
import hashlib
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

from outbox.exceptions import ConfigurationError

__all__ = ["Role", "User", "UsersFile", "add_user", "check_name", "remove_user", "valid_name"]


class Role(enum.StrEnum):
    """What a console user may do: ``viewer`` reads (recipients masked, no bodies);
    ``operator`` also acts on messages and sees bodies."""

    VIEWER = "viewer"
    OPERATOR = "operator"


@dataclass(frozen=True, slots=True)
class User:
    name: str
    role: Role
    # a digest of the user's password hash (users file only): a session names it, so a new
    # password, or the user removed and added again, ends every session made before
    stamp: str = ""


_NAME = re.compile(r"[A-Za-z0-9._@+-]{1,128}")  # an email address or a login; no ':' or space
_HASHER = PasswordHasher()
# verified against when the name is unknown, so a wrong name costs what a wrong password does
_NOBODY = _HASHER.hash("no such user")


def valid_name(name: str) -> bool:
    """Whether ``name`` may name a console user (and be an operator log's actor)."""
    return _NAME.fullmatch(name) is not None


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ConfigurationError(
            f"user name {name!r}",
            "use 1 to 128 letters, digits and . _ @ + - (an email address or a login)",
        )
    return name


def _parse(path: Path, text: str) -> dict[str, tuple[Role, str]]:
    users: dict[str, tuple[Role, str]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, role, digest = [*line.split(":", 2), "", ""][:3]
        where = f"{path}, line {number}"
        if not _NAME.fullmatch(name) or role not in Role.__members__.values():
            raise ConfigurationError(where, "expected name:role:hash with role viewer or operator")
        if not digest.startswith("$argon2"):
            raise ConfigurationError(where, "the password is not an argon2 hash (use ui-user add)")
        if name in users:
            raise ConfigurationError(where, f"user {name} is listed twice")
        users[name] = (Role(role), digest)
    return users


class UsersFile:
    """The users of ``path``, read again when its modification time or size changes.
    Reading a file that cannot be used raises :class:`ConfigurationError` naming it."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int, int] | None = None
        self._users: dict[str, tuple[Role, str]] = {}
        self.load()

    def load(self) -> dict[str, tuple[Role, str]]:
        """The users, read again when the file changed. One open, never through a symlink:
        its mode is checked and its text read on that same descriptor, so a file swapped in
        between the check and the read cannot slip through; the stamp holds the inode, so a
        swap and a swap back are a change too."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, encoding="utf-8") as opened:
                stat = os.fstat(opened.fileno())
                stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size, stat.st_mode)
                with self._lock:
                    if stamp != self._stamp:
                        _check_private(self.path, stat.st_mode)
                        self._users = _parse(self.path, opened.read())
                        self._stamp = stamp
                    return self._users
        except OSError as exc:
            raise ConfigurationError(
                f"users file {self.path}",
                f"{exc.strerror or exc} (create it with `outbox-relay ui-user add`; not a symlink)",
            ) from None

    def user(self, name: str) -> User | None:
        """``name``'s current entry, or None when the file no longer lists it."""
        found = self.load().get(name)
        return None if found is None else User(name, found[0], _stamp(found[1]))

    def authenticate(self, name: str, password: str) -> User | None:
        """The user when ``password`` is theirs, else None, in about the same time either way."""
        found = self.load().get(name)
        try:
            _HASHER.verify(found[1] if found else _NOBODY, password)
        except (VerificationError, InvalidHashError):
            return None
        return User(name, found[0], _stamp(found[1])) if found else None


def _stamp(digest: str) -> str:
    return hashlib.sha256(digest.encode()).hexdigest()[:32]


def _check_private(path: Path, mode: int) -> None:
    """Refuse a users file others may read (the hashes) or change (the roles)."""
    if mode & 0o077:
        raise ConfigurationError(
            f"users file {path}",
            f"mode {mode & 0o777:o} lets other users read or change it; chmod 600 it",
        )


def _write(path: Path, lines: list[str]) -> None:
    """Replace ``path`` at once (a reader sees the old file or the new one), owner-only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write("".join(line + "\n" for line in lines))
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def add_user(path: Path, name: str, role: Role, password: str) -> bool:
    """Add ``name`` or replace its role and password: True when it was new."""
    check_name(name)
    if len(password) < 12:
        raise ConfigurationError("password", "use at least 12 characters")
    if path.exists():
        _parse(path, path.read_text(encoding="utf-8"))  # never rewrite a file we cannot read
    entry = f"{name}:{role.value}:{_HASHER.hash(password)}"
    lines = _lines(path)
    kept = [line for line in lines if line.split(":", 1)[0] != name]
    _write(path, [*kept, entry])
    return len(kept) == len(lines)


def remove_user(path: Path, name: str) -> bool:
    """Remove ``name``: True when it was there."""
    lines = _lines(path)
    kept = [line for line in lines if line.split(":", 1)[0] != name]
    if len(kept) != len(lines):
        _write(path, kept)
    return len(kept) != len(lines)
