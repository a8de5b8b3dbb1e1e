"""`fidelity`: score the credit a groups file carries against the policy's exact advantages.

Any trainer's or environment's groups in the Atropos wire format can be read, provided they
carry our records (deal seeds and decision states): the credit each action got is read as the
trainer would apply it (measure/fidelity.py), and A^pi is computed with the policy named on the
command line, which should be the one that sampled the groups.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blackjack_rl.contract.records import ScoredDataGroup, sequence_records
from blackjack_rl.measure.fidelity import CreditSample, FidelityScores, credit_samples, exact_truths, score_samples
from blackjack_rl.measure.probe import node_policy
from blackjack_rl.outputs import prepare_folder, write_text
from blackjack_rl.policies.base import KnowsItsPolicy
from blackjack_rl.rollout.players import Player

MAX_LINE_BYTES = 64 * 2**20  # one group a line; a longer line is not a group we wrote
FIDELITY_BUDGET = 1_000  # histories below each probed one that Q^pi(h, hit)'s tree may read
# A trainer's periodic probe reads the model at every history of each tree, each a new prompt
# in torch (costs in docs/training/README.md): a small tree, its certified width logged beside the scores
PROBE_BUDGET, PROBE_WIDTH = 16, 0.02


@dataclass
class FidelityRun:
    scores: dict[str, FidelityScores]  # "all", "first" (first decisions), "after_hit"
    groups: int
    histories: int
    max_width: float  # the widest certified interval of a Q^pi(h, hit) used
    seconds: float
    out_file: Path


def samples_of(groups: list[ScoredDataGroup], player: Player, scale: bool) -> list[CreditSample]:
    """The credit samples of groups in memory (a trainer's batch or probe)."""
    table = player.tables.acquire()
    try:
        return [s for g in groups for s in credit_samples(g, table, player.chat.backend.decode, scale)]
    finally:
        player.tables.release(table)


def read_samples(path: Path, player: Player, max_decisions: int, scale: bool) -> tuple[list[CreditSample], int]:
    """The credit samples of the file's groups, up to `max_decisions`."""
    samples: list[CreditSample] = []
    groups = 0
    table = player.tables.acquire()
    try:
        with path.open("rb") as f:
            # readline with a limit: a line is never read whole past the bound
            for number, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
                if len(line) > MAX_LINE_BYTES:
                    raise ValueError(f"{path}:{number}: a line of over {MAX_LINE_BYTES >> 20} MiB is not a group")
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                    group = ScoredDataGroup.model_validate({**data, "episodes": sequence_records(data) or []})
                except ValueError as exc:
                    raise ValueError(f"{path}:{number}: not a group: {str(exc).splitlines()[0]}") from None
                samples += credit_samples(group, table, player.chat.backend.decode, scale)
                groups += 1
                if len(samples) >= max_decisions:
                    return samples[:max_decisions], groups
    finally:
        player.tables.release(table)
    if not samples:
        raise ValueError(f"{path}: no valid decision to score (an empty file, or only invalid answers)")
    return samples, groups


@dataclass
class Fidelity:
    """A set of credit samples scored against A^pi of one policy."""

    scores: dict[str, FidelityScores]  # "all", "first" (first decisions), "after_hit"
    histories: int
    max_width: float  # the widest certified interval of a Q^pi(h, hit) used

    def to_dict(self) -> dict[str, Any]:
        return {"histories": self.histories, "max_q_hit_width": self.max_width,
                "scores": {k: v.to_dict() for k, v in self.scores.items()}}


async def exact_fidelity(samples: list[CreditSample], player: Player, *, budget: int = FIDELITY_BUDGET,
                         target_width: float = 0.002) -> Fidelity:
    """Each sample against A^pi of `player`'s policy at its history, all of them and by turn."""
    settings = player.settings
    if isinstance(player.policy, KnowsItsPolicy):  # a bot's probabilities cost nothing: cover its trees
        target_width = 0.0
    truths = await exact_truths(player.solution, node_policy(player), [s.history for s in samples],
                                invalid_score=settings.invalid_score, max_turns=settings.max_turns, budget=budget,
                                target_width=target_width)
    scores = {
        "all": score_samples(samples, truths),
        "first": score_samples([s for s in samples if len(s.history) == 1], truths),
        "after_hit": score_samples([s for s in samples if len(s.history) > 1], truths),
    }
    return Fidelity(scores, len(truths), max((t.q_hit_width for t in truths.values()), default=0.0))


async def run_fidelity(path: Path, player: Player, out: Path, *, max_decisions: int = 2_000,
                       budget: int = FIDELITY_BUDGET, target_width: float = 0.002, scale: bool = True) -> FidelityRun:
    prepare_folder(out, "fidelity.json")  # before minutes of scoring
    t0 = time.perf_counter()
    samples, groups = read_samples(path, player, max_decisions, scale)
    fidelity = await exact_fidelity(samples, player, budget=budget, target_width=target_width)
    run = FidelityRun(fidelity.scores, groups, fidelity.histories, fidelity.max_width, time.perf_counter() - t0,
                      out / "fidelity.json")
    doc: dict[str, Any] = {
        "groups_file": str(path), "policy": player.policy.generation_params(), "groups": groups,
        "budget": budget, "seconds": run.seconds, **fidelity.to_dict(),
    }
    write_text(run.out_file, json.dumps(doc, indent=2) + "\n")
    return run
