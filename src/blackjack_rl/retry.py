"""Retrying what can succeed later: one policy and one loop for every client that talks to a server.

Each caller decides what a failure means (its own transport, its own status codes) and says
so by raising `Retryable` from one attempt; anything else it raises ends the loop at once
(a refusal is not fixed by asking again). The loop owns the rest: how many attempts, the
jittered exponential backoff between them, a server's Retry-After (a lower bound on the
wait, never a reason to wait past the time budget) and the time budget itself.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, replace
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """Attempt n failed: wait base * 2**(n-1), capped at max_delay_s, times a jitter in [0.5, 1.5).

    `max_elapsed_s`: give up rather than start a wait that would end past this many seconds
    after the first attempt (None: only `attempts` bounds the loop).
    """

    attempts: int = 8
    base_delay_s: float = 0.2
    max_delay_s: float = 10.0
    max_elapsed_s: float | None = 120.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"a retry policy needs at least one attempt, got {self.attempts}")
        if self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError("retry delays cannot be negative")

    def within(self, seconds: float) -> RetryPolicy:
        """This policy, giving up `seconds` after its first attempt at the latest: the rest of a
        caller's own deadline (a user's timeout), which the retries must not overrun."""
        budget = max(0.0, seconds)
        return replace(self, max_elapsed_s=budget if self.max_elapsed_s is None else min(budget, self.max_elapsed_s))

    def backoff(self, attempt: int) -> float:
        return min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1)) * (0.5 + random.random())

    def wait(self, attempt: int, retry_after: float | None = None) -> float:
        """The pause after failed attempt `attempt`: the server's Retry-After plus a little jitter
        (so workers told the same time do not return together), else the backoff."""
        if retry_after is not None:
            return retry_after + random.uniform(0, 0.1 * retry_after + 0.05)
        return self.backoff(attempt)


class Retryable(Exception):
    """One attempt failed in a way a later attempt may not (a timeout, a 5xx, a 429...)."""

    def __init__(self, problem: str, retry_after: float | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.retry_after = retry_after


class RetriesExhausted(Exception):
    """Every attempt the policy allows failed, or the next wait would end past its time budget."""

    def __init__(self, attempts: int, problem: str) -> None:
        super().__init__(f"failed after {attempts} attempt{'s' if attempts != 1 else ''}; last problem: {problem}")
        self.attempts = attempts
        self.problem = problem


def retry_after_seconds(value: str | None) -> float | None:
    """A Retry-After header given in seconds (the HTTP-date form is not used by our servers)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return max(0.0, seconds) if seconds == seconds and seconds != float("inf") else None


async def retry_async(policy: RetryPolicy, attempt: Callable[[int], Awaitable[T]]) -> T:
    """`await attempt(n)` for n = 1, 2, ... until it returns, raises something other than
    `Retryable`, or the policy runs out (then `RetriesExhausted`)."""
    started = time.monotonic()
    n = 0
    while True:
        n += 1
        try:
            return await attempt(n)
        except Retryable as exc:
            failure = exc
        wait = _next_wait(policy, n, failure, started)
        if wait is None:
            raise RetriesExhausted(n, failure.problem) from None
        await asyncio.sleep(wait)


def retry_sync(policy: RetryPolicy, attempt: Callable[[int], T]) -> T:
    """`retry_async` for blocking callers."""
    started = time.monotonic()
    n = 0
    while True:
        n += 1
        try:
            return attempt(n)
        except Retryable as exc:
            failure = exc
        wait = _next_wait(policy, n, failure, started)
        if wait is None:
            raise RetriesExhausted(n, failure.problem) from None
        time.sleep(wait)


def _next_wait(policy: RetryPolicy, n: int, failure: Retryable, started: float) -> float | None:
    if n >= policy.attempts:
        return None
    wait = policy.wait(n, failure.retry_after)
    if policy.max_elapsed_s is not None and time.monotonic() - started + wait > policy.max_elapsed_s:
        return None
    return wait
