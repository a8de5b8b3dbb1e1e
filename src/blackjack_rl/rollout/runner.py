"""The one deal runner: seeds in, each deal's groups (or an evaluation's episodes) out, counted.

`process`, `evaluate`, `serve`, `train` and the Ray shards all play through a `DealRunner`,
so they draw the same deals for the same seed, limit concurrency the same way and count
what they played the same way (`Tally`): a count one job reports means what it means in
every other.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable

from blackjack_rl.config import GroupConfig
from blackjack_rl.contract.records import Status
from blackjack_rl.game.table import Observation
from blackjack_rl.rollout.core import GroupResult, limited
from blackjack_rl.rollout.episodes import Episode
from blackjack_rl.rollout.estimates import CallMemo, chart_snapshot, snapshot_memo
from blackjack_rl.rollout.groups import play_group
from blackjack_rl.rollout.players import Player
from blackjack_rl.rollout.stepgroups import chart_start, play_step_groups

# Training deals are drawn below 2**32; evaluation deals start far above, so the two
# sets can never overlap, and episode i of every evaluation is the same deal.
EVAL_SEED_BASE = 10**12


def eval_seeds(n: int, first: int = 0) -> range:
    """Evaluation deals first..first+n-1 (a shard of a larger evaluation starts past 0)."""
    return range(EVAL_SEED_BASE + first, EVAL_SEED_BASE + first + n)


# Fidelity probes (`probe_seeds`): a third set of deals, apart from training and evaluation.
PROBE_SEED_BASE = 2 * 10**12
PROBE_SEARCH = 200  # deals looked at per pair asked for, at most: every state of the chart pairs up long before


def probe_seeds(player: Player, config: GroupConfig, pairs: int) -> list[int]:
    """2 x `pairs` fixed deals, in consecutive pairs whose first decision is the same state.

    A credit scheme's noise needs two independent draws of its credit at one decision. Two
    deals that open on the same state are that: the prompt is the same (it shows the state, not
    the cards), and every later card differs. The states come as the config's deals bring
    them (dealt, or its chart starts), so the probe weighs states as training does."""
    table = player.tables.acquire()
    try:
        waiting: dict[Observation, int] = {}
        out: list[int] = []
        for seed in range(PROBE_SEED_BASE, PROBE_SEED_BASE + PROBE_SEARCH * pairs):
            if len(out) == 2 * pairs:
                break
            start = chart_start(seed, player.solution, config.starts) if config.group_by == "step" else None
            obs = table.reset(seed, start=start)
            if obs in waiting:
                out += [waiting.pop(obs), seed]
            else:
                waiting[obs] = seed
        return out
    finally:
        player.tables.release(table)


class SeedStream:
    """Training deals, drawn below 2**32 from the base seed: the same seed, the same deals, and
    a resumed run continues the stream where it stood (`get_state`)."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def take(self, n: int) -> list[int]:
        return [self._rng.randrange(2**32) for _ in range(n)]

    def get_state(self) -> Any:
        return self._rng.getstate()

    def set_state(self, state: Any) -> None:
        self._rng.setstate(state)


def group_seeds(seed: int, n: int) -> list[int]:
    """The first n training deals of a base seed."""
    return SeedStream(seed).take(n)


@dataclass
class DealResult:
    """What one deal came to: its groups, and the games played for them."""

    seed: int
    groups: list[GroupResult]
    episodes: int  # games played: each episode of a whole-episode group, the canonical game of step groups
    episodes_failed: int


@dataclass
class Tally:
    """What a runner played, counted one way for every job."""

    deals: int = 0
    groups_played: int = 0
    groups_dropped: dict[str, int] = field(default_factory=dict)
    sequences: int = 0  # in the groups kept
    episodes: int = 0
    episodes_failed: int = 0

    def add(self, deal: DealResult) -> None:
        self.deals += 1
        self.episodes += deal.episodes
        self.episodes_failed += deal.episodes_failed
        for result in deal.groups:
            self.groups_played += 1
            if result.group is None:
                reason = result.dropped or "?"
                self.groups_dropped[reason] = self.groups_dropped.get(reason, 0) + 1
            else:
                self.sequences += len(result.group.scores)

    def add_episodes(self, episodes: Iterable[Episode]) -> None:
        for ep in episodes:
            self.episodes += 1
            self.episodes_failed += ep.failed


class DealRunner:
    """Plays deals with one player, `concurrency` episodes (or answers) in flight at once;
    None: no limit (the trainer plays a step's deals together, so the torch policy batches them)."""

    def __init__(self, player: Player, config: GroupConfig, concurrency: int | None = None) -> None:
        self.player, self.config = player, config
        self.concurrency = concurrency
        self.limiter = asyncio.Semaphore(concurrency) if concurrency is not None else None
        self.tally = Tally()
        self.memo = CallMemo()  # rollout credit's continuation prompts, scored once per policy version
        # --rollout-refresh: the chart continuation's snapshot, and the steps it has served
        self.snapshot: dict[Observation, tuple[float, float]] | None = None
        self.snapshot_age = 0
        self.snapshot_scored = 0  # prompts scored for a snapshot taken in the last play_all

    async def deal(self, seed: int) -> DealResult:
        """The groups one deal yields: one whole-episode group, or one group per decision."""
        if self.config.group_by == "step":
            step = await play_step_groups(self.player, seed, self.config, self.limiter, self.memo)
            result = DealResult(seed, step.groups, 1, int(step.status == Status.FAILED))
        else:
            group = await play_group(self.player, seed, self.config, self.limiter)
            result = DealResult(seed, [group], len(group.episodes), sum(ep.failed for ep in group.episodes))
        self.tally.add(result)
        return result

    async def stream(self, seeds: list[int]) -> AsyncIterator[DealResult]:
        """The deals in seed order, with enough of them in flight to keep the limit busy."""
        window = max(1, (self.concurrency or 1) // self.config.sequences) + 1
        pending: list[asyncio.Task[DealResult]] = []
        next_seed = 0
        while next_seed < len(seeds) or pending:
            while next_seed < len(seeds) and len(pending) < window:
                pending.append(asyncio.create_task(self.deal(seeds[next_seed])))
                next_seed += 1
            yield await pending.pop(0)

    async def play_all(self, seeds: list[int]) -> list[DealResult]:
        """Every deal at once; results in seed order. The trainer calls it once a step, after
        the weights changed, so the continuation memo starts empty, or holds the snapshot while
        it lasts (`rollout_refresh` steps)."""
        self.memo, self.snapshot_scored = CallMemo(), 0
        if self.config.rollout_refresh > 1:
            if self.snapshot is None or self.snapshot_age >= self.config.rollout_refresh:
                taken = CallMemo()
                self.snapshot, self.snapshot_age = await chart_snapshot(self.player, taken), 0
                self.snapshot_scored = taken.scored
            self.memo = snapshot_memo(self.player, self.snapshot)
            self.snapshot_age += 1
        return list(await asyncio.gather(*(self.deal(s) for s in seeds)))

    @property
    def continuation_scored(self) -> int:
        """Prompts the rollout continuation had the policy score in the last `play_all`."""
        return self.memo.scored + self.snapshot_scored

    def get_snapshot(self) -> dict[str, Any] | None:
        """The continuation snapshot and its age, for a checkpoint: a resumed run continues with
        the same snapshot, since the weights it was scored with are gone."""
        if self.snapshot is None:
            return None
        return {"age": self.snapshot_age, "chart": [[*obs, *probs] for obs, probs in self.snapshot.items()]}

    def set_snapshot(self, state: dict[str, Any] | None) -> None:
        self.snapshot = None if state is None else {
            Observation(int(total), int(up), bool(soft)): (float(p_hit), float(p_stick))
            for total, up, soft, p_hit, p_stick in state["chart"]
        }
        self.snapshot_age = 0 if state is None else int(state["age"])

    async def evaluation(self, n: int, first: int = 0,
                         on_episode: Callable[[Episode], None] | None = None) -> list[Episode]:
        """The fixed evaluation deals first..first+n-1, one episode each; results in seed order.

        Only `concurrency` episodes exist as tasks at a time, each started as another ends: a task
        per deal up front costs time and memory in the number of deals before the first one plays."""
        seeds = eval_seeds(n, first)
        todo = iter(seeds)
        played: dict[int, Episode] = {}
        pending: set[asyncio.Task[tuple[int, Episode]]] = set()

        async def one(seed: int) -> tuple[int, Episode]:
            ep = await limited(self.limiter, lambda: self.player.episode(seed, 0))
            if on_episode is not None:
                on_episode(ep)
            return seed, ep

        try:
            while True:
                for seed in itertools.islice(todo, (self.concurrency or len(seeds)) - len(pending)):
                    pending.add(asyncio.create_task(one(seed)))
                if not pending:
                    break
                finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                played.update(task.result() for task in finished)
        finally:  # an episode that raised stops the others, rather than leave them playing
            for task in pending:
                task.cancel()
        episodes = [played[seed] for seed in seeds]
        self.tally.add_episodes(episodes)
        return episodes


async def run_evaluation(player: Player, episodes: int, concurrency: int = 64,
                         on_episode: Callable[[Episode], None] | None = None, first: int = 0) -> list[Episode]:
    """Play `episodes` fixed deals from deal `first` on, `concurrency` at a time; results in seed order."""
    return await DealRunner(player, GroupConfig(), concurrency).evaluation(episodes, first, on_episode)
