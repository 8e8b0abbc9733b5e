"""Delivery policy per category of mail, copied onto every row at enqueue time.

A row carries its own max attempts, backoff and ambiguity policy, so the relay needs no copy of
the app's configuration and a policy change applies to new mail only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from outbox.exceptions import ConfigurationError, InvalidArgument
from outbox.fairness import check_fairness_key
from outbox.schema import DEFAULT_RECONCILE_AFTER, MAX_BACKOFF_SECONDS, AmbiguityPolicy

__all__ = ["DEFAULT_CATEGORIES", "Category"]

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Category:
    """How mail of one category is retried.

    ``ambiguity`` decides what happens when a send may or may not have reached the provider:
    ``hold`` (the default) parks it as ``unknown_outcome`` for an operator, so nothing is ever
    sent twice automatically; ``resend`` retries it, for mail where a duplicate is harmless
    and a loss is not; ``reconcile`` parks it like ``hold``, and the relay requeues it once by
    itself if no provider event names it within ``reconcile_after`` seconds while the event
    intake provably flows (events committed after the attempt plus that window). Without a
    flowing intake a ``reconcile`` row waits for an operator, exactly as a ``hold`` row does.
    """

    name: str
    max_attempts: int = 10
    backoff_base: float = 2.0  # seconds; the first retry waits up to this long
    backoff_cap: float = 900.0  # seconds; no retry waits longer
    ambiguity: AmbiguityPolicy = AmbiguityPolicy.HOLD
    # seconds; only with ``ambiguity="reconcile"`` (None there: DEFAULT_RECONCILE_AFTER)
    reconcile_after: float | None = None
    # the fairness key of the category's mail when enqueue names none: one key for all of it,
    # or a function of the Email (``outbox.fairness.from_domain``: its From domain)
    fairness_key: str | Callable[[Any], str | None] | None = None

    def __post_init__(self) -> None:
        where = f"categories[{self.name!r}]"
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigurationError(
                "categories.name", f"{self.name!r} must be 1-64 of A-Z a-z 0-9 _ -"
            )
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise ConfigurationError(f"{where}.max_attempts", "must be an integer")
        if not 1 <= self.max_attempts <= 1000:
            raise ConfigurationError(f"{where}.max_attempts", "must be between 1 and 1000")
        if not isinstance(self.backoff_base, int | float) or not self.backoff_base > 0:
            raise ConfigurationError(f"{where}.backoff_base", "must be a positive number")
        if not isinstance(self.backoff_cap, int | float) or not (
            self.backoff_base <= self.backoff_cap <= MAX_BACKOFF_SECONDS
        ):
            raise ConfigurationError(
                f"{where}.backoff_cap",
                f"must be at least backoff_base and at most {MAX_BACKOFF_SECONDS:g} s (30 days)",
            )
        try:
            object.__setattr__(self, "ambiguity", AmbiguityPolicy(self.ambiguity))
        except ValueError:
            raise ConfigurationError(
                f"{where}.ambiguity",
                f"{self.ambiguity!r} is not one of: " + ", ".join(p.value for p in AmbiguityPolicy),
            ) from None
        self._check_reconcile_after(where)
        key = self.fairness_key
        if key is not None and not callable(key):
            try:
                check_fairness_key(key, f"{where}.fairness_key")
            except InvalidArgument as exc:
                raise ConfigurationError(exc.field, exc.reason) from None

    def _check_reconcile_after(self, where: str) -> None:
        """A window belongs to the reconcile policy only: given with ``hold`` or ``resend`` it
        would promise an automatic requeue that never happens."""
        field = f"{where}.reconcile_after"
        if self.ambiguity is not AmbiguityPolicy.RECONCILE:
            if self.reconcile_after is not None:
                raise ConfigurationError(
                    field,
                    f"only applies to ambiguity='reconcile' (this category's is "
                    f"{self.ambiguity.value!r}; the policies are hold, resend, reconcile)",
                )
            return
        if self.reconcile_after is None:
            object.__setattr__(self, "reconcile_after", DEFAULT_RECONCILE_AFTER)
            return
        window = self.reconcile_after
        if (
            isinstance(window, bool)
            or not isinstance(window, int | float)
            or not 0 < window <= MAX_BACKOFF_SECONDS
        ):
            raise ConfigurationError(
                field,
                f"must be a positive number of seconds, at most {MAX_BACKOFF_SECONDS:g} (30 days)",
            )
        object.__setattr__(self, "reconcile_after", float(window))

    @property
    def stored_policy(self) -> tuple[str, float | None]:
        """The row's ``(ambiguity_policy, reconcile_after)``: ``reconcile`` is stored as
        ``'hold'`` with its window set (see ``AmbiguityPolicy.RECONCILE``)."""
        if self.ambiguity is AmbiguityPolicy.RECONCILE:
            return AmbiguityPolicy.HOLD.value, self.reconcile_after
        return self.ambiguity.value, None


DEFAULT_CATEGORIES = (Category(name="default"), Category(name="transactional"))
