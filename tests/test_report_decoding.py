"""Constrained decoding on servers (structured output) and the report saying which mode produced it."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest

from blackjack_rl.rollout.episodes import play_episode
from blackjack_rl.game.table import Rules, Table
from blackjack_rl.policies.openai_chat import OpenAIChatPolicy
from blackjack_rl.policies.structured import CALL_SCHEMA, STRUCTURED_OUTPUT_MODES, structured_output_fields
from blackjack_rl.contract.protocol import parse_action
from blackjack_rl.policies.sampling import Sampling
from blackjack_rl.report.modes import decoding_mode
from canned_server import CannedServer, chat_answer
from helpers import CLI


def test_each_server_kind_gets_its_documented_request_fields():
    assert structured_output_fields("json_schema") == {"response_format": {
        "type": "json_schema", "json_schema": {"name": "take_action", "strict": True, "schema": CALL_SCHEMA}}}
    assert structured_output_fields("json_object") == {"response_format": {"type": "json_object", "schema": CALL_SCHEMA}}
    assert structured_output_fields("structured_outputs") == {"structured_outputs": {"json": CALL_SCHEMA}}
    assert structured_output_fields("guided_json") == {"guided_json": CALL_SCHEMA}
    forced = structured_output_fields("tool_choice")
    assert forced["tool_choice"] == {"type": "function", "function": {"name": "take_action"}} and forced["tools"]
    with pytest.raises(ValueError, match="json_schema"):
        structured_output_fields("grammar")
    # strict mode (OpenAI) needs every property required and no extra ones, at every level
    assert CALL_SCHEMA["additionalProperties"] is False and set(CALL_SCHEMA["required"]) == {"name", "arguments"}
    assert CALL_SCHEMA["properties"]["arguments"]["additionalProperties"] is False


def test_the_only_answers_the_schema_allows_are_valid_calls():
    for action in ("hit", "stick"):
        parsed = parse_action(json.dumps({"name": "take_action", "arguments": {"action": action}}))
        assert parsed.valid and parsed.action == (1 if action == "hit" else 0)


@pytest.mark.parametrize("mode", STRUCTURED_OUTPUT_MODES)
def test_structured_output_reaches_the_server_and_is_reported(mode, solution, vocab_chat):
    """A stand-in for a GPU server (vLLM, a hosted API), checking each request as their docs describe it."""
    call = {"name": "take_action", "arguments": {"action": "stick"}}
    if mode == "tool_choice":
        message = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "take_action", "arguments": json.dumps(call["arguments"])}}]}
    else:
        message = {"role": "assistant", "content": json.dumps(call)}

    with CannedServer(chat_answer(message)) as server:
        policy = OpenAIChatPolicy(server.url, "m", structured_output=mode)

        async def main():
            try:
                return await play_episode(Table(Rules()), policy, vocab_chat, solution, 7)
            finally:
                await policy.aclose()

        ep = asyncio.run(asyncio.wait_for(main(), 60))
    seen = [json.loads(body) for body in server.bodies]
    for body in seen:
        for key, value in structured_output_fields(mode).items():
            assert body[key] == value
    assert seen and ep.status == "finished" and ep.decisions[0].action == "stick"
    params = policy.generation_params()
    assert params["constrained"] and params["structured_output"] == mode
    assert decoding_mode(params)["kind"] == "constrained"
    plain = OpenAIChatPolicy("http://server.test/v1", "m").generation_params()
    assert decoding_mode(plain)["kind"] == "unconstrained"


@pytest.mark.embedded
def test_a_real_server_constrained_by_schema_only_answers_valid_calls(llama_server, solution, vocab_chat):
    """llama-cpp-python's server takes `response_format: json_object` with a schema and turns it into a grammar."""
    policy = OpenAIChatPolicy(llama_server, "smollm2", sampling=Sampling(max_tokens=48), structured_output="json_object",
                              timeout=60)

    async def main():
        try:
            return [await play_episode(Table(Rules()), policy, vocab_chat, solution, seed) for seed in range(2)]
        finally:
            await policy.aclose()

    episodes = asyncio.run(main())
    for ep in episodes:
        assert ep.status == "finished", (ep.status, ep.invalid_reason, ep.error, ep.messages[-1])
        assert all(d.action is not None for d in ep.decisions)


@pytest.mark.embedded
@pytest.mark.slow  # whole commands on the embedded model
def test_the_report_of_the_embedded_model_says_it_was_constrained(tmp_path):
    """Two real episodes through `evaluate --constrained`, the report opened in Chromium."""
    from blackjack_rl.report.chromium import browser_context

    proc = subprocess.run([*CLI, "evaluate", "--episodes", "2", "--max-tokens", "40", "--constrained", "--quiet",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["invalid"]["rate"] == 0.0 and metrics["policy"]["constrained"]
    with browser_context() as context:
        page = context.new_page()
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto((tmp_path / "report.html").as_uri())
        assert errors == []
        assert page.get_attribute("#mode", "data-mode") == "constrained"
        assert "restricted to the two valid calls" in page.inner_text("#mode") and "SmolLM2" in page.inner_text("h1")
        assert page.inner_text('[data-metric="mean_reward.mean"] >> nth=0') == f"{metrics['mean_reward']['mean']:+.4f}"
        assert "constrained decoding makes them impossible" in page.inner_text("#invalid")
