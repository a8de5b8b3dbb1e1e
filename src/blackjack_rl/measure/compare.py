"""Evaluation runs compared pair by pair on the deals they share.

Every evaluation plays the same fixed seeds, so episode i of run A and episode i of
run B start from the same cards. Differencing per seed removes the luck of the deal
that both runs share, which is most of the per-episode variance (sd ~0.95): a small
real improvement then stands out from noise with far fewer episodes than comparing
two independent means. Nothing here reads files; `report.runs` loads the runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from blackjack_rl.measure.evaluation import MIN_N_FOR_INTERVAL, interval, max_payout
from blackjack_rl.contract.records import SCORED_AS_INVALID, DecisionRecord, Metrics, Outcome, SampleRow, Status

Row = SampleRow


@dataclass
class Run:
    """One evaluation run: its metrics.json and its episodes (samples.jsonl rows)."""

    name: str
    metrics: Metrics
    rows: list[Row]


@dataclass(frozen=True)
class Paired:
    """A paired difference, B minus A, over the seeds both runs played."""

    mean: float | None
    ci95_low: float | None
    ci95_high: float | None
    stderr: float | None
    n: int
    b_better: int  # pairs where B's value is higher (better only where higher is better)
    a_better: int
    ties: int
    mean_a: float | None = None
    mean_b: float | None = None

    @property
    def significant(self) -> bool:
        """The 95% interval excludes zero: the difference is unlikely to be luck."""
        return self.ci95_low is not None and (self.ci95_low > 0 or self.ci95_high < 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mean": self.mean, "ci95_low": self.ci95_low, "ci95_high": self.ci95_high, "stderr": self.stderr,
            "n": self.n, "b_better": self.b_better, "a_better": self.a_better, "ties": self.ties,
            "mean_a": self.mean_a, "mean_b": self.mean_b, "significant": self.significant,
        }


def paired_difference(a: Sequence[float], b: Sequence[float], bounds: tuple[float, float] | None = None) -> Paired:
    """Mean of b - a with a normal 95% interval cut to `bounds` (the range the true difference can
    take); no interval below MIN_N_FOR_INTERVAL pairs."""
    if len(a) != len(b):
        raise ValueError(f"paired samples must have equal length, got {len(a)} and {len(b)}")
    n = len(a)
    if n == 0:
        return Paired(None, None, None, None, 0, 0, 0, 0)
    diffs = [y - x for x, y in zip(a, b)]
    mean = math.fsum(diffs) / n
    var = math.fsum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    se = math.sqrt(var / n)
    low, high = interval(mean, se, n, bounds)
    return Paired(
        mean, low, high, se, n,
        b_better=sum(d > 0 for d in diffs), a_better=sum(d < 0 for d in diffs), ties=sum(d == 0 for d in diffs),
        mean_a=math.fsum(a) / n, mean_b=math.fsum(b) / n,
    )


# --- per-episode quantities -------------------------------------------------------------
# Each takes a row and the invalid score both runs are compared at. Training scores (`score`,
# `scores`) are not compared: they include each run's format bonus and depend on its
# scoring mode, so two runs trained differently would differ by construction.

def _game_reward(row: Row, invalid_score: float) -> float | None:
    """The hand's reward; an answer that ended the game early counts the invalid score."""
    if row.status != Status.FINISHED:
        return invalid_score
    return row.reward


def _expected(row: Row, invalid_score: float) -> float | None:
    """V*(s0) minus the regret of the decisions taken: the worth of the play without the luck
    of the later cards (an unbiased estimate of the policy's value from this deal)."""
    if row.status != Status.FINISHED:
        return invalid_score
    return None if row.start_value is None else row.start_value - row.regret


def _win(row: Row, invalid_score: float) -> float | None:
    return float(row.outcome == Outcome.WIN)


def _loss(row: Row, invalid_score: float) -> float | None:
    return float(row.outcome == Outcome.LOSS)


def _invalid(row: Row, invalid_score: float) -> float | None:
    return float(row.status in SCORED_AS_INVALID)


def _first_decision(row: Row) -> DecisionRecord | None:
    return row.decisions[0] if row.decisions else None


def _first_correct(row: Row, invalid_score: float) -> float | None:
    """The first decision of a deal is taken in the same state by every run, so it pairs exactly."""
    d = _first_decision(row)
    return None if d is None else float(d.action == d.optimal)


def _first_regret(row: Row, invalid_score: float) -> float | None:
    d = _first_decision(row)
    return None if d is None else d.regret


@dataclass(frozen=True)
class Quantity:
    key: str
    label: str
    of: Callable[[Row, float], float | None]
    higher_is_better: bool = True
    percent: bool = False
    short: str = ""
    in_rewards: bool = False  # ranges over rewards (else over [0, 1], or over regrets)

    def difference_bounds(self, low: float, high: float) -> tuple[float, float]:
        """Where the true mean difference lies, given the range [low, high] of a reward."""
        width = high - low if self.in_rewards else 1.0 if self.percent else high + 1.0
        return -width, width


QUANTITIES: tuple[Quantity, ...] = (
    Quantity("outcome", "game reward (an invalid answer counts the invalid score; no format bonus)", _game_reward,
             short="game reward", in_rewards=True),
    Quantity("expected", "expected return of the decisions (luck of the cards removed; no format bonus)", _expected,
             short="expected (no luck)", in_rewards=True),
    Quantity("win", "win rate", _win, percent=True, short="win rate"),
    Quantity("loss", "loss rate", _loss, higher_is_better=False, percent=True, short="loss rate"),
    Quantity("invalid", "invalid answers", _invalid, higher_is_better=False, percent=True, short="invalid"),
    Quantity("first_correct", "first decision optimal (same state in both runs)", _first_correct, percent=True,
             short="1st decision optimal"),
    Quantity("first_regret", "first decision regret", _first_regret, higher_is_better=False,
             short="1st decision regret"),
)


@dataclass
class Pairing:
    """Which episodes line up: played (not failed) in both runs, on the same seed."""

    seeds: list[int]
    a: list[Row]
    b: list[Row]
    only_a: int = 0
    only_b: int = 0
    failed: int = 0  # seeds dropped because an episode failed in either run


def pair_by_seed(a_rows: Iterable[Row], b_rows: Iterable[Row]) -> Pairing:
    by_seed_a = {r.seed: r for r in a_rows}
    by_seed_b = {r.seed: r for r in b_rows}
    common = sorted(by_seed_a.keys() & by_seed_b.keys())
    ok = [s for s in common if by_seed_a[s].status != Status.FAILED and by_seed_b[s].status != Status.FAILED]
    return Pairing(
        seeds=ok,
        a=[by_seed_a[s] for s in ok],
        b=[by_seed_b[s] for s in ok],
        only_a=len(by_seed_a.keys() - by_seed_b.keys()),
        only_b=len(by_seed_b.keys() - by_seed_a.keys()),
        failed=len(common) - len(ok),
    )


@dataclass
class Comparison:
    """Run B against baseline run A."""

    a: str
    b: str
    pairs: int
    only_a: int
    only_b: int
    failed: int
    differences: dict[str, Paired] = field(default_factory=dict)
    state_differences: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was compared, in words

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a, "b": self.b, "pairs": self.pairs, "only_a": self.only_a, "only_b": self.only_b,
            "failed": self.failed,
            "differences": {k: v.to_dict() for k, v in self.differences.items()},
            "state_differences": self.state_differences,
            "notes": self.notes,
        }


def check_comparable(runs: Sequence[Run]) -> None:
    """Runs on different rules play different games: pairing them would be meaningless."""
    if len(runs) < 2:
        raise ValueError("compare needs at least two runs: blackjack-rl compare RUN_A RUN_B [RUN_C ...]")
    rules = [r.metrics.rules for r in runs]
    for run, r in zip(runs[1:], rules[1:]):
        if r != rules[0]:
            raise ValueError(
                f"{run.name} was played under rules {r.model_dump()} but {runs[0].name} under {rules[0].model_dump()}; "
                "compare runs evaluated with the same --natural/--sab flags"
            )
    first = runs[0].metrics.seeds.first
    for run in runs[1:]:
        if run.metrics.seeds.first != first:
            raise ValueError(f"{run.name} and {runs[0].name} were evaluated on different seed sets; "
                             "re-run both with the current `blackjack-rl evaluate`")


def compare_pair(a: Run, b: Run) -> Comparison:
    pairing = pair_by_seed(a.rows, b.rows)
    result = Comparison(a.name, b.name, len(pairing.seeds), pairing.only_a, pairing.only_b, pairing.failed)
    invalid_score = a.metrics.invalid_score
    best = max_payout(a.metrics.rules)
    low, high = min(-1.0, invalid_score), max(best, invalid_score)
    for q in QUANTITIES:
        xs, ys = [], []
        for ra, rb in zip(pairing.a, pairing.b):
            x, y = q.of(ra, invalid_score), q.of(rb, invalid_score)
            if x is not None and y is not None:
                xs.append(float(x))
                ys.append(float(y))
        if xs:
            result.differences[q.key] = paired_difference(xs, ys, q.difference_bounds(low, high))
    result.state_differences = strategy_differences(a.rows, b.rows)
    result.notes = comparison_notes(a, b, invalid_score)
    if any(p.ci95_low is None for p in result.differences.values()):
        result.notes.append(f"Fewer than {MIN_N_FOR_INTERVAL} pairs give no 95% interval: too few to tell.")
    return result


def comparison_notes(a: Run, b: Run, invalid_score: float) -> list[str]:
    """What the game reward and expected score are, and what was left out to make them comparable."""
    notes = [f"Game reward and expected score count an invalid answer at {invalid_score:+g} in both runs and "
             "include no format bonus, whatever each run's scoring mode, so they compare play alone."]
    trained = []
    for run in (a, b):
        m = run.metrics
        scoring, bonus = m.scoring, m.format_bonus
        trained.append((run.name, scoring, bonus))
    if any(bonus for _, _, bonus in trained) or len({(s, bn) for _, s, bn in trained}) > 1:
        notes.append("Training scores left out of the comparison: " + "; ".join(
            f"{name} scored {scoring or 'unrecorded'} with format bonus {bonus if bonus is not None else 'unrecorded'}"
            for name, scoring, bonus in trained) + ".")
    other = b.metrics.invalid_score
    if other != invalid_score:
        notes.append(f"{b.name} was evaluated with invalid score {other:+g}; its invalid answers are counted at "
                     f"{a.name}'s {invalid_score:+g} here.")
    return notes


def compare_runs(runs: Sequence[Run]) -> list[Comparison]:
    """Every run against the first one (the baseline)."""
    check_comparable(runs)
    return [compare_pair(runs[0], other) for other in runs[1:]]


def strategy_differences(a_rows: Iterable[Row], b_rows: Iterable[Row], min_visits: int = 5) -> list[dict[str, Any]]:
    """States where the two runs hit at clearly different rates, largest gap first.

    Decisions after the first are taken in states that depend on earlier choices, so this
    is descriptive (where the strategies differ), not a paired test.
    """
    def rates(rows: Iterable[Row]) -> dict[tuple[int, int, int], tuple[int, int]]:
        out: dict[tuple[int, int, int], list[int]] = {}
        for row in rows:
            for d in row.decisions:
                if d.action is None:
                    continue
                key = tuple(d.state)
                c = out.setdefault(key, [0, 0])
                c[0] += d.action == "hit"
                c[1] += 1
        return {k: (v[0], v[1]) for k, v in out.items()}

    ra, rb = rates(a_rows), rates(b_rows)
    diffs = []
    for key in ra.keys() & rb.keys():
        (ha, na), (hb, nb) = ra[key], rb[key]
        if na < min_visits or nb < min_visits:
            continue
        gap = hb / nb - ha / na
        if abs(gap) >= 0.2:
            diffs.append({"state": list(key), "hit_a": ha / na, "hit_b": hb / nb, "n_a": na, "n_b": nb, "gap": gap})
    diffs.sort(key=lambda d: (-abs(d["gap"]), d["state"]))
    return diffs


def verdict(p: Paired, q: Quantity, a: str, b: str) -> str:
    """One sentence a person can act on."""
    if p.mean is None:
        return "no paired episodes"
    fmt = (lambda v: f"{v * 100:+.2f} points") if q.percent else (lambda v: f"{v:+.4f}")
    if p.ci95_low is None:
        return (f"{q.short or q.label}, {b} − {a}: {fmt(p.mean)} over {p.n} pairs: too few to tell "
                f"(a 95% interval needs at least {MIN_N_FOR_INTERVAL})")
    span = f"{q.short or q.label}, {b} − {a}: {fmt(p.mean)} (95% CI {fmt(p.ci95_low)} to {fmt(p.ci95_high)}, {p.n} pairs)"
    if p.ties == p.n:
        return f"{span}: identical on every deal"
    if not p.significant:
        return f"{span}: not distinguishable from luck"
    better = (p.mean > 0) == q.higher_is_better
    return f"{span}: {b} is {'better' if better else 'worse'}"
