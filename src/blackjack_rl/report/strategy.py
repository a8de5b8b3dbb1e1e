"""The model's strategy, state by state: what it did against what Q* says.

People judge a Blackjack player by its strategy chart, so the report is built around
one cell per observable state: hard totals 4-21 and soft totals 12-21, by dealer card
A-10. Every number comes from the decisions recorded in samples.jsonl and from the
exact solution; nothing here reads or writes files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from blackjack_rl.contract.records import SampleRow, Status
from blackjack_rl.game.solver import DEALER_CARDS, HARD_SUMS, HIT, SOFT_SUMS, Solution

CellKey = tuple[int, int, bool]  # (player_sum, dealer_card, soft)


@dataclass
class StateStats:
    """Decisions taken in one state. `invalid` answers count as decisions, and as wrong."""

    decisions: int = 0
    hits: int = 0
    sticks: int = 0
    invalid: int = 0
    correct: int = 0
    regret: float = 0.0  # summed over valid decisions

    @property
    def valid(self) -> int:
        return self.hits + self.sticks

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.valid if self.valid else None

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.decisions if self.decisions else None

    @property
    def mean_regret(self) -> float | None:
        return self.regret / self.valid if self.valid else None


def state_stats(rows: Iterable[SampleRow]) -> tuple[dict[CellKey, StateStats], int]:
    """Per-state counts from samples rows, and the number of played (not failed) episodes."""
    stats: dict[CellKey, StateStats] = {}
    episodes = 0
    for row in rows:
        if row.status == Status.FAILED:
            continue
        episodes += 1
        for d in row.decisions:
            s, dealer, ace = d.state
            st = stats.setdefault((int(s), int(dealer), bool(ace)), StateStats())
            st.decisions += 1
            action = d.action
            if action is None:
                st.invalid += 1
            else:
                st.hits += action == "hit"
                st.sticks += action == "stick"
                st.regret += float(d.regret or 0.0)
            st.correct += action == d.optimal
    return stats, episodes


@dataclass(frozen=True)
class Cell:
    """One state of the chart, ready to draw."""

    player_sum: int
    dealer: int
    soft: bool
    optimal: str  # "hit" | "stick"
    q_gap: float  # |Q*(hit) - Q*(stick)|: what one wrong choice here costs
    decisions: int
    hit_rate: float | None  # share of valid answers that hit
    invalid_rate: float | None
    accuracy: float | None
    mean_regret: float | None  # per valid decision
    cost_per_hand: float  # summed regret / episodes: expected return lost to mistakes here, per hand
    share: float  # share of all decisions taken in this state

    @property
    def disagrees(self) -> bool:
        """The model's usual valid action is not the optimal one (ties count as disagreeing)."""
        if self.hit_rate is None:
            return False
        return (self.hit_rate >= 0.5) != (self.optimal == "hit") or self.hit_rate == 0.5

    @property
    def dealer_label(self) -> str:
        return "A" if self.dealer == 1 else str(self.dealer)

    @property
    def key(self) -> str:
        return f"{'soft' if self.soft else 'hard'}-{self.player_sum}-{self.dealer_label}"


def chart(stats: dict[CellKey, StateStats], solution: Solution, episodes: int, soft: bool) -> list[list[Cell]]:
    """Rows of cells, highest total first (as printed strategy cards are read)."""
    total = sum(st.decisions for st in stats.values()) or 1
    sums = SOFT_SUMS if soft else HARD_SUMS
    grid = []
    for s in sorted(sums, reverse=True):
        row = []
        for d in DEALER_CARDS:
            st = stats.get((s, d, soft), StateStats())
            q_stick, q_hit = solution.q_values((s, d, soft))
            row.append(Cell(
                player_sum=s, dealer=d, soft=soft,
                optimal="hit" if solution.best_action((s, d, soft)) == HIT else "stick",
                q_gap=abs(q_hit - q_stick),
                decisions=st.decisions,
                hit_rate=st.hit_rate,
                invalid_rate=st.invalid / st.decisions if st.decisions else None,
                accuracy=st.accuracy,
                mean_regret=st.mean_regret,
                cost_per_hand=st.regret / episodes if episodes else 0.0,
                share=st.decisions / total,
            ))
        grid.append(row)
    return grid


def costliest(cells: Iterable[Cell], n: int = 10) -> list[Cell]:
    """The states whose mistakes cost the most expected return per hand."""
    return sorted((c for c in cells if c.cost_per_hand > 0), key=lambda c: -c.cost_per_hand)[:n]
