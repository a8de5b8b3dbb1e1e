"""The verifiers >= 0.4 taskset, run by verifiers 0.4's own `vf-eval` against the embedded GGUF on llama.cpp's server.

verifiers 0.4 cannot share an environment with the 0.3 release the `verifiers` extra pins,
so it lives in a second virtual environment (docs/adapters.md has the commands):
`.venv-vf04` at the repository root, or the one `BLACKJACK_RL_VF04_VENV` names. Without it
the test skips and says so.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from blackjack_rl.env import BlackjackEnv, EnvSettings
from blackjack_rl.game.solver import solve
from blackjack_rl.game.table import Rules
from blackjack_rl.rollout.runner import eval_seeds

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("BLACKJACK_RL_VF04_VENV", ROOT / ".venv-vf04"))
DEALS = 3
SETTINGS = EnvSettings(scoring="expected", format_bonus=0.5, invalid_retries=1)

# llama.cpp's GBNF, passed through verifiers' sampling (it forwards provider keys as they are):
# every answer is a well-formed call or a short sentence without one, so the hands are played
# (hits, sticks, outcomes) and re-prompted, where SmolLM2 alone rarely writes a call.
GRAMMAR = r'''root ::= call | prose
call ::= "<tool_call>\n{\"name\": \"take_action\", \"arguments\": {\"action\": \"" ("hit" | "stick") "\"}}\n</tool_call>"
prose ::= "I will " ("hit" | "stick") "."
'''


def vf04_ready() -> str | None:
    """Why the second environment cannot run the test, or None when it can."""
    if not (VENV / "bin" / "vf-eval").exists():
        return f"no verifiers 0.4 environment at {VENV} (docs/adapters.md: the verifiers >= 0.4 taskset)"
    probe = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('blackjack_rl_taskset') else 1)"
    if subprocess.run([str(VENV / "bin" / "python"), "-c", probe], check=False, capture_output=True).returncode:
        return f"{VENV} lacks the taskset package (pip install -e environments/blackjack_rl_taskset)"
    return None


NOT_READY = vf04_ready()
pytestmark = pytest.mark.skipif(NOT_READY is not None, reason=NOT_READY or "")


def replay(seed: int, answers: list[dict]) -> BlackjackEnv:
    """Our own loop on verifiers' recorded answers: each assistant message is one answer."""
    env = BlackjackEnv(solve(Rules()), SETTINGS)
    env.reset(seed)
    for message in answers:
        if not env.done:
            env.step(message.get("content") or "", message.get("tool_calls") or None)
    if not env.done:
        env.truncate("rollout_ended")
    return env


def run_vf_eval(base_url: str, out: Path) -> subprocess.CompletedProcess:
    """verifiers' own command, as docs/adapters.md gives it, plus the test's grammar and a
    fixed sampling seed. One episode at a time: llama-cpp-python's server interrupts a
    streaming completion when the next request arrives."""
    config = out / "sampling.toml"
    config.write_text(f"[sampling]\nseed = 0\ngrammar = '''{GRAMMAR}'''\n")
    command = [
        str(VENV / "bin" / "vf-eval"), "blackjack-rl-taskset", "-m", "smollm2",
        "--client.base-url", base_url, "--client.api-key-var", "BLACKJACK_TEST_KEY",
        "-n", str(DEALS), "-r", "1", "-c", "1", "--sampling.max-tokens", "48", "--sampling.temperature", "1.0",
        "--env.taskset.scoring", "expected", "--env.taskset.format-bonus", "0.5", "--env.taskset.invalid-retries", "1",
        "--push", "False", "--no-rich", "-o", str(out), "--run.name", "taskset", "@", str(config),
    ]
    # the seat's chat program is a uv script: uv comes from the second environment's bin
    env = {**os.environ, "BLACKJACK_TEST_KEY": "unused", "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("VIRTUAL_ENV", None)
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=900, cwd=out, env=env)


@pytest.mark.embedded
@pytest.mark.slow
def test_vf_eval_04_plays_through_llama_cpp_and_its_rewards_are_ours(llama_server, tmp_path):
    proc = run_vf_eval(llama_server, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    episodes = [json.loads(line) for line in (tmp_path / "taskset" / "traces.jsonl").read_text().splitlines()]
    traces = [trace for episode in episodes for trace in episode["traces"]]
    assert len(traces) == DEALS and all(episode["ok"] for episode in episodes), [e["errors"] for e in episodes]
    assert sorted(t["task"]["data"]["info"]["seed"] for t in traces) == list(eval_seeds(DEALS))

    played = []
    for trace in traces:
        seed = trace["task"]["data"]["info"]["seed"]
        messages = [node["message"] for node in trace["nodes"]]
        assert [m["role"] for m in messages[:2]] == ["system", "user"]  # our prompt, as reset(seed) gives it
        ours = BlackjackEnv(solve(Rules()), SETTINGS).reset(seed)[0]
        assert [m["content"] for m in messages[:2]] == [m["content"] for m in ours]
        env = replay(seed, [m for m in messages if m["role"] == "assistant"])
        # (a) verifiers' reward is our score for the same deal and the same answers
        assert trace["rewards"] == {"episode_score": {"score": env.play.score, "weight": 1.0}}
        assert trace["info"]["blackjack"]["actions"] == [d.action for d in env.play.decisions]
        played.append(env.play)
        # (b) the eval client records no token ids or logprobs (its traces are text: tokens
        # come only from verifiers' vLLM training client), so there is nothing to compare
        assert all(not node.get("token_ids") and not node.get("logprobs") for node in trace["nodes"])
    assert any(d.action is not None for play in played for d in play.decisions)  # hands were played
    assert any(len(play.decisions) > 1 for play in played)  # a hit or a re-prompt: a multi-turn rollout
