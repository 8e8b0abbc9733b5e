"""A category's policy is checked when it is made: a bad value names its field."""

from __future__ import annotations

import pytest

from outbox import Category, ConfigurationError
from outbox.schema import MAX_BACKOFF_SECONDS


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
