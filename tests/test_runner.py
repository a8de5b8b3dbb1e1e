"""The one deal runner: every job counts what it played the same way."""

from __future__ import annotations

import json
import re

from api_payloads import ATROPOS_REGISTRATION
from blackjack_rl.api.client import TrainerClient
from helpers import ServerProcess, run_cli
from test_serve import Pulled, metrics_rows, pull, start_serve


def _process_counts(tmp_path, *args: str) -> tuple[dict[str, int], list[dict]]:
    run = run_cli("process", "--policy", "optimal", "--quiet", "--out", str(tmp_path), *args, check=True)
    m = re.search(r"Wrote (\d+) groups \((\d+) sequences from (\d+) episodes, (\d+) failed", run.stdout)
    assert m, run.stdout
    groups = [json.loads(line) for line in (tmp_path / "groups.jsonl").read_text().splitlines()]
    return dict(zip(("groups", "sequences", "episodes", "failed"), map(int, m.groups()))), groups


def test_process_counts_games_and_sequences_for_both_kinds_of_group(tmp_path):
    whole, groups = _process_counts(tmp_path / "episode", "--groups", "5", "--group-size", "3")
    assert whole == {"groups": 5, "sequences": 15, "episodes": 15, "failed": 0}
    step, groups = _process_counts(tmp_path / "step", "--groups", "5", "--group-size", "3", "--credit", "step")
    # one canonical game per deal, one group per decision of it, three answers each
    assert step["episodes"] == 5 and step["failed"] == 0
    assert step["groups"] == len(groups) >= 5 and len({g["episodes"][0]["seed"] for g in groups}) == 5
    assert step["sequences"] == sum(len(g["tokens"]) for g in groups) == 3 * len(groups)


def test_serve_with_step_groups_reports_the_episodes_it_played(tmp_path):
    api = ServerProcess(tmp_path / "api.sqlite").start()
    try:
        trainer = TrainerClient(api.url)
        trainer.register({**ATROPOS_REGISTRATION, "batch_size": 4})
        serve = start_serve(api.url, tmp_path / "w", "--credit", "step", "--max-groups", "6")
        seen = Pulled()
        pull(trainer, 6, seen)
        out, _ = serve.communicate(timeout=120)
        assert serve.returncode == 0, out
        stopped = metrics_rows(tmp_path / "w")[-1]
        assert stopped["kind"] == "stopped" and stopped["sent"] == 6
        deals = {g["episodes"][0]["seed"] for g in seen}
        # every group sent came from a canonical game the worker counted
        assert stopped["episodes"] >= len(deals) >= 1
        assert f"{stopped['episodes']} episodes" in out
    finally:
        api.kill()
