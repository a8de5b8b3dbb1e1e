"""Forming batches of exactly `batch_size` sequences from queued groups of mixed sizes.

Atropos packs groups into "packs" of the largest group size and takes packs in order; a
size that does not divide the largest never packs, and one group larger than the batch
stalls every batch behind it. Here the batch is the oldest exact subset:

* take the shortest prefix of the queue (oldest first) from which some subset sums to
  exactly `batch_size`, and within it prefer older groups;
* the API only admits groups whose size divides `batch_size`, so among any
  `window_for(batch_size)` queued groups some size occurs often enough to fill a batch:
  looking at that many groups is enough, and nothing can block the groups behind it.

`min_batch_allocation` is honoured as Atropos does: each connected environment with a
minimum first gets its oldest groups up to `int(batch_size * minimum)` sequences (scaled down
when the minimums add up to more than a batch), and the rest of the batch is filled as above.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_SHOWN_DIVISORS = 12


@dataclass(frozen=True)
class Candidate:
    """A queued group as batching sees it."""

    id: int
    env_id: int | None
    size: int


@functools.lru_cache(maxsize=64)
def divisors(n: int) -> tuple[int, ...]:
    """The divisors of n, ascending, in O(sqrt(n)) steps (n is bounded by MAX_BATCH_SIZE)."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    large = [n // d for d in reversed(small) if d * d != n]
    return tuple(small + large)


def divisors_text(n: int) -> str:
    """A short list of n's divisors for error messages: never longer than a dozen numbers."""
    found = divisors(n)
    if len(found) <= _SHOWN_DIVISORS:
        return ", ".join(map(str, found))
    head = ", ".join(map(str, found[: _SHOWN_DIVISORS - 1]))
    return f"{head}, ... {n} ({len(found)} in all)"


@functools.lru_cache(maxsize=64)
def window_for(batch_size: int) -> int:
    """How many queued groups (oldest first) guarantee a batch if any batch exists among them.

    With every size dividing `batch_size`, a set of groups that cannot fill a batch holds at
    most `batch_size / s - 1` groups of each size `s`; one more group than that always can.
    """
    return sum(batch_size // s - 1 for s in divisors(batch_size)) + 1


def exact_subset(candidates: Sequence[Candidate], target: int) -> list[Candidate] | None:
    """The oldest subset of `candidates` (queue order) whose sizes sum to exactly `target`.

    Bitset subset-sum over the shortest sufficient prefix: `reach[i]` has bit k set when
    some subset of the first i candidates sums to k. Backtracking skips a candidate whenever
    the remainder is reachable without it, so later candidates are dropped first.
    """
    if target <= 0:
        return [] if target == 0 else None
    # The usual queue (one size, or sizes that add up in order) fills the batch with a plain
    # prefix: no shorter prefix can reach `target`, so that prefix is the answer.
    total = 0
    for count, cand in enumerate(candidates, start=1):
        total += cand.size
        if total >= target:
            if total == target:
                return list(candidates[:count])
            break
    full = (1 << (target + 1)) - 1
    goal = 1 << target
    reach = [1]
    for cand in candidates:
        if cand.size <= 0:
            raise ValueError(f"group {cand.id} has size {cand.size}")
        prev = reach[-1]
        reach.append((prev | (prev << cand.size)) & full)
        if reach[-1] & goal:
            break
    else:
        return None
    chosen: list[Candidate] = []
    remaining = target
    for i in range(len(reach) - 1, 0, -1):
        if remaining == 0:
            break
        if (reach[i - 1] >> remaining) & 1:
            continue  # reachable without candidate i-1: leave it for a later batch
        cand = candidates[i - 1]
        chosen.append(cand)
        remaining -= cand.size
    assert remaining == 0
    chosen.reverse()
    return chosen


def minimum_sequences(
    batch_size: int, allocations: Mapping[int, float], smallest_size: Mapping[int, int]
) -> dict[int, int]:
    """Sequences each environment is owed per batch, as Atropos computes them."""
    owed = {env: int(batch_size * share) for env, share in allocations.items()}
    owed = {env: n for env, n in owed.items() if n > 0}
    total = sum(owed.values())
    if total > batch_size:
        scale = batch_size / total
        owed = {env: max(smallest_size.get(env, 1), int(n * scale)) for env, n in owed.items()}
    return owed


def form_batch(
    queue: Sequence[Candidate],
    batch_size: int,
    owed: Mapping[int, int] | None = None,
    owed_candidates: Mapping[int, Sequence[Candidate]] | None = None,
) -> list[Candidate] | None:
    """Groups making up exactly `batch_size` sequences, oldest first, or None if none can.

    `queue` is the oldest part of the whole queue. `owed` maps environments with a minimum
    allocation to the sequences they are owed, and `owed_candidates` gives each such
    environment's own oldest groups (they may lie beyond `queue`).
    """
    if not owed:
        return exact_subset(queue, batch_size)
    owed_candidates = owed_candidates or {}
    taken: list[Candidate] = []
    taken_ids: set[int] = set()
    total = 0
    for env in sorted(owed):
        mine = owed_candidates.get(env, ())
        if not mine:
            return None  # Atropos too waits for an environment that is owed a share
        got = 0
        for cand in mine:
            if got >= owed[env]:
                break
            if total + cand.size <= batch_size:
                taken.append(cand)
                taken_ids.add(cand.id)
                got += cand.size
                total += cand.size
    rest = exact_subset([c for c in queue if c.id not in taken_ids], batch_size - total)
    if rest is None:
        return None
    return sorted(taken + rest, key=lambda c: c.id)


def runapi_buffer_release(sizes: Sequence[int], target: int) -> list[int]:
    """The groups that Atropos' run-api releases from an environment's buffer, as indices into `sizes`.

    run-api holds a group whose size differs from its environment's `group_size` in a
    per-environment buffer, and after each post releases the groups that
    `find_groups_summing_to_target(buffer, group_size)` picks: the first FIFO run that fits
    and sums to `target`, else the subset its dynamic programme backtracks to (it takes the
    newest groups it can), else none. This is that function, with bitsets for its table;
    `/status-env` uses it to count queued groups as run-api would.
    """
    total = 0
    greedy: list[int] = []
    for i, size in enumerate(sizes):
        if total + size <= target:
            greedy.append(i)
            total += size
            if total == target:
                return greedy
    full = (1 << (target + 1)) - 1
    reach = [1]  # bit j of reach[i]: some subset of the first i groups sums to j
    for size in sizes:
        prev = reach[-1]
        reach.append((prev | (prev << size)) & full)
    if not (reach[-1] >> target) & 1:
        return []
    picked: list[int] = []
    j = target
    for i in range(len(sizes), 0, -1):
        size = sizes[i - 1]
        if j >= size and (reach[i - 1] >> (j - size)) & 1:
            picked.append(i - 1)
            j -= size
    return sorted(picked)
