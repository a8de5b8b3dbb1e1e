"""The comparison page (`blackjack-rl compare`): runs side by side, differences paired by seed."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any, Sequence

from blackjack_rl.outputs import prepare_folder, write_text
from blackjack_rl.measure.compare import QUANTITIES, Comparison, Run, verdict
from blackjack_rl.report import plots
from blackjack_rl.report.modes import decoding_mode, policy_name

HEADLINE = ("outcome", "expected")  # the quantities the verdicts and the plot are about


def comparison_json(runs: Sequence[Run], comparisons: Sequence[Comparison]) -> dict[str, Any]:
    return {
        "runs": [{"name": r.name, "policy": r.metrics.policy, "episodes": r.metrics.episodes,
                  "mean_reward": r.metrics.mean_reward.to_json()} for r in runs],
        "baseline": runs[0].name,
        "comparisons": [c.to_dict() for c in comparisons],
    }


def _forest_items(comparisons: Sequence[Comparison]) -> list[dict[str, Any]]:
    items = []
    quantities = {q.key: q for q in QUANTITIES}
    for c in comparisons:
        for key in HEADLINE:
            p = c.differences.get(key)
            if p is None or p.mean is None or p.ci95_low is None:
                continue
            q = quantities[key]
            items.append({"label": f"{c.b} − {c.a}: {q.short}",
                          "mean": p.mean, "low": p.ci95_low, "high": p.ci95_high, "significant": p.significant,
                          "good": p.significant and (p.mean > 0) == q.higher_is_better})
    return items


def comparison_context(runs: Sequence[Run], comparisons: Sequence[Comparison]) -> dict[str, Any]:
    rows = []
    for r in runs:
        params = r.metrics.policy
        rows.append({"name": r.name, "m": r.metrics, "mode": decoding_mode(params),
                     "policy": policy_name(params)})
    blocks = []
    for c in comparisons:
        diffs = []
        for q in QUANTITIES:
            p = c.differences.get(q.key)
            if p is None:
                continue
            diffs.append({"q": q, "p": p, "better": p.significant and (p.mean > 0) == q.higher_is_better,
                          "worse": p.significant and (p.mean > 0) != q.higher_is_better})
        verdicts = [verdict(c.differences[q.key], q, c.a, c.b) for q in QUANTITIES
                    if q.key in HEADLINE and q.key in c.differences]
        blocks.append({"c": c, "diffs": diffs, "verdicts": verdicts})
    items = _forest_items(comparisons)
    return {
        "title": "Comparison: " + " vs ".join(r.name for r in runs),
        "runs": rows,
        "blocks": blocks,
        "forest_svg": plots.paired_forest(items) if items else "",
        "generated": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "baseline": runs[0].name,
    }


def render_comparison(runs: Sequence[Run], comparisons: Sequence[Comparison]) -> str:
    from blackjack_rl.report.html import environment

    return environment().get_template("compare.html.jinja").render(**comparison_context(runs, comparisons))


def write_comparison(out: Path, runs: Sequence[Run], comparisons: Sequence[Comparison]) -> tuple[Path, Path]:
    out = prepare_folder(out, "compare.json")
    html, data = out / "compare.html", out / "compare.json"
    write_text(html, render_comparison(runs, comparisons))
    write_text(data, json.dumps(comparison_json(runs, comparisons), indent=2, allow_nan=False) + "\n")  # last
    return html, data
