"""How the answers were produced, in words: a constrained run cannot write an invalid call,
so its numbers mean something different from an unconstrained one and every page says which."""

from __future__ import annotations

from typing import Any

from blackjack_rl.policies.structured import MODE_TEXT

SCRIPTED = ("optimal", "random", "always_stick", "")  # bots name themselves; threshold bots "threshold-N"


def policy_name(params: dict[str, Any]) -> str:
    """Who played, as every table and page titles it: the model, and the adapter it played with."""
    name = str(params.get("model") or params.get("policy") or "unknown policy")
    if not params.get("lora"):
        return name
    fold = f" (folded, {params['lora_fold']})" if params.get("lora_fold") else ""
    return f"{name} + LoRA {params['lora']}{fold}"


def decoding_mode(params: dict[str, Any]) -> dict[str, str]:
    """{"kind": "constrained" | "unconstrained" | "scripted", "text": ...} for a run's generation_params."""
    policy = str(params.get("policy") or "")
    if policy in SCRIPTED or policy.startswith("threshold"):
        return {"kind": "scripted", "text": f"scripted bot ({policy}): no model, no sampling"}
    if params.get("constrained"):
        if policy == "embedded":
            return {"kind": "constrained",
                    "text": "constrained decoding: tokens restricted to the two valid calls (every answer is a valid call)"}
        mode = params.get("structured_output")
        if mode:
            return {"kind": "constrained", "text": f"constrained decoding: {MODE_TEXT.get(mode, mode)}"}
        return {"kind": "constrained", "text": "constrained decoding"}
    return {"kind": "unconstrained", "text": "unconstrained sampling: the model writes its call freely"}


def short_mode(params: dict[str, Any]) -> str:
    kind = decoding_mode(params)["kind"]
    return {"constrained": "constrained", "unconstrained": "unconstrained", "scripted": "scripted"}[kind]
