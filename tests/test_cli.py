"""The real command line, run as subprocesses: what scripts and docs rely on."""

import json
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "blackjack_rl.cli"]


def run(*args, check=True, timeout=300):
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


@pytest.mark.parametrize("cmd", [[], ["solve"], ["process"], ["evaluate"], ["serve"], ["api"]])
def test_every_command_has_help(cmd):
    out = run(*cmd, "--help").stdout
    assert "usage:" in out


def test_solve_json_gives_the_optimum_and_the_chart():
    data = json.loads(run("solve", "--json").stdout)
    assert data["expected_return"] == pytest.approx(-0.04656, abs=5e-6)
    assert data["chart"]["hard"]["16"]["10"] == "hit" and data["chart"]["hard"]["13"]["2"] == "stick"
    assert len(data["q"]) == 18 * 10 + 10 * 10 + 10
    sab = json.loads(run("solve", "--json", "--sab").stdout)
    assert sab["rules"]["sab"] and sab["expected_return"] > data["expected_return"]


def test_solve_prints_a_readable_table():
    out = run("solve").stdout
    assert "-0.04656" in out and "42.95%" in out and "soft hands" in out


def test_process_is_reproducible_with_a_bot(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        run("process", "--policy", "random", "--groups", "5", "--group-size", "4", "--seed", "7", "--out", str(out), "--quiet")
    assert (a / "groups.jsonl").read_bytes() == (b / "groups.jsonl").read_bytes()
    lines = (a / "groups.jsonl").read_text().splitlines()
    assert len(lines) == 5
    group = json.loads(lines[0])
    for key in ("tokens", "masks", "scores", "inference_logprobs", "messages", "generation_params", "episodes"):
        assert key in group
    html = (a / "groups.html").read_text()
    assert "<script" in html and 'src="http' not in html and 'href="http' not in html  # self-contained
    other = tmp_path / "c"
    run("process", "--policy", "random", "--groups", "5", "--group-size", "4", "--seed", "8", "--out", str(other), "--quiet")
    assert (other / "groups.jsonl").read_bytes() != (a / "groups.jsonl").read_bytes()


def test_evaluate_optimal_bot_metrics(tmp_path):
    run("evaluate", "--policy", "optimal", "--episodes", "3000", "--out", str(tmp_path), "--quiet")
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["episodes"] == m["episodes_played"] == 3000 and m["episodes_failed"] == 0
    assert m["decision_accuracy"]["rate"] == 1.0 and m["mean_regret"]["mean"] == 0.0
    r = m["mean_reward"]
    assert r["ci95_low"] <= m["optimal_value"] <= r["ci95_high"]
    assert m["win"]["rate"] + m["draw"]["rate"] + m["loss"]["rate"] == pytest.approx(1.0)
    samples = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 3000
    first = json.loads(samples[0])
    assert first["seed"] == m["seeds"]["first"] and first["decisions"][0]["optimal"] in ("hit", "stick")


def test_evaluate_uses_the_same_deals_for_every_policy(tmp_path):
    seeds = []
    for policy in ("optimal", "random"):
        run("evaluate", "--policy", policy, "--episodes", "50", "--out", str(tmp_path / policy), "--quiet")
        rows = [json.loads(x) for x in (tmp_path / policy / "samples.jsonl").read_text().splitlines()]
        seeds.append([(r["seed"], r["player_hand"][:2], r["dealer_hand"][:1]) for r in rows])
    assert seeds[0] == seeds[1]


def test_threshold_bot_and_rules_flags(tmp_path):
    run("evaluate", "--policy", "threshold", "--threshold", "12", "--episodes", "400", "--natural",
        "--out", str(tmp_path), "--quiet")
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["rules"]["natural"] is True and m["policy"]["policy"] == "threshold-12"
    assert m["decision_accuracy"]["rate"] < 1.0


def test_yaml_config_env_and_flags_precedence(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("policy:\n  kind: threshold\n  threshold: 15\nevaluate:\n  episodes: 20\n")
    env = {**__import__("os").environ, "BLACKJACK_RL_EVALUATE__EPISODES": "30"}
    proc = subprocess.run([*CLI, "evaluate", "--config", str(cfg), "--out", str(tmp_path / "o"), "--quiet"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    m = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert m["policy"]["policy"] == "threshold-15" and m["episodes"] == 30  # env beats YAML
    proc = subprocess.run([*CLI, "evaluate", "--config", str(cfg), "--episodes", "10", "--out", str(tmp_path / "p"),
                           "--quiet"], capture_output=True, text=True, env=env, timeout=120)
    assert json.loads((tmp_path / "p" / "metrics.json").read_text())["episodes"] == 10  # flag beats env


def test_bad_settings_give_a_clear_error():
    proc = run("evaluate", "--policy", "openai", "--episodes", "1", check=False)
    assert proc.returncode == 2 and "--model" in proc.stderr
    proc = run("evaluate", "--config", "/nonexistent.yaml", check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


@pytest.mark.embedded
def test_process_and_evaluate_on_the_embedded_model(tmp_path):
    run("process", "--groups", "1", "--group-size", "2", "--max-tokens", "24", "--out", str(tmp_path / "p"), "--quiet")
    group = json.loads((tmp_path / "p" / "groups.jsonl").read_text())
    assert group["generation_params"]["policy"] == "embedded" and len(group["tokens"]) == 2
    trained = [lp for lps, ms in zip(group["inference_logprobs"], group["masks"]) for lp, m in zip(lps, ms) if m != -100]
    assert trained and all(lp <= 0 for lp in trained)
    proc = run("evaluate", "--episodes", "4", "--constrained", "--out", str(tmp_path / "e"), "--quiet")
    m = json.loads((tmp_path / "e" / "metrics.json").read_text())
    assert m["policy"]["constrained"] is True and m["invalid"]["rate"] == 0.0 and m["episodes_played"] == 4
    assert "Evaluation of" in proc.stdout
