"""Console tables: what `solve`, `evaluate` and `process` print for a person."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table as RichTable

from blackjack_rl.contract.records import MeanCI, Metrics, RateCI
from blackjack_rl.game.solver import DEALER_CARDS, HIT, Solution, baselines


def _dealer_label(d: int) -> str:
    return "A" if d == 1 else str(d)


def print_solution(solution: Solution, console: Console) -> None:
    refs = baselines(solution.rules)
    console.print(f"[bold]{solution.rules.describe()}[/bold]: exact optimal play (infinite deck)")
    t = RichTable(title="Expected return per hand", show_lines=False)
    for col in ("policy", "expected return", "win", "draw", "loss"):
        t.add_column(col, justify="right" if col != "policy" else "left")
    for name, o in refs.items():
        t.add_row(name.replace("_", " "), f"{o.value:+.5f}", f"{o.win:.2%}", f"{o.draw:.2%}", f"{o.loss:.2%}")
    console.print(t)
    for soft in (False, True):
        chart = RichTable(title=f"Optimal action, {'soft' if soft else 'hard'} hands (H = hit, S = stick)")
        chart.add_column("sum \\ dealer", justify="right")
        for d in DEALER_CARDS:
            chart.add_column(_dealer_label(d), justify="center")
        for s, row in solution.chart(soft).items():
            chart.add_row(str(s), *("[red]H[/red]" if row[d] == HIT else "[green]S[/green]" for d in DEALER_CARDS))
        console.print(chart)


def solution_json(solution: Solution) -> dict[str, Any]:
    refs = baselines(solution.rules)
    return {
        "rules": solution.rules.model_dump(),
        "expected_return": solution.value,
        "win": solution.start.win,
        "draw": solution.start.draw,
        "loss": solution.start.loss,
        "baselines": {k: {"value": o.value, "win": o.win, "draw": o.draw, "loss": o.loss} for k, o in refs.items()},
        "chart": {
            kind: {str(s): {_dealer_label(d): ("hit" if a == HIT else "stick") for d, a in row.items()}
                   for s, row in solution.chart(kind == "soft").items()}
            for kind in ("hard", "soft")
        },
        "q": [
            {"player_sum": s, "dealer_card": d, "usable_ace": u, "natural": n, "stick": qs, "hit": qh}
            for (s, d, u, n), (qs, qh) in sorted(solution.q.items())
        ],
    }


def _pct(r: RateCI) -> str:
    if r.rate is None:
        return "-"
    return f"{r.rate:.1%}  [{r.ci95_low:.1%}, {r.ci95_high:.1%}]"


def _mean(r: MeanCI, fmt: str = "+.4f") -> str:
    """A mean with its interval, or with "too few" where there are too few values for one."""
    if r.mean is None:
        return "-"
    if r.ci95_low is None:
        return f"{r.mean:{fmt}}  (too few for a CI: {r.n})"
    return f"{r.mean:{fmt}}  [{r.ci95_low:{fmt}}, {r.ci95_high:{fmt}}]"


def print_metrics(m: Metrics, console: Console) -> None:
    from blackjack_rl.report.modes import policy_name

    policy = m.policy
    name = policy_name(policy)
    mode = ""
    if policy.get("constrained"):
        server_mode = policy.get("structured_output")
        mode = f" (constrained: {server_mode})" if server_mode else " (constrained)"
    t = RichTable(title=f"Evaluation of {name}{mode}: {m.episodes} fixed deals")
    t.add_column("metric")
    t.add_column("value (95% CI)", justify="right")
    mr = m.mean_reward
    t.add_row("episodes played / failed", f"{m.episodes_played} / {m.episodes_failed}")
    if mr.mean is not None:
        t.add_row("mean reward (invalid = %+.1f)" % m.invalid_score, _mean(mr))
    if m.mean_expected_score.mean is not None:
        t.add_row("expected score (V* - regret)", _mean(m.mean_expected_score))
    t.add_row("win", _pct(m.win))
    t.add_row("draw", _pct(m.draw))
    t.add_row("loss", _pct(m.loss))
    t.add_row("invalid answer", _pct(m.invalid))
    for reason, v in m.invalid_by_reason.items():
        t.add_row(f"  {reason}", f"{v.count} ({v.rate:.1%})")
    t.add_row("decisions (valid)", f"{m.decisions} ({m.valid_decisions})")
    t.add_row("decision accuracy vs optimal", _pct(m.decision_accuracy))
    if m.mean_regret.mean is not None:
        t.add_row("mean regret per valid decision", _mean(m.mean_regret, ".4f"))
    console.print(t)
    ref = m.reference
    console.print(
        f"For reference, same rules: optimal play {ref['optimal'].value:+.4f} (win {ref['optimal'].win:.1%}), "
        f"always stick {ref['always_stick'].value:+.4f}, uniform random {ref['random'].value:+.4f}."
    )
    if m.grid:
        _print_grid(m.grid, console)
    if m.episodes_failed:
        console.print(f"[red]{m.episodes_failed} episodes failed (no answer from the model): "
                      f"{m.failure_examples[:1]}[/red]")


def _print_grid(grid: Mapping[str, Any], console: Console) -> None:
    """`evaluate --grid`: the exact numbers, beside the sampled ones above."""
    console.print(f"Exact, no sampling: first-decision chart {grid['value']:+.4f} "
                  f"(accuracy {100 * grid['accuracy']:.1f}% by visits, P(hit) among the two calls)", highlight=False)
    if grid.get("by_gap"):
        console.print(gap_line(grid["by_gap"]), highlight=False)
    if grid.get("whole_game"):
        console.print(escape(game_line(grid["whole_game"])), highlight=False)


def gap_line(bands: Sequence[Mapping[str, Any]]) -> str:
    """The chart's accuracy and regret by the cost of a wrong call (measure/grid.py's bands), one line."""
    parts = []
    for b in bands:
        where = f"{b['low']:g}-{b['high']:g}" if b["high"] is not None else f">= {b['low']:g}"
        right = "not visited" if b["accuracy"] is None else f"{100 * b['accuracy']:.1f}% right"
        parts.append(f"{where}: {right}, regret {b['regret']:.4f}")
    return "by the cost of a wrong call |Q*(hit) - Q*(stick)|: " + "; ".join(parts)


def game_line(game: Mapping[str, Any]) -> str:
    """The whole-game numbers (measure/tree.py) in one line, for the console (`grid`, `evaluate --grid`)."""
    where = "" if game["complete"] else f", {100 * game['explored_mass']:.2f}% of deals"
    line = (f"whole game (every decision, with its history): {game['value']:+.4f} certified in "
            f"[{game['value_low']:+.4f}, {game['value_high']:+.4f}] (width {game['width']:.4f}, "
            f"{game['nodes']:,} histories{where}, {game['seconds']:.1f}s)")
    if game.get("after_hit_accuracy") is not None:
        line += f"; after a hit {100 * game['after_hit_accuracy']:.1f}% right"
        if not game["complete"] and game.get("after_hit_accuracy_low") is not None:
            line += (f" of those read (all of them: {100 * game['after_hit_accuracy_low']:.1f}-"
                     f"{100 * game['after_hit_accuracy_high']:.1f}%)")
        line += f", always sticking there {100 * game['stick_after_hit_accuracy']:.1f}%"
    return line


def print_comparison(runs: list[Any], comparisons: list[Any], console: Console) -> None:
    """Runs side by side, then every run against the first, paired by seed."""
    from rich.markup import escape

    from blackjack_rl.measure.compare import QUANTITIES, verdict
    from blackjack_rl.report.comparison import HEADLINE
    from blackjack_rl.report.modes import policy_name, short_mode

    t = RichTable(title="Evaluation runs")
    for col in ("run", "policy", "decoding", "deals", "mean reward (95% CI)", "win", "invalid", "accuracy"):
        t.add_column(col, justify="left" if col in ("run", "policy", "decoding") else "right")
    for r in runs:
        m = r.metrics
        t.add_row(r.name, escape(policy_name(m.policy)), short_mode(m.policy), str(m.episodes), _mean(m.mean_reward),
                  _pct(m.win).split()[0], _pct(m.invalid).split()[0], _pct(m.decision_accuracy).split()[0])
    console.print(t)
    quantities = {q.key: q for q in QUANTITIES}
    for c in comparisons:
        t = RichTable(title=f"{c.b} − {c.a}, paired over {c.pairs} shared deals")
        for col in ("quantity", "B − A", "95% CI", "B higher / A higher / equal", ""):
            t.add_column(col, justify="left" if col in ("quantity", "") else "right")
        for key, p in c.differences.items():
            q = quantities[key]
            if p.ci95_low is None:
                diff, ci = f"{p.mean * 100:+.2f} pts" if q.percent else f"{p.mean:+.4f}", "too few pairs"
            elif q.percent:
                diff, ci = f"{p.mean * 100:+.2f} pts", f"[{p.ci95_low * 100:+.2f}, {p.ci95_high * 100:+.2f}]"
            else:
                diff, ci = f"{p.mean:+.4f}", f"[{p.ci95_low:+.4f}, {p.ci95_high:+.4f}]"
            good = p.significant and (p.mean > 0) == q.higher_is_better
            mark = ("[green]B better[/green]" if good else "[red]B worse[/red]" if p.significant
                    else "same" if p.ties == p.n else "too few" if p.ci95_low is None else "luck")
            t.add_row(q.short or q.label, diff, ci, f"{p.b_better} / {p.a_better} / {p.ties}", mark)
        console.print(t)
        for key in HEADLINE:
            if key in c.differences:
                console.print(verdict(c.differences[key], quantities[key], c.a, c.b))
        for note in c.notes:
            console.print(f"[dim]{escape(note)}[/dim]")
        if c.only_a or c.only_b or c.failed:
            console.print(f"[yellow]left out: {c.only_a} deals only in {c.a}, {c.only_b} only in {c.b}, "
                          f"{c.failed} with a failed episode[/yellow]")


def print_fidelity(run: Any, console: Console) -> None:
    """The fidelity scores of a groups file (jobs/fidelity.py), a row per set of decisions."""
    table = RichTable(title=f"Credit against the exact advantage A^pi ({run.groups} groups, {run.histories} histories)")
    for name in ("decisions", "sign, |A|-wtd", "sign, |A|>=.01", "corr", "bias", "noise (pairs)"):
        table.add_column(name, justify="right")

    def fmt(x: float | None, f: str = ".3f") -> str:
        return "-" if x is None else format(x, f)

    for name, s in run.scores.items():
        table.add_row(f"{name}: {s.decisions}", fmt(s.sign_weighted), f"{fmt(s.sign_clear)} of {s.clear_decisions}",
                      fmt(s.correlation), fmt(s.bias, "+.4f"), f"{fmt(s.noise)} ({s.noise_pairs})")
    console.print(table)
    console.print(f"Q^pi(h, hit) certified within {run.max_width:.4f}; {run.seconds:.1f}s. "
                  f"Scores in [bold]{escape(str(run.out_file))}[/bold]")
