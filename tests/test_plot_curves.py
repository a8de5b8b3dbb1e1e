"""Runs compared by training minutes: the axis must add up each phase's steps, not restart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from blackjack_rl.train.plot import chart_curve, first_phase_scales, run_logs


def _log(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _step(step: int, seconds: float, elapsed: float, **grid: float) -> dict:
    return {"kind": "step", "step": step, "seconds": seconds, "elapsed": elapsed, **grid}


def _grid(acc: float, value: float) -> dict:
    return {"grid_accuracy": acc, "grid_value": value}


def test_training_minutes_add_up_across_phases_and_resumes(tmp_path):
    first = _log(tmp_path / "run" / "01-format" / "train_log.jsonl", [
        {"kind": "grid", "step": 0, **_grid(0.5, -0.5)},
        _step(1, 30.0, 30.0), _step(2, 30.0, 60.0, **_grid(0.55, -0.3)),
    ])
    # a resumed phase: `elapsed` starts again from zero after step 1, the steps' seconds do not
    second = _log(tmp_path / "run" / "02-decision" / "train_log.jsonl", [
        {"kind": "grid", "step": 0, **_grid(0.56, -0.29)},
        _step(1, 60.0, 60.0), _step(2, 90.0, 90.0, **_grid(0.8, -0.1)),
    ])
    assert run_logs(tmp_path / "run") == [first, second]
    points = chart_curve([first, second])
    assert [(p.phase, p.step) for p in points] == [(0, 0), (0, 2), (1, 0), (1, 2)]
    assert [p.minutes for p in points] == pytest.approx([0.0, 1.0, 1.0, 3.5])
    assert points[-1].accuracy == 0.8 and points[-1].value == -0.1


def test_the_command_draws_runs_and_refuses_bad_ones_in_one_line(tmp_path):
    _log(tmp_path / "a" / "train_log.jsonl", [{"kind": "grid", "step": 0, **_grid(0.5, -0.5)},
                                              _step(1, 6.0, 6.0, **_grid(0.6, -0.2))])
    png = tmp_path / "curves.png"
    ok = subprocess.run([sys.executable, "-m", "blackjack_rl.train.plot", "--out", str(png), f"a={tmp_path / 'a'}"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for bad in (["--out", str(png), str(tmp_path / "a")], ["--out", str(png), f"b={tmp_path / 'missing'}"],
                [f"a={tmp_path / 'a'}"]):
        out = subprocess.run([sys.executable, "-m", "blackjack_rl.train.plot", *bad], capture_output=True, text=True)
        assert out.returncode == 2
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_calibration_puts_runs_of_one_first_phase_on_one_machine(tmp_path):
    fast = [_log(tmp_path / "fast" / "01-a" / "train_log.jsonl", [_step(1, 60.0, 60.0), _step(2, 60.0, 120.0)]),
            _log(tmp_path / "fast" / "02-b" / "train_log.jsonl", [_step(1, 60.0, 60.0, **_grid(0.9, -0.06))])]
    slow = [_log(tmp_path / "slow" / "01-a" / "train_log.jsonl", [_step(1, 90.0, 90.0), _step(2, 90.0, 180.0)]),
            _log(tmp_path / "slow" / "02-c" / "train_log.jsonl", [_step(1, 150.0, 150.0, **_grid(0.5, -0.19))])]
    scales = first_phase_scales({"fast": fast, "slow": slow})
    assert scales == {"fast": 1.0, "slow": pytest.approx(2 / 3)}
    # the slow machine's 2.5 minutes of phase b are 1.67 of the fast one's, after its 2-minute phase a
    assert chart_curve(slow, scales["slow"])[-1].minutes == pytest.approx(2 + 2.5 * 2 / 3)
    short = [_log(tmp_path / "short" / "train_log.jsonl", [_step(1, 60.0, 60.0)])]
    with pytest.raises(ValueError, match="same first phase"):
        first_phase_scales({"fast": fast, "short": short})
