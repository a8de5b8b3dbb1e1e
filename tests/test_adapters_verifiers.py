"""The verifiers adapter, run by verifiers' own `vf-eval` against the embedded GGUF on llama.cpp's server."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx

import pytest

vf = pytest.importorskip("verifiers", reason="the verifiers extra is not installed (pip install -e '.[verifiers]')")
pytest.importorskip("blackjack_rl_env", reason="the environment package is not installed (pip install -e environments/blackjack_rl_env)")

from helpers import free_port, poll_until  # noqa: E402

from blackjack_rl.env import BlackjackEnv, EnvSettings  # noqa: E402
from blackjack_rl.rollout.runner import eval_seeds  # noqa: E402
from blackjack_rl.game.table import Rules  # noqa: E402
from blackjack_rl.game.solver import solve  # noqa: E402

VF_EVAL = str(Path(sys.executable).with_name("vf-eval"))


def replay(seed: int, completion: list[dict], settings: EnvSettings) -> float:
    """Our own loop on the same answers: each assistant message is one answer."""
    env = BlackjackEnv(solve(Rules()), settings)
    env.reset(seed)
    for message in completion:
        if message["role"] == "assistant" and not env.done:
            env.step(message.get("content") or "", message.get("tool_calls") or None)
    if not env.done:
        env.truncate("rollout_ended")
    return env.play.score


def test_load_environment_is_a_multiturn_env_with_our_deals():
    import blackjack_rl_env

    env = blackjack_rl_env.load_environment(num_train_deals=3, num_eval_deals=2, scoring="expected")
    assert isinstance(env, vf.MultiTurnEnv)
    core = BlackjackEnv(solve(Rules()))
    assert [row["info"]["seed"] for row in env.eval_dataset] == list(eval_seeds(2))
    assert [row["prompt"] for row in env.eval_dataset] == [core.reset(s)[0] for s in eval_seeds(2)]
    assert max(row["info"]["seed"] for row in env.dataset) < eval_seeds(1)[0]  # training never sees evaluation deals


def test_eval_defaults_come_from_the_environment_package():
    from verifiers.scripts.eval import get_env_eval_defaults

    assert get_env_eval_defaults("blackjack-rl-env") == {"num_examples": 20, "rollouts_per_example": 3}


@pytest.fixture()
def chat_server(llama_server):
    """llama.cpp's server behind a pass-through that drops `"tool_calls": null`.

    verifiers sends every earlier assistant turn with `tool_calls: null`, which OpenAI and vLLM
    accept and llama-cpp-python's server rejects (HTTP 500); nothing else is changed.
    """
    import uvicorn
    from fastapi import FastAPI, Request, Response

    app = FastAPI()
    upstream = httpx.AsyncClient(base_url=llama_server, timeout=300)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        for message in body.get("messages", []):
            if message.get("tool_calls", ()) is None:
                del message["tool_calls"]
        answer = await upstream.post("/chat/completions", json=body)
        return Response(answer.content, answer.status_code, media_type="application/json")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    poll_until(lambda: server.started, attempts=600, interval_s=0.05, what="the proxy in front of llama_cpp.server")
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.mark.embedded
@pytest.mark.slow
def test_vf_eval_plays_through_llama_cpp_and_its_rewards_are_ours(chat_server, tmp_path):
    args = {"num_train_deals": 2, "num_eval_deals": 2, "scoring": "expected", "format_bonus": 0.5, "invalid_retries": 1}
    proc = subprocess.run(
        [VF_EVAL, "blackjack-rl-env", "-m", "smollm2", "-b", chat_server, "-k", "BLACKJACK_TEST_KEY",
         "-n", "2", "-r", "2", "-t", "32", "-T", "1.0", "-c", "2", "-s", "-d", "-o", str(tmp_path), "-a", json.dumps(args)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "BLACKJACK_TEST_KEY": "unused"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [results] = list(tmp_path.glob("evals/*/*/results.jsonl"))
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(rows) == 4 and [row["error"] for row in rows] == [None] * 4
    assert any(len([m for m in row["completion"] if m["role"] == "assistant"]) > 1 for row in rows)  # re-prompted
    assert {row["info"]["seed"] for row in rows} == set(eval_seeds(2))
    settings = EnvSettings(scoring="expected", format_bonus=0.5, invalid_retries=1)
    for row in rows:
        assert row["reward"] == row["episode_score"] == replay(row["info"]["seed"], row["completion"], settings)
