"""`train --recipe`: the shipped recipe is the committed run, phases chain, a killed run resumes
and takes the same next step, and `train` refuses every option that does nothing for it."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import yaml

from blackjack_rl.config import Settings
from blackjack_rl.train.recipe import parse_recipe, phase_settings, recipe_text, shipped
from helpers import poll_until, popen_cli, run_cli

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "docs" / "training" / "three-phase"


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _leaves(tree: dict, at: tuple = ()) -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_leaves(v, (*at, k)) if isinstance(v, dict) else {(*at, k): v})
    return out


DEFAULTS = _leaves(Settings().model_dump(mode="json"))


def test_the_shipped_three_phase_recipe_is_the_committed_run():
    """Every setting of each phase equals what the committed phase ran with, and each phase ends at
    the step the next one started from (phases 2 and 3 were once ended by a clock)."""
    recipe = parse_recipe(*recipe_text("three-phase"))
    assert "three-phase" in shipped() and recipe.signal == "solver"
    phase3 = json.loads((COMMITTED / "phase3" / "settings.json").read_text())
    ends = [20, int(phase3["train"]["base_adapter"].rsplit("_", 1)[1]), _rows(COMMITTED / "phase3" / "train_log.jsonl")[-1]["step"]]
    previous = None
    for i, end in enumerate(ends):
        ran = _leaves(json.loads((COMMITTED / f"phase{i + 1}" / "settings.json").read_text()))
        ours = _leaves(phase_settings(recipe, i, previous=previous).model_dump(mode="json"))
        chained = {("out",), ("train", "steps"), ("train", "base_adapter"), ("train", "max_minutes"),
                   ("policy", "n_threads")}
        differ = {k: (ran[k], ours[k]) for k in ran.keys() & ours.keys() if k not in chained and ran[k] != ours[k]}
        assert not differ, f"phase {i + 1}: {differ}"
        assert ours[("train", "steps")] == end
        assert (ours[("train", "base_adapter")] is None) == (i == 0)
        previous = Path("runs") / f"p{i}"


@pytest.mark.parametrize("name, signal, out, docs", [
    ("whole-game", "solver", "runs/whole-game", "whole-game"),
    ("reward-only", "table", "runs/ro4-fresh", "reward-only"),
    ("outcome-baseline", "table", "runs/outcome-baseline", "reward-only/outcome-baseline"),
])
def test_a_shipped_recipe_is_its_committed_run(name, signal, out, docs):
    """Every setting of each phase equals what the committed run's phase ran with (its settings.json,
    written by `train --recipe NAME`; a phase continued by `train --resume` also records where it
    resumed), and each phase ran exactly its steps."""
    committed = REPO / "docs" / "training" / docs
    recipe = parse_recipe(*recipe_text(name))
    assert name in shipped() and recipe.signal == signal
    meta = json.loads((committed / "run.json").read_text())
    assert (meta["recipe"], meta["version"], meta["signal"]) == (name, recipe.version, signal)
    previous = None
    for i, _ in enumerate(recipe.phases):
        folder = committed / recipe.phase_dir(i)
        ran = _leaves(json.loads((folder / "settings.json").read_text()))
        ran[("train", "resume")] = None
        ours = _leaves(phase_settings(recipe, i, out=Path(out), seed=meta["seed"], previous=previous,
                                      threads=ran[("policy", "n_threads")]).model_dump(mode="json"))
        # a setting added since the run was made, at its default, changes nothing the run did
        added = ours.keys() - ran.keys()
        assert all(ours[k] == DEFAULTS[k] for k in added), {k: ours[k] for k in added}
        ran.update({k: ours[k] for k in added})
        assert ran == ours, f"phase {i + 1}: {({k: (ran.get(k), ours.get(k)) for k in ran.keys() | ours.keys() if ran.get(k) != ours.get(k)})}"
        steps = [r["step"] for r in _rows(folder / "train_log.jsonl") if r.get("kind") == "step"]
        assert steps == list(range(1, recipe.phases[i].steps + 1))
        assert json.loads((folder / "phase.json").read_text())["stopped"] == "steps"
        previous = Path(out) / recipe.phase_dir(i)


def test_dry_run_prints_every_phase_and_trains_nothing(tmp_path):
    run = run_cli("train", "--recipe", "three-phase", "--dry-run", "--out", str(tmp_path / "r"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "exact decision credit from the solver" in run.stdout
    for name, steps in (("format", 20), ("decision", 80), ("both", 116)):
        assert f"{name}: {steps} steps" in run.stdout
    assert '"deals_per_step": 96' in run.stdout and '"format_weight": 0.0' in run.stdout
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv, says", [
    (["--base-url", "http://127.0.0.1:1/v1"], "inference server"),
    (["--server", "http://127.0.0.1:1"], "inference server"),
    (["--constrained"], "changes the sampled distribution"),
    (["--policy", "optimal"], "not an option of train"),
    (["--threshold", "15"], "threshold bot"),
    (["--n-ctx", "512"], "llama.cpp"),
    (["--episodes", "5"], "option of evaluate"),
    (["--api-url", "http://127.0.0.1:1"], "add --source api"),
    (["--batch-size", "4"], "add --source api"),
    (["--lora-rank", "4"], "add --lora"),
    (["--recipe", "three-phase", "--lr", "1"], "the recipe sets it"),
    (["--recipe", "three-phase", "--config", "x.yaml"], "--config"),
    (["--recipe", "no-such-recipe"], "shipped recipes are outcome-baseline, reward-only, three-phase"),
])
def test_train_refuses_what_does_nothing_for_it(tmp_path, argv, says):
    (tmp_path / "x.yaml").write_text("train: {lr: 0.1}\n")
    run = run_cli("train", *argv, "--dry-run", "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert run.returncode == 2 and says in run.stderr, run.stdout + run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("overlay, says", [
    ({"train": {"max_minutes": 5}}, "wall-clock"),
    ({"train": {"steps": 5}}, "`steps`"),
    ({"policy": {"base_url": "http://x"}}, "not a setting of train"),
    ({"train": {"lr": -1}}, "lr"),
])
def test_a_recipe_that_sets_what_it_may_not_is_one_line(tmp_path, overlay, says):
    recipe = {"name": "bad", "version": 1, "signal": "solver", "summary": "x",
              "phases": [{"name": "one", "steps": 1, "settings": overlay}]}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(recipe))
    run = run_cli("train", "--recipe", str(tmp_path / "bad.yaml"), "--dry-run", cwd=tmp_path)
    assert run.returncode == 2 and says in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("groups, episode, says", [
    ({"credit": "step-counterfactual", "group_size": 0}, {}, "groups.credit step-counterfactual credits decisions by Q*"),
    ({"credit": "episode"}, {"scoring": "expected"}, "episode.scoring expected"),
    ({"credit": "step-rollouts", "starts": "chart"}, {}, "--starts chart chooses or weighs states by the solver"),
])
def test_a_reward_only_recipe_refuses_every_phase_the_solver_would_credit(tmp_path, groups, episode, says):
    recipe = {"name": "leaky", "version": 1, "signal": "table", "summary": "x",
              "phases": [{"name": "one", "steps": 1, "settings": {"groups": groups, "episode": episode}}]}
    (tmp_path / "leaky.yaml").write_text(yaml.safe_dump(recipe))
    run = run_cli("train", "--recipe", str(tmp_path / "leaky.yaml"), "--dry-run", cwd=tmp_path)
    assert run.returncode == 2 and says in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_the_reward_only_recipe_is_reward_only():
    recipe = parse_recipe(*recipe_text("reward-only"))
    assert recipe.signal == "table"
    for i, _ in enumerate(recipe.phases):
        g = phase_settings(recipe, i).groups
        assert g.credit == "step-rollouts" and g.starts == "uniform"  # balancing, if any, reads the estimate


def _small_recipe(path: Path, model: str | None, second_steps: int, episodes: int) -> Path:
    common = {"policy": {"max_tokens": 8}, "groups": {"credit": "step-counterfactual", "group_size": 0,
                                                        "starts": "chart"},
              "train": {"lora": True, "lora_rank": 2, "train_layers": 1, "deals_per_step": 2, "lr": 1e-2,
                        "eval_episodes": 0, "grid_every": 0, "game_budget": 0, "save_every": 1,
                        "max_train_rows": 8}}
    if model is not None:
        common["policy"]["model_path"] = model
    recipe = {"name": "small", "version": 1, "signal": "solver", "summary": "two short phases",
              "settings": common,
              "phases": [{"name": "first", "steps": 1},
                         {"name": "second", "steps": second_steps, "seed": 3,
                          "settings": {"groups": {"decisions": "first"}, "train": {"warmup_steps": 2}}}],
              "report": {"episodes": episodes, "grid": False}}
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.slow  # the embedded model, trained in torch and played in llama.cpp
@pytest.mark.embedded
def test_a_two_phase_recipe_runs_end_to_end_on_the_embedded_model(tmp_path):
    recipe = _small_recipe(tmp_path / "small.yaml", None, 1, 4)
    run = run_cli("train", "--recipe", str(recipe), "--threads", "2", "--out", str(tmp_path / "run"), cwd=tmp_path,
                  timeout=1500)
    assert run.returncode == 0, run.stdout + run.stderr
    out = tmp_path / "run"
    assert "[1/2 first, steps 1-1 of 2]" in run.stdout and "[2/2 second, steps 2-2 of 2]" in run.stdout
    second = json.loads((out / "02-second" / "settings.json").read_text())
    assert second["train"]["base_adapter"] == "run/01-first/adapter" and second["seed"] == 3
    assert json.loads((out / "02-second" / "phase.json").read_text())["steps"] == 1
    report = json.loads((out / "report.json").read_text())
    assert report["signal"] == "solver"
    assert report["before"]["policy"]["lora"] is None
    assert report["after"]["policy"]["lora"].endswith("02-second/adapter")
    compared = json.loads((out / "report" / "compare" / "compare.json").read_text())
    assert compared and (out / "report" / "after" / "metrics.json").is_file()
    again = run_cli("train", "--recipe", str(recipe), "--out", str(out), cwd=tmp_path)
    assert again.returncode == 2 and "--resume" in again.stderr


@pytest.mark.slow  # torch training
def test_a_killed_recipe_resumes_and_takes_the_same_next_step(tiny_model_dir, tmp_path):
    recipe = _small_recipe(tmp_path / "small.yaml", str(tiny_model_dir), 8, 2)
    whole = run_cli("train", "--recipe", str(recipe), "--threads", "1", "--out", str(tmp_path / "whole"),
                    cwd=tmp_path, timeout=900)
    assert whole.returncode == 0, whole.stdout + whole.stderr

    cut = tmp_path / "cut"
    proc = popen_cli("train", "--recipe", str(recipe), "--threads", "1", "--out", str(cut), cwd=tmp_path)
    try:
        poll_until(lambda: (cut / "02-second" / "checkpoints" / "step_0002" / "trainer_state.pt").is_file(),
                   attempts=20_000, interval_s=0.02, what="phase 2's second checkpoint")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (cut / "02-second" / "phase.json").exists(), "the run ended before it was killed"
    assert not (cut / "report.json").exists()

    resumed = run_cli("train", "--resume", str(cut), "--threads", "2", cwd=tmp_path)
    assert resumed.returncode == 2 and "takes every setting from its folder" in resumed.stderr
    resumed = run_cli("train", "--resume", str(cut), cwd=tmp_path, timeout=900)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "[1/2 first, steps 1-1 of 9] done earlier" in resumed.stdout and "resumed from" in resumed.stdout

    def steps(run: Path) -> list[dict]:
        return [r for r in _rows(run / "02-second" / "train_log.jsonl") if r["kind"] == "step"]

    a, b = steps(tmp_path / "whole"), steps(cut)
    assert [r["step"] for r in b] == list(range(1, 9))  # no step twice, none missing
    for ra, rb in zip(a, b):
        for key in ("mean_score", "trained_groups", "sequences", "sampled_tokens", "lr"):
            assert ra[key] == rb[key], (ra["step"], key)
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5, abs=1e-7)
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "whole" / "02-second" / "adapter" / "adapter_model.safetensors"))
    wb = load_file(str(cut / "02-second" / "adapter" / "adapter_model.safetensors"))
    import torch

    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)
    assert (cut / "report.json").is_file()


def test_every_option_of_another_command_is_refused_by_train_in_one_line(capsys):
    """`train --help` lists only what acts on training: each flag the other commands take and train
    does not is an error naming that flag, never silently ignored."""
    from blackjack_rl import cli
    from blackjack_rl.cli_options import subcommands

    parser = cli.build_parser()
    commands = subcommands(parser)
    ours = set(commands["train"]._option_string_actions)
    theirs = {flag: action for name, sub in commands.items() if name not in ("train", "api")
              for flag, action in sub._option_string_actions.items() if flag.startswith("--") and flag not in ours}
    assert {"--base-url", "--constrained", "--threshold", "--n-ctx", "--server", "--episodes"} <= set(theirs)
    for flag, action in sorted(theirs.items()):
        argv = ["train", flag] + ([] if action.nargs == 0 else ["1"]) + ["--dry-run"]
        with pytest.raises(SystemExit) as stop:
            cli.main(argv)
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and flag in err and len(err.splitlines()) == 1, (flag, err)


def test_dry_run_of_a_plain_run_prints_its_settings_and_writes_nothing(tmp_path):
    run = run_cli("train", "--lr", "0.25", "--lora", "--dry-run", "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    shown = json.loads(run.stdout)
    assert shown["train"]["lr"] == 0.25 and shown["train"]["lora"] is True and shown["policy"]["kind"] == "hf"
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # torch training
def test_a_stop_rule_ends_its_phase_at_the_first_chart_that_meets_it(tiny_model_dir, tmp_path):
    recipe = yaml.safe_load(_small_recipe(tmp_path / "r.yaml", str(tiny_model_dir), 1, 2).read_text())
    recipe["phases"][0].update({"steps": 4, "stop_when": {"metric": "grid_value", "at_least": -10.0},
                                "settings": {"train": {"grid_every": 2}}})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    run = run_cli("train", "--recipe", str(tmp_path / "r.yaml"), "--threads", "1", "--out", str(tmp_path / "run"),
                  cwd=tmp_path, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    done = json.loads((tmp_path / "run" / "01-first" / "phase.json").read_text())
    assert done["steps"] == 2 and done["stopped"].startswith("stop_when grid_value")
    assert (tmp_path / "run" / "report.json").is_file()

    recipe["phases"][0]["settings"] = {"train": {"grid_every": 0}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    bad = run_cli("train", "--recipe", str(tmp_path / "r.yaml"), "--dry-run", cwd=tmp_path)
    assert bad.returncode == 2 and "grid_every 0" in bad.stderr
