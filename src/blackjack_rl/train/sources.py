"""Where a step's groups come from.

`LocalSource` plays them with the environment's own group code and the policy being trained,
so every sample is on-policy. `ApiSource` registers with the trajectory API as an Atropos
trainer and pulls batches that `blackjack-rl serve` workers posted: the three-process layout
of a cluster. There the answers were sampled by whatever model the workers run (by default
the embedded GGUF, which does not load the trainer's new weights), so that training is
off-policy; the clipped ratio against the batch's `inference_logprobs` is what keeps it sane.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from blackjack_rl.api.client import TrainerClient
from blackjack_rl.api.models import Registration
from blackjack_rl.config import GroupConfig
from blackjack_rl.contract.records import ScoredDataGroup
from blackjack_rl.rollout.players import Player
from blackjack_rl.rollout.runner import DealRunner, SeedStream, Tally
from blackjack_rl.train.groups import read_group


class GroupSource(Protocol):
    def next_groups(self) -> tuple[list[ScoredDataGroup], dict[str, Any]]:
        """The groups of one step, and facts about how they were obtained."""
        ...

    def get_state(self) -> Any:
        """Where the source stands, for a checkpoint (None: nothing of its own to restore)."""
        ...

    def set_state(self, state: Any) -> None: ...

    def close(self) -> None: ...


class LocalSource:
    def __init__(self, player: Player, groups: GroupConfig, deals_per_step: int, seed: int) -> None:
        # no concurrency limit: a step's deals are played together, so the torch policy batches them
        self.runner = DealRunner(player, groups)
        self.deals_per_step = deals_per_step
        self.seeds = SeedStream(seed)

    def next_groups(self) -> tuple[list[ScoredDataGroup], dict[str, Any]]:
        deals = asyncio.run(self.runner.play_all(self.seeds.take(self.deals_per_step)))
        step = Tally()
        for deal in deals:
            step.add(deal)
        info: dict[str, Any] = {
            "deals": step.deals,
            "dropped": step.groups_dropped,
            "episodes_failed": step.episodes_failed,
        }
        if self.runner.config.credit == "step-rollouts":  # the credit's own forward passes
            info["continuation_scored"] = self.runner.continuation_scored
        return [r.group for d in deals for r in d.groups if r.group is not None], info

    def probe(self, seeds: list[int]) -> list[ScoredDataGroup]:
        """The groups the last step's credit gives at other deals: the same weights, the same
        continuation snapshot, played by a runner of its own so the step's deal stream and
        state stay as they were (a fidelity probe)."""
        runner = DealRunner(self.runner.player, self.runner.config)
        snapshot = self.runner.get_snapshot()
        runner.set_snapshot(None if snapshot is None else {**snapshot, "age": 0})  # the step's, not a new one
        deals = asyncio.run(runner.play_all(seeds))
        return [r.group for d in deals for r in d.groups if r.group is not None]

    def get_state(self) -> Any:
        """Where the deal stream stands, so a resumed run plays the deals it would have played,
        and the rollout continuation's snapshot, which it continues with."""
        return {"seeds": self.seeds.get_state(), "snapshot": self.runner.get_snapshot()}

    def set_state(self, state: Any) -> None:
        if isinstance(state, dict):
            self.seeds.set_state(state["seeds"])
            self.runner.set_snapshot(state["snapshot"])
        else:  # a checkpoint written before snapshots: the deal stream's state alone
            self.seeds.set_state(state)

    def close(self) -> None:
        pass


class ApiSource:
    def __init__(
        self,
        url: str,
        *,
        token: str | None,
        batch_size: int,
        max_token_len: int,
        steps: int,
        checkpoint_dir: str,
        save_every: int,
        timeout_s: float,
    ) -> None:
        self.client = TrainerClient(url, token=token)
        self.timeout_s = timeout_s
        self.client.register(
            Registration(
                batch_size=batch_size,
                max_token_len=max_token_len,
                checkpoint_dir=checkpoint_dir,
                save_checkpoint_interval=save_every or -1,
                starting_step=0,
                num_steps=steps,
            )
        )

    def next_groups(self) -> tuple[list[ScoredDataGroup], dict[str, Any]]:
        try:
            batch = self.client.wait_for_batch(self.timeout_s, poll_s=0.5)
        except TimeoutError as exc:
            raise TimeoutError(
                f"{exc}: is a `blackjack-rl serve` worker feeding the API? (raise --batch-timeout to wait longer)"
            ) from None
        return [read_group(g) for g in batch.groups], {"batch_id": batch.batch_id, "api_step": batch.step,
                                                        "redelivered": batch.redelivered}

    def get_state(self) -> None:
        """None: which batch comes next is the API's to say (it redelivers what was not acknowledged)."""
        return None

    def set_state(self, state: Any) -> None:
        pass

    def close(self) -> None:
        self.client.close()
