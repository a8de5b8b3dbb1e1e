"""Batch formation: exact batch sizes, oldest groups first, no stalls, minimum allocations."""

from __future__ import annotations

from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from blackjack_rl.api.batching import Candidate, exact_subset, form_batch, minimum_sequences, window_for


def cands(sizes: list[int], env: int | None = 0, start: int = 1) -> list[Candidate]:
    return [Candidate(start + i, env, s) for i, s in enumerate(sizes)]


def test_same_sizes_are_taken_strictly_in_order() -> None:
    batch = exact_subset(cands([4] * 10), 16)
    assert batch is not None
    assert [c.id for c in batch] == [1, 2, 3, 4]


def test_heterogeneous_sizes_pack_to_exactly_the_batch_size() -> None:
    batch = exact_subset(cands([8, 4, 2, 2, 16, 4]), 16)
    assert batch is not None
    assert sum(c.size for c in batch) == 16
    assert [c.id for c in batch] == [1, 2, 3, 4]


def test_a_group_that_does_not_fit_is_skipped_not_blocking() -> None:
    # The 8 at the head cannot combine with the 6s (12-sequence batches); the 6s still batch.
    batch = exact_subset(cands([8, 6, 6]), 12)
    assert batch is not None and [c.id for c in batch] == [2, 3]


def test_no_batch_when_no_subset_sums_to_the_target() -> None:
    assert exact_subset(cands([6, 4, 4]), 12) is None
    assert exact_subset(cands([3]), 16) is None


def test_window_bounds_are_what_pigeonhole_needs() -> None:
    assert window_for(1) == 1
    assert window_for(16) == 15 + 7 + 3 + 1 + 0 + 1


@settings(max_examples=200, deadline=None)
@given(
    batch_size=st.sampled_from([1, 2, 4, 6, 8, 12, 16]),
    data=st.data(),
)
def test_exact_subset_is_exact_and_complete(batch_size: int, data: st.DataObject) -> None:
    sizes = data.draw(st.lists(st.sampled_from([d for d in range(1, batch_size + 1) if batch_size % d == 0]),
                               max_size=10))
    queue = cands(sizes)
    batch = exact_subset(queue, batch_size)
    exists = any(
        sum(s for s in combo) == batch_size
        for r in range(1, len(sizes) + 1)
        for combo in combinations(sizes, r)
    )
    assert (batch is not None) == exists
    if batch is not None:
        assert sum(c.size for c in batch) == batch_size
        assert len({c.id for c in batch}) == len(batch)
        assert [c.id for c in batch] == sorted(c.id for c in batch)


@settings(max_examples=100, deadline=None)
@given(batch_size=st.sampled_from([4, 8, 12, 16]), data=st.data())
def test_a_full_window_always_yields_a_batch(batch_size: int, data: st.DataObject) -> None:
    sizes = data.draw(st.lists(st.sampled_from([d for d in range(1, batch_size + 1) if batch_size % d == 0]),
                               min_size=window_for(batch_size), max_size=window_for(batch_size)))
    assert exact_subset(cands(sizes), batch_size) is not None


def test_minimum_allocation_is_served_first() -> None:
    queue = cands([4] * 6, env=0) + cands([4] * 2, env=1, start=100)
    owed = minimum_sequences(16, {1: 0.5}, {1: 4})
    assert owed == {1: 8}
    batch = form_batch(queue, 16, owed, {1: [c for c in queue if c.env_id == 1]})
    assert batch is not None
    assert sum(c.size for c in batch) == 16
    assert sum(c.size for c in batch if c.env_id == 1) == 8


def test_an_owed_environment_with_nothing_queued_holds_batches_as_in_atropos() -> None:
    queue = cands([4] * 8, env=0)
    assert form_batch(queue, 16, {1: 4}, {1: []}) is None


def test_minimums_above_the_batch_are_scaled_down() -> None:
    owed = minimum_sequences(16, {0: 0.75, 1: 0.75}, {0: 2, 1: 2})
    assert sum(owed.values()) <= 16
    assert all(v >= 2 for v in owed.values())
