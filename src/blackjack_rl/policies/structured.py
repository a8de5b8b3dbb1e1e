"""Constrained decoding on a server (`--constrained`): the one answer it may give, and how each
kind of server is asked for it. Kept apart from the clients so the settings and the reports
can name the modes without loading an HTTP library."""

from __future__ import annotations

from typing import Any, get_args

from blackjack_rl.config import StructuredOutput
from blackjack_rl.contract.protocol import ACTION_NAMES, TOOL_NAME, TOOLS

# The one answer a constrained server may give: a take_action call as a bare JSON object,
# which the parser accepts as readily as the <tool_call> form.
CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": [TOOL_NAME]},
        "arguments": {
            "type": "object",
            "properties": {"action": {"type": "string", "enum": list(ACTION_NAMES.values())}},
            "required": ["action"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}

# How each kind of server is asked for structured output (request fields, from each server's docs),
# and what each is called in reports.
STRUCTURED_OUTPUT_MODES: tuple[str, ...] = get_args(StructuredOutput)
MODE_TEXT: dict[str, str] = {
    "json_schema": "structured output (response_format json_schema)",
    "json_object": "structured output (response_format json_object with a schema)",
    "structured_outputs": "structured output (vLLM structured_outputs.json)",
    "guided_json": "structured output (vLLM guided_json)",
    "tool_choice": "forced tool call (tool_choice take_action)",
}


def structured_output_fields(mode: str) -> dict[str, Any]:
    """Request fields that make a server emit only a valid call.

    json_schema: OpenAI's `response_format` (OpenAI, vLLM, SGLang, llama.cpp's llama-server);
    json_object: `response_format` type json_object with a `schema` (llama-cpp-python's server);
    structured_outputs: vLLM >= 0.10 `structured_outputs.json`; guided_json: older vLLM;
    tool_choice: a forced call of the named tool (needs native tools on the server).
    """
    if mode == "json_schema":
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": TOOL_NAME, "strict": True, "schema": CALL_SCHEMA}}}
    if mode == "json_object":
        return {"response_format": {"type": "json_object", "schema": CALL_SCHEMA}}
    if mode == "structured_outputs":
        return {"structured_outputs": {"json": CALL_SCHEMA}}
    if mode == "guided_json":
        return {"guided_json": CALL_SCHEMA}
    if mode == "tool_choice":
        return {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": TOOL_NAME}}}
    raise ValueError(f"unknown structured output mode {mode!r}; choose one of {', '.join(STRUCTURED_OUTPUT_MODES)}")
