"""A category's policy is checked when it is made: a bad value names its field."""

from __future__ import annotations

import pytest

from outbox import Category, ConfigurationError
from outbox.schema import DEFAULT_RECONCILE_AFTER, MAX_BACKOFF_SECONDS, AmbiguityPolicy


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"backoff_base": 0}, "backoff_base"),
        ({"backoff_base": float("nan")}, "backoff_base"),
        ({"backoff_base": 10.0, "backoff_cap": 5.0}, "backoff_cap"),
        ({"backoff_cap": float("nan")}, "backoff_cap"),
        ({"backoff_cap": float("inf")}, "backoff_cap"),
        ({"backoff_cap": 1e12}, "backoff_cap"),  # a retry 31,000 years out
        ({"backoff_cap": MAX_BACKOFF_SECONDS + 1}, "backoff_cap"),
    ],
)
def test_a_backoff_policy_out_of_range_is_refused_naming_its_field(fields, field):
    with pytest.raises(ConfigurationError, match=rf"\.{field}\b"):
        Category(name="digest", **fields)


def test_the_longest_backoff_is_allowed():
    assert (
        Category(name="digest", backoff_cap=MAX_BACKOFF_SECONDS).backoff_cap == MAX_BACKOFF_SECONDS
    )


def test_reconcile_takes_the_default_window_and_is_stored_as_hold_with_it():
    category = Category(name="receipts", ambiguity="reconcile")
    assert category.ambiguity is AmbiguityPolicy.RECONCILE
    assert category.reconcile_after == DEFAULT_RECONCILE_AFTER
    assert category.stored_policy == ("hold", DEFAULT_RECONCILE_AFTER)


@pytest.mark.parametrize("window", [1, 0.5, 900.0, MAX_BACKOFF_SECONDS])
def test_reconcile_takes_a_window_up_to_30_days(window):
    category = Category(name="receipts", ambiguity="reconcile", reconcile_after=window)
    assert category.reconcile_after == float(window)
    assert category.stored_policy == ("hold", float(window))


@pytest.mark.parametrize("policy", ["hold", "resend"])
def test_the_other_policies_store_no_window(policy):
    assert Category(name="receipts", ambiguity=policy).stored_policy == (policy, None)


@pytest.mark.parametrize(
    "window", [0, -1.0, float("nan"), float("inf"), MAX_BACKOFF_SECONDS + 1, True, "900"]
)
def test_a_reconcile_window_out_of_range_is_refused_naming_its_field(window):
    with pytest.raises(ConfigurationError, match=r"\.reconcile_after\b.*positive"):
        Category(name="receipts", ambiguity="reconcile", reconcile_after=window)


@pytest.mark.parametrize("policy", ["hold", "resend"])
def test_a_window_with_another_policy_is_refused_naming_its_field(policy):
    with pytest.raises(ConfigurationError, match=r"\.reconcile_after\b.*hold, resend, reconcile"):
        Category(name="receipts", ambiguity=policy, reconcile_after=900.0)


def test_an_unknown_policy_lists_the_three():
    with pytest.raises(ConfigurationError, match=r"\.ambiguity\b.*hold, resend, reconcile"):
        Category(name="receipts", ambiguity="retry")
