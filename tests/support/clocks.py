"""Processes whose wall clock runs off: libfaketime preloaded into a child process."""

from __future__ import annotations

from libfaketime import get_reload_information

__all__ = ["shifted"]


def shifted(env: dict[str, str], offset: str) -> dict[str, str]:
    """``env`` for a process whose wall clock runs ``offset`` off (libfaketime, e.g.
    ``"+118s"``); its monotonic clock is left alone."""
    _needed, preload = get_reload_information()
    out = {**env, **preload, "FAKETIME": offset}
    if env.get("LD_LIBRARY_PATH"):
        out["LD_LIBRARY_PATH"] = f"{preload['LD_LIBRARY_PATH']}:{env['LD_LIBRARY_PATH']}"
    return out
