"""`blackjack-rl serve` against a real API process and a trainer that pulls batches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from api_payloads import ATROPOS_REGISTRATION
from blackjack_rl.api.client import TrainerClient
from helpers import ServerProcess, free_port, kill_process, poll_until, popen_cli, run_cli, stop_process


def start_serve(api_url: str, out: Path, *extra: str) -> subprocess.Popen:
    return popen_cli("serve", "--policy", "random", "--group-size", "4", "--api-url", api_url, "--out", str(out),
                     "--quiet", "--worker-id", "w1", "--seed", "5", *extra)


class Pulled(list):
    """Groups received by the trainer, and the ids of the batches they came in."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_ids: set[int] = set()


def pull(trainer: TrainerClient, want_groups: int, seen: Pulled, *, attempts: int = 600) -> None:
    """Pull batches until `seen` holds want_groups groups, at most `attempts` times; a batch counts once, by batch_id.

    A batch can be redelivered after an API restart even if its first delivery was lost
    on the way (the API was killed mid-response), so redelivery alone is no reason to skip.
    """
    ids = seen.batch_ids
    for _ in range(attempts):
        if len(seen) >= want_groups:
            return
        try:
            batch = trainer.get_batch()
        except Exception:  # the API may be down on purpose; keep polling
            time.sleep(0.2)
            continue
        if batch is None:
            time.sleep(0.1)
            continue
        if batch.batch_id not in ids:
            ids.add(batch.batch_id)
            seen.extend(batch.groups)


def group_key(group: dict) -> tuple:
    return (group["episodes"][0]["seed"], tuple(map(tuple, group["tokens"])))


def metrics_rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "serve_metrics.jsonl").read_text().splitlines()]


def test_serve_feeds_a_trainer(tmp_path):
    api = ServerProcess(tmp_path / "api.sqlite").start()
    try:
        trainer = TrainerClient(api.url)
        trainer.register({**ATROPOS_REGISTRATION, "batch_size": 8})
        serve = start_serve(api.url, tmp_path / "w", "--max-groups", "6")
        seen = Pulled()
        pull(trainer, 6, seen)
        out, _ = serve.communicate(timeout=60)
        assert serve.returncode == 0, out
        assert len(seen) == 6 and len({group_key(g) for g in seen}) == 6
        for g in seen:
            assert len(g["tokens"]) == 4 and g["env_id"] is not None
            assert len({e["seed"] for e in g["episodes"]}) == 1
        rows = metrics_rows(tmp_path / "w")
        kinds = [r["kind"] for r in rows]
        assert kinds[0] == "registered" and kinds[-1] == "stopped" and kinds.count("group") == 6
        assert rows[-1]["sent"] == 6 and rows[-1]["parked"] == 0
    finally:
        api.kill()


def test_api_down_while_serving_loses_nothing(tmp_path):
    db = tmp_path / "api.sqlite"
    api = ServerProcess(db).start()
    serve = None
    try:
        trainer = TrainerClient(api.url)
        trainer.register({**ATROPOS_REGISTRATION, "batch_size": 4})
        serve = start_serve(api.url, tmp_path / "w", "--max-groups", "12", "--max-batches-offpolicy", "2")
        seen = Pulled()
        pull(trainer, 2, seen)
        assert len(seen) >= 2
        api.kill()  # kill -9: the worker must park finished groups in its outbox
        time.sleep(3)
        api = ServerProcess(db, port=api.port).start()  # same port, same database
        pull(trainer, 12, seen, attempts=1200)
        out, _ = serve.communicate(timeout=90)
        assert serve.returncode == 0, out
        assert len(seen) == 12, f"got {len(seen)} groups"
        assert len({group_key(g) for g in seen}) == 12  # each delivered exactly once
        assert metrics_rows(tmp_path / "w")[-1]["parked"] == 0
    finally:
        if serve is not None and serve.poll() is None:
            serve.kill()
        api.kill()


def test_evaluates_as_the_trainer_steps_and_drains_on_sigterm(tmp_path):
    api = ServerProcess(tmp_path / "api.sqlite").start()
    try:
        trainer = TrainerClient(api.url)
        trainer.register({**ATROPOS_REGISTRATION, "batch_size": 8})
        serve = start_serve(api.url, tmp_path / "w", "--steps-per-eval", "1", "--eval-episodes", "20")
        seen = Pulled()
        pull(trainer, 4, seen)  # two trainer steps
        poll_until(lambda: any(r["kind"] == "eval" for r in metrics_rows(tmp_path / "w")), attempts=150,
                   interval_s=0.2, what="an evaluation row in serve_metrics.jsonl")
        evals = [r for r in metrics_rows(tmp_path / "w") if r["kind"] == "eval"]
        assert evals and evals[0]["episodes"] == 20 and evals[0]["step"] >= 1
        serve.send_signal(signal.SIGTERM)
        out, _ = serve.communicate(timeout=60)
        assert serve.returncode == 0, out
        stopped = metrics_rows(tmp_path / "w")[-1]
        assert stopped["kind"] == "stopped" and stopped["parked"] == 0 and stopped["sent"] >= 2
        pull(trainer, stopped["sent"], seen, attempts=300)
        assert len({group_key(g) for g in seen}) == stopped["sent"]
    finally:
        api.kill()


def test_serve_without_api_gives_a_clear_error(tmp_path):
    serve = start_serve(f"http://127.0.0.1:{free_port()}", tmp_path / "w", "--register-timeout", "2")
    out, _ = serve.communicate(timeout=120)
    assert serve.returncode == 2 and "error" in out


def _registered_env_ids(out: Path) -> list[int]:
    return [r["env_id"] for r in metrics_rows(out) if r["kind"] == "registered"]


def _kill(*procs: subprocess.Popen | ServerProcess | None) -> None:
    """SIGKILL whatever of these (started by this test) still runs."""
    for proc in procs:
        if isinstance(proc, ServerProcess):
            proc.kill()
        else:
            kill_process(proc)


def test_a_restarted_worker_continues_its_deals(tmp_path):
    """Same --worker-id and --seed, same OUT: the second run plays new deals, not the first run's again."""
    api = ServerProcess(tmp_path / "api.sqlite").start()
    try:
        trainer = TrainerClient(api.url)
        trainer.register({**ATROPOS_REGISTRATION, "batch_size": 8})
        assert trainer.get_batch() is None  # the trainer has started: workers may register
        seen = Pulled()
        for _ in range(2):
            serve = start_serve(api.url, tmp_path / "w", "--max-groups", "3")
            out, _ = serve.communicate(timeout=90)
            assert serve.returncode == 0, out
        pull(trainer, 6, seen)
        assert len(seen) == 6 and len({group_key(g) for g in seen}) == 6
        state = json.loads((tmp_path / "w" / "serve_state.json").read_text())
        (stream,) = state["streams"].values()
        assert stream["watermark"] >= 6 and stream["done"] == []  # every deal played is written down
        assert len(set(_registered_env_ids(tmp_path / "w"))) == 1  # the second run took over env 0
    finally:
        api.kill()


@pytest.mark.parametrize("restart", [True, False], ids=["restarted", "dead for good"])
def test_a_killed_worker_with_a_minimum_share_never_stalls_training(tmp_path, restart):
    """SIGKILL a worker that is owed half of every batch: training goes on, and nothing comes twice.

    Restarted with its --worker-id, it takes over its registration (the API's lease is made
    far longer than this test here, so only the takeover can keep batches coming); without
    takeover the dead registration stays owed its share and no batch forms again. Dead for
    good, its share lapses with the API's default lease (tests/test_api_lease.py counts how soon).
    """
    api = ServerProcess(tmp_path / "api.sqlite", args=["--env-lease", "3600"] if restart else []).start()
    a = b = None
    try:
        trainer = TrainerClient(api.url)
        trainer.register({**ATROPOS_REGISTRATION, "batch_size": 8})
        a_args = ("--min-batch-allocation", "0.5", "--max-batches-offpolicy", "1")
        a = start_serve(api.url, tmp_path / "a", *a_args)
        b = start_serve(api.url, tmp_path / "b", "--worker-id", "w2", "--max-batches-offpolicy", "1")
        seen = Pulled()
        pull(trainer, 4, seen, attempts=900)
        assert len(seen) >= 4
        os.kill(a.pid, signal.SIGKILL)
        a.wait(timeout=30)
        if restart:
            a = start_serve(api.url, tmp_path / "a", *a_args)
        pull(trainer, len(seen) + 8, seen, attempts=1200)
        assert len(seen) >= 12, f"training stalled: {len(seen)} groups"
        assert len({group_key(g) for g in seen}) == len(seen)  # no group reached the trainer twice
        if restart:
            ids = _registered_env_ids(tmp_path / "a")
            assert len(ids) == 2 and ids[0] == ids[1]
    finally:
        _kill(a, b, api)


def test_the_off_policy_bound_holds_between_polls(tmp_path):
    """--max-batches-offpolicy 1 with batches of 8 and groups of 4: never more than 2 groups ahead.

    The trainer takes nothing, so everything the worker plays stays queued; the count is
    checked after the worker has polled the API three more times (counted in the API's
    access log), each a chance for a leaky bound to queue more.
    """
    api = ServerProcess(tmp_path / "api.sqlite", args=["--log-level", "info", "--access-log"]).start()
    serve = None

    def worker_polls() -> int:
        return sum("GET /status-env" in line for line in api.log.read_text().splitlines())

    try:
        trainer = TrainerClient(api.url)
        trainer.register({**ATROPOS_REGISTRATION, "batch_size": 8})
        assert trainer.get_batch() is None
        serve = start_serve(api.url, tmp_path / "w", "--max-batches-offpolicy", "1")
        poll_until(lambda: trainer.status().queue_size >= 2, attempts=600, what="two groups queued")
        assert trainer.status().queue_size == 2
        polled = worker_polls()
        poll_until(lambda: worker_polls() >= polled + 3, attempts=600, what="three more polls by the worker")
        out = stop_process(serve)
        assert serve.returncode == 0, out
        stopped = metrics_rows(tmp_path / "w")[-1]
        assert trainer.status().queue_size == 2 and stopped["sent"] == 2, (trainer.status(), stopped)
    finally:
        _kill(serve, api)


def test_two_workers_on_one_out_folder_are_refused(tmp_path):
    """Their outbox and place in the deal stream belong to one process: the second exits with one line."""
    api = ServerProcess(tmp_path / "api.sqlite").start()  # no trainer: the first worker waits to register
    first = second = None
    try:
        first = start_serve(api.url, tmp_path / "w")
        def first_holds_its_outbox() -> bool:
            assert first.poll() is None, first.communicate()[0]
            return (tmp_path / "w" / "outbox.sqlite-wal").exists()

        poll_until(first_holds_its_outbox, attempts=600, what="the first worker's open outbox")
        second = start_serve(api.url, tmp_path / "w")
        out, _ = second.communicate(timeout=60)
        assert second.returncode == 2 and "another environment worker process is using" in out, out
        assert "Traceback" not in out and first.poll() is None
    finally:
        _kill(first, second, api)


def test_a_damaged_place_in_the_deal_stream_is_one_line(tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "serve_state.json").write_text("{not json")
    serve = start_serve("http://127.0.0.1:9", tmp_path / "w", "--register-timeout", "1")
    out, _ = serve.communicate(timeout=60)
    assert serve.returncode == 2 and "serve_state.json" in out and "Traceback" not in out, out


@pytest.mark.embedded
def test_a_trainer_gets_exactly_the_rollout_credit_the_worker_computed(tmp_path):
    """`serve --credit step-rollouts` computes the reward-only credit in the worker (with its own
    fixed model, so the credit is of that policy); a trainer pulling the groups reads exactly
    those per-token advantages: on each forced call's action word p(a) * (Q^(a) - V_p), with
    the estimates Q^ the group records."""
    from blackjack_rl.contract.tokens import trained_spans
    from blackjack_rl.train.groups import read_group

    api = ServerProcess(tmp_path / "api.sqlite").start()
    try:
        trainer = TrainerClient(api.url)
        trainer.register({**ATROPOS_REGISTRATION, "batch_size": 4})
        serve = popen_cli("serve", "--api-url", api.url, "--out", str(tmp_path / "w"), "--quiet", "--worker-id", "w1",
                          "--seed", "5", "--credit", "step-rollouts", "--group-size", "0", "--rollouts", "4",
                          "--starts", "uniform", "--decisions", "first", "--format-weight", "0", "--max-groups", "4")
        seen = Pulled()
        pull(trainer, 4, seen, attempts=3000)
        out, _ = serve.communicate(timeout=600)
        assert serve.returncode == 0, out
        assert len(seen) >= 4
        nonzero = 0
        for g in seen:
            first = g["episodes"][0]
            q, p = first["q_estimate"], first["p_call"]
            assert first["rollouts"] == 4 and g["generation_params"]["rollout_continuation"] == "history"
            v = p["hit"] * q["hit"] + p["stick"] * q["stick"]
            typed = read_group(g)
            assert typed.advantages == g["advantages"]  # what the trainer trains on is what was sent
            for row, masks, record in zip(typed.advantages, typed.masks, g["episodes"]):
                (start, end), = trained_spans(masks)
                credit = [a for a in row[start:end] if a != 0.0]
                expected = p[record["action"]] * (q[record["action"]] - v)
                assert all(c == pytest.approx(expected, rel=1e-9, abs=1e-15) for c in credit)
                assert bool(credit) == (expected != 0.0), (credit, expected)
                nonzero += bool(credit)
        assert nonzero  # some decision's two calls were valued apart
    finally:
        api.kill()


def test_serve_scores_its_credit_against_its_own_policy(tmp_path, solution, vocab_chat):
    """`serve --fidelity-every N` logs the credit of each N groups it sent against A^pi of the
    worker's policy (here the random bot's, exact): the same scores as the groups the trainer
    pulled give against that policy in-process."""
    import asyncio

    from blackjack_rl.jobs.fidelity import PROBE_BUDGET, PROBE_WIDTH, exact_fidelity, samples_of
    from blackjack_rl.policies.bots import RandomBot
    from blackjack_rl.rollout.players import Player
    from blackjack_rl.train.groups import read_group

    api = ServerProcess(tmp_path / "api.sqlite").start()
    try:
        trainer = TrainerClient(api.url)
        trainer.register({**ATROPOS_REGISTRATION, "batch_size": 4})
        serve = start_serve(api.url, tmp_path / "w", "--scoring", "outcome", "--max-groups", "6",
                            "--fidelity-every", "6")
        seen = Pulled()
        pull(trainer, 6, seen)
        out, _ = serve.communicate(timeout=300)
        assert serve.returncode == 0, out
    finally:
        api.kill()
    rows = [r for r in metrics_rows(tmp_path / "w") if r["kind"] == "fidelity"]
    assert len(rows) == 1 and rows[0]["policy"] == "worker" and rows[0]["groups"] == 6
    logged = rows[0]["scores"]["all"]
    player = Player(RandomBot(), vocab_chat, solution)
    groups = [read_group(g) for g in seen]
    here = asyncio.run(exact_fidelity(samples_of(groups, player, True), player, budget=PROBE_BUDGET,
                                      target_width=PROBE_WIDTH)).scores["all"]
    assert logged["decisions"] == here.decisions > 6
    for name in ("sign_weighted", "sign_clear", "correlation", "bias"):
        assert logged[name] == pytest.approx(getattr(here, name), abs=1e-12), name


def test_serve_refuses_fidelity_for_a_policy_without_probabilities(tmp_path, gguf_path):
    proc = run_cli("serve", "--policy", "openai", "--base-url", "http://127.0.0.1:9/v1", "--model", "m",
                   "--tokenizer", str(gguf_path),
                   "--fidelity-every", "4", "--out", str(tmp_path / "w"), "--api-url", "http://127.0.0.1:9",
                   cwd=tmp_path, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--fidelity-every needs the policy's probabilities" in proc.stderr.strip().splitlines()[-1]
