"""The retry policy's time budget, as a caller's deadline narrows it (retry.py)."""

from __future__ import annotations

import pytest

from blackjack_rl.retry import RetriesExhausted, Retryable, RetryPolicy, retry_sync


def test_a_policy_within_a_deadline_keeps_the_tighter_budget_and_the_rest_of_itself():
    policy = RetryPolicy(attempts=8, base_delay_s=0.2, max_elapsed_s=120.0)
    assert policy.within(1.5).max_elapsed_s == 1.5 and policy.within(500.0).max_elapsed_s == 120.0
    assert RetryPolicy(max_elapsed_s=None).within(3.0).max_elapsed_s == 3.0
    assert policy.within(-1.0).max_elapsed_s == 0.0  # a deadline already past
    assert (policy.within(1.5).attempts, policy.within(1.5).base_delay_s) == (8, 0.2)


def test_no_time_left_means_one_attempt_and_no_wait():
    tries = []

    def attempt(n: int) -> None:
        tries.append(n)
        raise Retryable("503")

    with pytest.raises(RetriesExhausted):
        retry_sync(RetryPolicy(attempts=8, base_delay_s=5.0).within(0.0), attempt)
    assert tries == [1]
