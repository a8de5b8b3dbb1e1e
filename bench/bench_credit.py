"""How much GRPO signal each credit scheme gives, per second of rollout.

Run: python bench/bench_credit.py [--deals 12] [--group-size 8] [--temperature 1.0]
     python bench/bench_credit.py --fidelity [--probes 400]     # credit against the exact A^pi

--fidelity scores each scheme's credit for the first decision of fixed deals against the
acting policy's exact advantage A^pi(h, a) (measure/fidelity.py), two independent draws per
decision, with the compute each spent (policy queries: sampled answers or probability readings
per decision) and its wall time:
  - exact: the solver's Q*(a) - V_p, as step-counterfactual credits it (no noise, but the
    advantage of the optimal continuation, not of the policy's);
  - rollouts K: the reward-only estimate of step-rollouts, K rollouts per action;
  - outcome GRPO G: whole episodes scored by the table's reward, G per deal, each decision
    credited with its episode's group-normalised score.
The policy is a soft optimal bot (P(optimal action) 0.75), whose exact probabilities are known,
so the truth and the rollouts' continuation cost no model; with a model each query is one
forward of a prompt's new tokens.

For whole-episode groups scored by `outcome` and by `expected` (the same rollouts,
both scores recorded) and for step groups (one group per decision, scored by Q*):
  - the share of groups whose scores are not all equal (a group of equal scores has
    zero advantage everywhere and teaches nothing; Atropos drops ~60% of its groups),
  - trainable tokens (masked-in positions of groups with signal) per second of rollout,
  - the mean score variance within a group.
It runs the embedded model (the real starting point of RL here) and, as a contrast,
an epsilon-greedy bot (optimal with probability 0.5, random otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from blackjack_rl.config import GroupConfig
from blackjack_rl.config import load_settings
from blackjack_rl.rollout.groups import play_group
from blackjack_rl.rollout.players import Player
from blackjack_rl.policies.bots import OptimalBot
from blackjack_rl.rollout.players import build_player
from blackjack_rl.rollout.runner import group_seeds
from blackjack_rl.rollout.stepgroups import play_step_groups
from blackjack_rl.contract.tokens import MASKED
from blackjack_rl.game.table import HIT, STICK


class EpsilonBot(OptimalBot):
    name = "epsilon-0.5"

    def choose(self, turn):
        if random.Random(turn.seed).random() < 0.5:
            return random.Random(turn.seed + 1).randrange(2)
        return super().choose(turn)


def _stats(groups: list[tuple[list[float], int]], seconds: float) -> str:
    if not groups:
        return "no groups"
    mixed = [(s, t) for s, t in groups if len(set(s)) > 1]
    variance = statistics.fmean(statistics.pvariance(s) for s, _ in groups)
    tokens = sum(t for _, t in mixed)
    return (f"{len(groups):4d} groups | non-identical scores {len(mixed) / len(groups):6.1%} | "
            f"trainable tokens/s {tokens / seconds:8.1f} | mean within-group variance {variance:.4f}")


def _trained(group) -> int:
    return sum(m != MASKED for masks in group["masks"] for m in masks)


def run(player: Player, label: str, deals: int, group_size: int) -> None:
    seeds = group_seeds(1234, deals)

    async def whole():
        return [await play_group(player, s, GroupConfig(group_size=group_size)) for s in seeds]

    t0 = time.perf_counter()
    results = asyncio.run(whole())
    seconds = time.perf_counter() - t0
    groups = [r for r in results if r.group is not None]
    for mode in ("outcome", "expected"):
        rows = [([ep.scores[mode] for ep in r.episodes], _trained(r.group)) for r in groups]
        print(f"[{label}] episode groups, {mode:8s}: {_stats(rows, seconds)}")

    async def steps():
        return [await play_step_groups(player, s, GroupConfig(credit="step", group_size=group_size)) for s in seeds]

    t0 = time.perf_counter()
    step_deals = asyncio.run(steps())
    seconds = time.perf_counter() - t0
    rows = [(r.group["scores"], _trained(r.group)) for d in step_deals for r in d.groups if r.group is not None]
    print(f"[{label}] step groups, Q*      : {_stats(rows, seconds)}")


class SoftBot(OptimalBot):
    """The optimal action with probability 0.75, the other with 0.25, as its `hit_probability` says."""

    name = "soft-optimal-0.75"

    def hit_probability(self, observation, natural: bool) -> float:
        return 0.75 if super().hit_probability(observation, natural) else 0.25

    def choose(self, turn):
        return HIT if random.Random(turn.seed).random() < self.hit_probability(turn.observation, turn.natural) else STICK


def _plot(rows, path: str) -> None:
    """Fidelity against compute: correlation and clear-sign agreement per scheme."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    families = {"exact": "o", "rollouts": "s", "outcome": "^"}
    for family, marker in families.items():
        mine = [r for r in rows if r[0].startswith(family)]
        xs = [r[1] for r in mine]
        axes[0].plot(xs, [r[3].correlation for r in mine], marker=marker, label=family)
        axes[1].plot(xs, [r[3].sign_clear for r in mine], marker=marker, label=family)
        for r in mine:
            axes[0].annotate(r[0].split(" (")[0].replace(family, "").strip(), (r[1], r[3].correlation), fontsize=7)
    for ax, title in zip(axes, ("correlation with A^pi", "sign agreement, |A^pi| >= 0.01")):
        ax.set_xscale("log")
        ax.set_xlabel("policy queries per decision")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Credit against the exact advantage (soft optimal bot, first decisions of 400 deals)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def fidelity(player: Player, probes: int, plot: str | None = None) -> None:
    from blackjack_rl.game.table import Table
    from blackjack_rl.measure.fidelity import CreditSample, exact_truths, score_samples, credit_samples
    from blackjack_rl.measure.probe import node_policy
    from blackjack_rl.rollout.estimates import CallMemo, estimate_q
    from blackjack_rl.rollout.episodes import opening_messages

    table = Table()
    seeds = group_seeds(77, probes)
    deals = []
    for seed in seeds:
        obs = table.reset(seed)
        deals.append((seed, obs, table.player_hand, table.player_is_natural))
    truths = asyncio.run(exact_truths(player.solution, node_policy(player), [(o,) for _, o, _, _ in deals],
                                      invalid_score=-1.0, max_turns=10, budget=200_000, target_width=0.0))
    rows = []

    def p_of(obs, natural):
        h = player.policy.hit_probability(obs, natural)
        return {HIT: h, STICK: 1.0 - h}

    def add(label, samples, queries, seconds):
        s = score_samples(samples, truths)
        rows.append((label, queries / probes, seconds, s))

    t0 = time.perf_counter()
    samples = []
    for seed, obs, _, natural in deals:
        q, p = player.solution.q_values(obs, natural), p_of(obs, natural)
        v = p[HIT] * q[1] + p[STICK] * q[0]
        for draw in (0, 1):
            samples += [CreditSample((obs,), a, (q[1] if a == HIT else q[0]) - v, draw) for a in (HIT, STICK)]
    add("exact Q* (step-counterfactual)", samples, probes, time.perf_counter() - t0)

    for k in (4, 16, 64):
        t0, queries, samples = time.perf_counter(), 0, []
        for seed, obs, hand, natural in deals:
            prompt = player.chat.prompt_ids(opening_messages(obs))
            p = p_of(obs, natural)
            for draw in (0, 1):
                est = asyncio.run(estimate_q(player, CallMemo(), prompt, hand, obs, seed + draw * 2**33, 0, k))
                queries += 1 + est.continuation_prompts
                v = p[HIT] * est.q_hit + p[STICK] * est.q_stick
                samples += [CreditSample((obs,), a, (est.q_hit if a == HIT else est.q_stick) - v, draw)
                            for a in (HIT, STICK)]
        add(f"rollouts K={k} (step-rollouts)", samples, queries, time.perf_counter() - t0)

    decode = player.chat.backend.decode
    for g in (8, 32):
        t0, queries, samples = time.perf_counter(), 0, []
        for seed, _, _, _ in deals:
            result = asyncio.run(play_group(player, seed, GroupConfig(group_size=g)))
            queries += sum(len(ep.decisions) for ep in result.episodes)
            if result.group is not None:
                samples += [s for s in credit_samples(result.group, table, decode) if len(s.history) == 1]
        add(f"outcome GRPO G={g} (episode)", samples, queries, time.perf_counter() - t0)

    if plot is not None:
        _plot(rows, plot)
    print(f"| scheme | queries per decision | seconds | sign, |A|-weighted | sign, |A| >= 0.01 | correlation "
          f"| bias | noise | decisions |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, q, sec, s in rows:
        print(f"| {label} | {q:.1f} | {sec:.1f} | {s.sign_weighted:.3f} | {s.sign_clear:.3f} | {s.correlation:.3f} "
              f"| {s.bias:+.4f} | {s.noise:.3f} | {s.decisions} |")


def continuation_bias(player: Player, probes: int, k: int) -> None:
    """The chart continuation's bias, measured: rollout credit with each continuation against the
    exact A^pi of the model that reads its history (first decisions of fixed deals)."""
    from blackjack_rl.game.table import Table
    from blackjack_rl.measure.fidelity import CreditSample, exact_truths, score_samples
    from blackjack_rl.measure.probe import node_policy
    from blackjack_rl.rollout.credit import call_probabilities
    from blackjack_rl.rollout.estimates import CallMemo, estimate_q
    from blackjack_rl.rollout.episodes import opening_messages
    from blackjack_rl.contract.protocol import tool_call_text

    table = Table()
    deals = []
    for seed in group_seeds(78, probes):
        obs = table.reset(seed)
        deals.append((seed, obs, table.player_hand))
    t0 = time.perf_counter()
    truths = asyncio.run(exact_truths(player.solution, node_policy(player), [(o,) for _, o, _ in deals],
                                      invalid_score=-1.0, max_turns=10, budget=256, target_width=0.01))
    print(f"truth: {len(truths)} histories, widest Q^pi(h, hit) interval "
          f"{max(t.q_hit_width for t in truths.values()):.4f}, {time.perf_counter() - t0:.0f}s")
    calls = [player.chat.answer_ids(tool_call_text(a)) for a in (HIT, STICK)]
    for continuation in ("history", "chart"):
        t0, memo, samples = time.perf_counter(), CallMemo(), []
        for seed, obs, hand in deals:
            prompt = player.chat.prompt_ids(opening_messages(obs))
            est = asyncio.run(estimate_q(player, memo, prompt, hand, obs, seed, 0, k, continuation))
            lp = asyncio.run(player.policy.answer_logprobs(prompt, calls))
            p = call_probabilities(sum(lp[0]), sum(lp[1]))
            v = p[HIT] * est.q_hit + p[STICK] * est.q_stick
            samples += [CreditSample((obs,), a, (est.q_hit if a == HIT else est.q_stick) - v) for a in (HIT, STICK)]
        s = score_samples(samples, truths)
        hit = [c.credit - truths[c.history].advantage(HIT) for c in samples if c.action == HIT]
        print(f"| {continuation} | {k} | {memo.scored} | {time.perf_counter() - t0:.0f} | {s.sign_clear:.3f} | "
              f"{s.correlation:.3f} | {s.bias:+.4f} | {statistics.fmean(hit):+.4f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fidelity", action="store_true", help="the fidelity table (see above) instead")
    ap.add_argument("--probes", type=int, default=400, help="--fidelity: fixed deals whose first decision is scored")
    ap.add_argument("--plot", metavar="PNG", help="--fidelity: also draw fidelity against compute")
    ap.add_argument("--continuation-bias", metavar="LORA", help="the chart continuation's bias for the embedded "
                                                                 "model with this adapter (e.g. three-phase)")
    ap.add_argument("--k", type=int, default=32, help="--continuation-bias: rollouts per action")
    ap.add_argument("--deals", type=int, default=12)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--bot-deals", type=int, default=2000)
    args = ap.parse_args()
    if args.continuation_bias:
        player = build_player(load_settings(overrides={"policy": {"lora": args.continuation_bias, "max_tokens": 40,
                                                                  "temperature": args.temperature}}))
        print("| continuation | K | prompts scored | seconds | sign, |A| >= 0.01 | correlation | bias | bias of hit |")
        print("|---|---|---|---|---|---|---|---|")
        continuation_bias(player, args.probes, args.k)
        return
    bot_player = build_player(load_settings(overrides={"policy": {"kind": "optimal"}}))
    if args.fidelity:
        bot_player.policy = SoftBot(bot_player.solution)
        fidelity(bot_player, args.probes, args.plot)
        return
    bot_player.policy = EpsilonBot(bot_player.solution)
    run(bot_player, "epsilon bot", args.bot_deals, args.group_size)
    embedded = build_player(load_settings(overrides={"policy": {"temperature": args.temperature}}))
    run(embedded, f"embedded T={args.temperature}", args.deals, args.group_size)


if __name__ == "__main__":
    main()
