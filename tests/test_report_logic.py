"""The report's pure parts: per-state statistics, the episode sample, decoding modes, the viewer's files."""

import json
import re

import pytest

from blackjack_rl.report.dataset import DatasetView, common_prefix, group_summary, trained_spans
from blackjack_rl.report.episodes import category, invalid_examples, sample
from blackjack_rl.report.modes import decoding_mode
from blackjack_rl.report.strategy import chart, costliest, state_stats


def _decision(s, d, ace, action, optimal, regret=0.0, text=""):
    return {"state": [s, d, ace], "natural": False, "action": action, "optimal": optimal,
            "regret": None if action is None else regret, "parse_error": None if action else "no call", "text": text}


def _row(seed, status="finished", outcome="loss", decisions=(), reason=None):
    return {"seed": seed, "status": status, "outcome": outcome if status == "finished" else None,
            "invalid_reason": reason, "score": -1.0, "decisions": list(decisions), "messages": []}


def test_the_chart_has_one_cell_per_state(solution):
    stats, episodes = state_stats([])
    hard, soft = chart(stats, solution, episodes, soft=False), chart(stats, solution, episodes, soft=True)
    assert [row[0].player_sum for row in hard] == list(range(21, 3, -1))
    assert [row[0].player_sum for row in soft] == list(range(21, 11, -1))
    assert all(len(row) == 10 and [c.dealer for c in row] == list(range(1, 11)) for row in hard + soft)
    keys = {c.key for row in hard + soft for c in row}
    assert len(keys) == 18 * 10 + 10 * 10
    assert hard[5][9].key == "hard-16-10" and hard[5][9].optimal == "hit"
    assert hard[8][1].key == "hard-13-2" and hard[8][1].optimal == "stick"


def test_state_statistics_count_hits_invalid_answers_and_regret(solution):
    regret = solution.regret((16, 10, False), 0)
    rows = [
        _row(1, decisions=[_decision(16, 10, 0, "stick", "hit", regret)]),
        _row(2, decisions=[_decision(16, 10, 0, "hit", "hit"), _decision(20, 10, 0, "stick", "stick")]),
        _row(3, status="invalid", reason="no_call", decisions=[_decision(16, 10, 0, None, "hit")]),
        _row(4, status="failed", decisions=[_decision(16, 10, 0, "stick", "hit", regret)]),  # never counted
    ]
    stats, episodes = state_stats(rows)
    assert episodes == 3
    st = stats[(16, 10, False)]
    assert (st.decisions, st.hits, st.sticks, st.invalid, st.correct) == (3, 1, 1, 1, 1)
    assert st.hit_rate == 0.5 and st.accuracy == pytest.approx(1 / 3)
    cell = next(c for row in chart(stats, solution, episodes, soft=False) for c in row if c.key == "hard-16-10")
    assert cell.disagrees  # a 50/50 split is not the optimal strategy
    assert cell.cost_per_hand == pytest.approx(regret / 3)
    assert cell.invalid_rate == pytest.approx(1 / 3)
    assert costliest([cell])[0] is cell


def test_the_episode_sample_keeps_every_kind_and_its_bound():
    rows = [_row(i, decisions=[_decision(12, 2, 0, "stick", "hit", 0.1)]) for i in range(500)]
    rows += [_row(1000 + i, status="invalid", reason="bad_json", decisions=[_decision(12, 2, 0, None, "hit")])
             for i in range(3)]
    rows += [_row(2000 + i, decisions=[_decision(20, 2, 0, "stick", "stick")]) for i in range(500)]
    chosen = sample(rows, limit=60)
    assert len(chosen) == 60
    kinds = [category(r) for r in chosen]
    assert kinds.count("invalid:bad_json") == 3 and kinds.count("mistake") > 20 and kinds.count("optimal") > 20
    assert [r["seed"] for r in chosen] == sorted(r["seed"] for r in chosen)
    examples = invalid_examples(rows)
    assert list(examples) == ["bad_json"] and len(examples["bad_json"]) == 3


def test_the_page_says_which_decoding_mode_produced_it():
    assert decoding_mode({"policy": "embedded", "constrained": True})["kind"] == "constrained"
    assert "valid call" in decoding_mode({"policy": "embedded", "constrained": True})["text"]
    assert decoding_mode({"policy": "embedded", "constrained": False})["kind"] == "unconstrained"
    server = decoding_mode({"policy": "openai", "constrained": True, "structured_output": "json_schema"})
    assert server["kind"] == "constrained" and "json_schema" in server["text"]
    assert decoding_mode({"policy": "openai", "constrained": False, "structured_output": None})["kind"] == "unconstrained"
    assert decoding_mode({"policy": "threshold-17"})["kind"] == "scripted"
    assert decoding_mode({"policy": "hf", "model": "a/b"})["kind"] == "unconstrained"  # any model that samples


def test_token_packing_helpers():
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([5, 6], [5, 6]) == 2
    assert trained_spans([-100, -100, 7, 8, -100, 9]) == [[2, 4], [5, 6]]
    assert trained_spans([]) == []
    group = {"tokens": [[1, 2], [1, 2, 3]], "scores": [1.0, -1.0],
             "episodes": [{"seed": 42, "invalid_reason": None}, {"seed": 42, "invalid_reason": "no_call"}]}
    assert group_summary(group) == [42, [1.0, -1.0], "no_call", 2, 3]


def _group(seed, prompt_len=50):
    prompt = list(range(prompt_len))
    seqs = [prompt + [1000 + seed, 7, 8], prompt + [1000 + seed, 9]]
    return {
        "tokens": seqs,
        "masks": [[-100] * (prompt_len + 1) + s[prompt_len + 1:] for s in seqs],
        "inference_logprobs": [[1.0] * (prompt_len + 1) + [-0.5] * (len(s) - prompt_len - 1) for s in seqs],
        "scores": [1.0, -1.0],
        "messages": [[{"role": "system", "content": "rules"}, {"role": "user", "content": f"deal {seed}"}]] * 2,
        "generation_params": {"policy": "test"},
        "episodes": [{"seed": seed, "status": "finished", "outcome": "win"},
                     {"seed": seed, "status": "invalid", "invalid_reason": "bad_json"}],
    }


def _payload(path):
    text = path.read_text(encoding="utf-8")
    return json.loads(re.match(r"^VIEW\.\w+\((?:\d+,)?(.*)\);\n$", text, re.S).group(1))


def test_the_viewer_is_written_chunk_by_chunk(tmp_path):
    now = [0.0]
    view = DatasetView(tmp_path / "groups.html", None, chunk_groups=3, flush_seconds=10, clock=lambda: now[0])
    data = tmp_path / "groups-view"
    assert _payload(data / "manifest.js")["groups"] == 0 and (tmp_path / "groups.html").is_file()
    for seed in range(4):
        view.add(_group(seed))
    # one full chunk on disk, the second still filling and not yet flushed
    assert sorted(p.name for p in data.iterdir()) == ["chunk-0000.js", "index-0000.js", "manifest.js"]
    first = (data / "chunk-0000.js").stat().st_mtime_ns
    now[0] = 11.0
    view.add(_group(4))  # flushes the unfinished chunk after flush_seconds
    manifest = _payload(data / "manifest.js")
    assert manifest["groups"] == 5 and manifest["chunks"] == 2 and not manifest["complete"]
    view.close()
    manifest = _payload(data / "manifest.js")
    assert manifest["complete"] and manifest["reasons"] == ["bad_json"]
    assert (data / "chunk-0000.js").stat().st_mtime_ns == first  # a finished chunk is never rewritten
    chunk = _payload(data / "chunk-0001.js")
    assert [g["i"] for g in chunk["groups"]] == [3, 4]
    assert chunk["base"][:51] == list(range(50)) + [1003]
    seq = chunk["groups"][1]["seqs"][0]
    assert seq["lcp"] == 50 and seq["rest"] == [1004, 7, 8]  # the shared prompt is stored once per chunk
    assert seq["spans"] == [[51, 53]] and seq["lp"] == [-0.5, -0.5]
    assert chunk["systems"] == ["rules"] and seq["msgs"][0] == ["system", 0]
    assert _payload(data / "index-0001.js") == [[3, [1.0, -1.0], "bad_json", 2, 53], [4, [1.0, -1.0], "bad_json", 2, 53]]
    with pytest.raises(RuntimeError, match="closed"):
        view.add(_group(5))


def test_a_new_run_replaces_the_previous_viewer_data(tmp_path):
    with DatasetView(tmp_path / "groups.html", chunk_groups=1) as view:
        for seed in range(3):
            view.add(_group(seed))
    with DatasetView(tmp_path / "groups.html", chunk_groups=1) as view:
        view.add(_group(9))
    assert sorted(p.name for p in (tmp_path / "groups-view").iterdir()) == ["chunk-0000.js", "index-0000.js", "manifest.js"]


def test_figures_are_plain_inline_svg():
    from blackjack_rl.report.plots import nice_ticks, outcome_bars, paired_forest, reward_vs_baselines

    assert nice_ticks(-0.45, 0.05) == [-0.4, -0.3, -0.2, -0.1, 0.0]
    assert nice_ticks(0.0, 1.0, target=5) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    svg = reward_vs_baselines(-0.05, -0.08, -0.02, {"optimal": -0.0466, "random": -0.3959}, "m <&> n")
    assert svg.startswith("<svg") and svg.endswith("</svg>") and "m &lt;&amp;&gt; n" in svg and "-0.00<" not in svg
    bars = outcome_bars([("a", {"win": 0.5, "loss": 0.5}), ("b", {"win": 0.4, "draw": 0.1, "loss": 0.5})])
    assert bars.count("<rect") == 4 + 5  # the legend, then one rectangle per non-empty share
    forest = paired_forest([{"label": "b − a", "mean": -0.03, "low": -0.05, "high": -0.01, "significant": True,
                             "good": False}])
    assert "#c62828" in forest and "href" not in forest  # nothing fetched from anywhere
