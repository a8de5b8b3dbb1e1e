"""The trained adapters ship inside the package: `--lora whole-game` plays one, and the README's
first command plays it beside the untrained model on the same deals, paired."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from blackjack_rl import trained
from helpers import run_cli

REPO = Path(__file__).resolve().parents[1]


def test_a_built_wheel_holds_the_shipped_adapter_and_recipe(tmp_path):
    """A plain `pip install` of the repository, not only an editable one, has what `--lora
    whole-game` and `train --recipe whole-game` read."""
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(REPO),
                            "-w", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("blackjack_rl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in trained.names():
        for file in ("adapter.gguf", "adapter_config.json", "adapter_model.safetensors"):
            assert f"blackjack_rl/trained/{name}/{file}" in names
    from blackjack_rl.train.recipe import shipped

    assert {"outcome-baseline", "reward-only", "three-phase", "whole-game"} <= set(shipped())
    for name in shipped():
        assert f"blackjack_rl/train/recipes/{name}.yaml" in names
    assert {"three-phase", "whole-game"} <= set(trained.names())


def test_a_shipped_adapter_is_named_after_its_recipe_and_over_the_embedded_base():
    from blackjack_rl.contract.tokens import embedded_model_path
    from blackjack_rl.train.recipe import shipped

    assert set(trained.names()) <= set(shipped())
    import hashlib

    base = hashlib.sha256(embedded_model_path().read_bytes()).hexdigest()
    for name in trained.names():
        config = json.loads((trained.folder(name) / "adapter_config.json").read_text())
        assert config["blackjack_rl_base"]["sha256"] == base


def test_training_options_take_a_shipped_adapter_by_name(tmp_path, monkeypatch):
    """`--base-adapter whole-game` (and --init-adapter) name a shipped adapter as --lora does, so the
    commands in docs/training run from a fresh clone; a folder of that name on disk wins."""
    from blackjack_rl.config import load_settings

    for key in ("base_adapter", "init_adapter"):
        settings = load_settings(overrides={"train": {"lora": True, key: "whole-game"}})
        assert getattr(settings.train, key) == trained.folder("whole-game")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "whole-game").mkdir()
    settings = load_settings(overrides={"train": {"lora": True, "base_adapter": "whole-game"}})
    assert settings.train.base_adapter == Path("whole-game")
    run = run_cli("train", "--lora", "--base-adapter", "no-such-adapter", "--steps", "1", "--threads", "1",
                  "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
    assert "no saved adapter at no-such-adapter (shipped adapters, by name: three-phase, whole-game)" in run.stderr


@pytest.mark.parametrize("argv, says", [
    (["--versus-base"], "add --lora"),
    (["--lora", "no-such-adapter"], "shipped adapters: three-phase, whole-game"),
    (["--lora", "whole-game", "--versus-base", "--no-samples"], "drop --no-samples"),  # before either model plays
])
def test_wrong_adapter_options_are_one_line(tmp_path, argv, says):
    run = run_cli("evaluate", *argv, "--episodes", "2", "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert run.returncode == 2 and says in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.embedded
@pytest.mark.slow
@pytest.mark.timeout(1800)  # two models play on 2 cores; a busy machine makes it slower, never wrong
def test_the_first_command_plays_the_trained_model_beside_the_untrained_one(tmp_path):
    """The README's first command, on fewer deals: both models live on the same fixed deals, the
    paired difference with its interval, and every table naming the adapter."""
    readme = (REPO / "README.md").read_text()
    assert "blackjack-rl evaluate --lora whole-game --versus-base" in readme.split("```")[1]
    run = run_cli("evaluate", "--lora", "whole-game", "--versus-base", "--max-tokens", "40", "--episodes", "30",
                  "--threads", "2", "--quiet", "--out", str(tmp_path / "first"), cwd=tmp_path, timeout=900,
                  env={"COLUMNS": "160"})
    assert run.returncode == 0, run.stdout + run.stderr
    base = json.loads((tmp_path / "first" / "base" / "metrics.json").read_text())
    adapter = json.loads((tmp_path / "first" / "adapter" / "metrics.json").read_text())
    assert base["policy"]["lora"] is None and adapter["policy"]["lora"] == "whole-game"
    assert adapter["valid_decisions"] > base["valid_decisions"] + 5
    # it plays the game, not only the format: a format-only adapter decided 50-55% of its decisions
    # optimally (docs/training), this one 92% on 1,000 deals
    assert adapter["decision_accuracy"]["rate"] > 0.65
    # and the decisions after a hit, which the first-decision adapter got 62% right (this one 91%)
    later = [d["action"] == d["optimal"] for line in (tmp_path / "first" / "adapter" / "samples.jsonl").open()
             for d in json.loads(line)["decisions"][1:]]
    assert len(later) >= 8 and sum(later) / len(later) > 0.7
    (paired,) = json.loads((tmp_path / "first" / "compare.json").read_text())["comparisons"]
    assert (paired["a"], paired["b"], paired["pairs"], paired["only_a"], paired["only_b"]) == ("base", "adapter", 30, 0, 0)
    expected = paired["differences"]["expected"]
    assert expected["ci95_low"] > 0 and expected["significant"]
    assert "+ LoRA whole-game" in run.stdout and "paired over 30 shared deals" in run.stdout
    assert "+ LoRA whole-game" in (tmp_path / "first" / "adapter" / "report.html").read_text()
    assert "+ LoRA whole-game" in (tmp_path / "first" / "compare.html").read_text()
