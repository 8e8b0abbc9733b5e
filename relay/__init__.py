"""The relay: claims the outbox's due messages, sends them, and records what happened.

Nothing is imported from the package itself: its API lives in its modules
(:mod:`relay.worker`, :mod:`relay.senders`, :mod:`relay.testing`, ...).
"""

__all__: list[str] = []
