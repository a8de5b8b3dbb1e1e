"""The report's pure parts: per-state statistics, the episode sample, decoding modes, the viewer's files."""

import json
import os
import re

import pytest

from blackjack_rl.report.dataset import DatasetView, common_prefix, group_summary, trained_spans
from blackjack_rl.report.episodes import category, invalid_examples, sample
from blackjack_rl.report.modes import decoding_mode
from blackjack_rl.report.strategy import chart, costliest, state_stats
from blackjack_rl.contract.records import Metrics
from records_factory import decision as _decision
from records_factory import episode_record, sample_row, scored_group


def _row(seed, status="finished", outcome="loss", decisions=(), reason=None):
    return sample_row(seed, status, decisions, outcome=outcome if status == "finished" else None,
                      invalid_reason=reason)


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
    assert [r.seed for r in chosen] == sorted(r.seed for r in chosen)
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
    group = scored_group([[1, 2], [1, 2, 3]], [episode_record(42), episode_record(42, "invalid", invalid_reason="no_call")],
                         scores=[1.0, -1.0])
    assert group_summary(group) == [42, [1.0, -1.0], "no_call", 2, 3]


def _group(seed, prompt_len=50):
    prompt = list(range(prompt_len))
    seqs = [prompt + [1000 + seed, 7, 8], prompt + [1000 + seed, 9]]
    return scored_group(
        seqs,
        [episode_record(seed, outcome="win"), episode_record(seed, "invalid", invalid_reason="bad_json")],
        masks=[[-100] * (prompt_len + 1) + s[prompt_len + 1:] for s in seqs],
        inference_logprobs=[[1.0] * (prompt_len + 1) + [-0.5] * (len(s) - prompt_len - 1) for s in seqs],
        scores=[1.0, -1.0],
        messages=[[{"role": "system", "content": "rules"}, {"role": "user", "content": f"deal {seed}"}]] * 2,
        generation_params={"policy": "test"},
    )


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


# -- any text a model writes is embedded safely in the pages' scripts --------------------------

EVIL = ("</script><script>window.pwned=1</script> <!-- <script> --> \u2028 line \u2029 para "
        "\ud800 lone \udfff & &amp; > ' \" \\ \x00 end")


def _evil_rows():
    from blackjack_rl.contract.protocol import HIT, tool_call_text

    text = EVIL + tool_call_text(HIT)
    rows = []
    for seed, status in ((1, "finished"), (2, "invalid")):
        decision = _decision(12, 10, 0, "hit" if status == "finished" else None, "hit", text=text)
        row = _row(seed, status=status, decisions=[decision], reason=None if status == "finished" else "no_call")
        row.messages = [{"role": "system", "content": "sys " + EVIL}, {"role": "user", "content": "deal"},
                           {"role": "assistant", "content": text}]
        rows.append(row)
    return rows, text


def test_report_embeds_any_answer_as_json_that_parses_back(tmp_path, solution):
    from blackjack_rl.rollout.runner import EVAL_SEED_BASE
    from blackjack_rl.report.evaluation import write_report
    from blackjack_rl.game.solver import baselines

    rows, text = _evil_rows()
    ref = {k: {"value": o.value, "win": o.win, "draw": o.draw, "loss": o.loss} for k, o in baselines(solution.rules).items()}
    rate = {"rate": 0.5, "ci95_low": 0.1, "ci95_high": 0.9}
    metrics = Metrics.model_validate({"policy": {"model": EVIL}, "rules": solution.rules.model_dump(), "seeds": {"first": EVAL_SEED_BASE, "count": 2},
               "episodes": 2, "episodes_played": 2, "episodes_failed": 0, "failure_examples": [],
               "win": rate, "draw": rate, "loss": rate, "invalid": rate,
               "invalid_by_reason": {"no_call": {"count": 1, "rate": 0.5}},
               "mean_reward": {"mean": -1.0, "ci95_low": -1.0, "ci95_high": -1.0, "stderr": 0.0, "n": 2,
                               "too_few": False},
               "mean_expected_score": {"mean": -1.0, "ci95_low": -1.0, "ci95_high": -1.0, "stderr": 0.0, "n": 2,
                                       "too_few": False},
               "mean_game_reward": {"mean": -1.0, "ci95_low": None, "ci95_high": None, "stderr": None, "n": 1,
                                    "too_few": True},
               "decisions": 2, "valid_decisions": 1, "decision_accuracy": rate, "decision_accuracy_valid": rate,
               "mean_regret": {"mean": 0.0, "ci95_low": None, "ci95_high": None, "stderr": None, "n": 1,
                               "too_few": True},
               "reference": ref, "optimal_value": ref["optimal"]["value"], "invalid_score": -1.0})
    path = write_report(tmp_path / "report.html", metrics, rows, solution)  # lone surrogates: written, not raised
    html = path.read_text(encoding="utf-8")
    block = re.search(r'<script type="application/json" id="episodes-data">(.*?)</script>', html, re.S).group(1)
    data = json.loads(block)  # the element ends where the data ends, and what is inside is JSON
    assert [m[1] for m in data["episodes"][0]["messages"][1:]] == ["deal", text]
    assert data["system"] == ["sys " + EVIL]
    assert "<!--" not in block and "\u2028" not in block and block.isascii()


def test_dataset_view_scripts_hold_any_answer(tmp_path):
    rows, text = _evil_rows()
    group = scored_group([[1, 2, 3]], [episode_record(1, "invalid", invalid_reason=EVIL)], masks=[[-100, 2, 3]],
                         scores=[1.0], inference_logprobs=[[1.0, -0.5, -0.1]], messages=[rows[0].messages],
                         generation_params={"model": EVIL})
    with DatasetView(tmp_path / "groups.html") as view:
        view.add(group)
    chunk = (tmp_path / "groups-view" / "chunk-0000.js").read_text(encoding="utf-8")
    assert chunk.startswith("VIEW.chunk(0,") and chunk.endswith(");\n") and chunk.isascii()
    payload = json.loads(chunk[len("VIEW.chunk(0,"):-3])  # JSON is also the JavaScript the page runs
    msgs = payload["groups"][0]["seqs"][0]["msgs"]
    assert msgs[-1] == ["assistant", text] and payload["systems"] == ["sys " + EVIL]
    manifest = (tmp_path / "groups-view" / "manifest.js").read_text(encoding="utf-8")
    assert json.loads(manifest[len("VIEW.manifest("):-3])["reasons"] == [EVIL]


@pytest.mark.skipif(os.name == "nt", reason="on Windows jinja2 caches straight into the temp directory")
def test_compiled_templates_are_reused_and_never_fail_a_page(tmp_path, monkeypatch):
    """Pages reuse jinja2's compiled templates from the per-user temp cache; with no usable
    temp directory there is no cache, and pages still render."""
    import tempfile

    from blackjack_rl.report import html

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    html.environment().get_template("report.html.jinja")
    assert list(tmp_path.glob("_jinja2-cache-*/__blackjack_rl_*.cache"))
    cached = html.environment()
    monkeypatch.setattr(cached, "compile", lambda *a, **k: pytest.fail("compiled again despite the cache"))
    assert cached.get_template("report.html.jinja").name == "report.html.jinja"

    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(blocker))
    env = html.environment()
    assert env.bytecode_cache is None
    env.get_template("report.html.jinja")
