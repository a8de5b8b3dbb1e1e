"""What the trajectory API tests post: Atropos registrations and groups shaped like atroposlib's.

The API server processes themselves are in tests/helpers.py.
"""

from __future__ import annotations

from typing import Any

#: What an Atropos trainer posts to /register (every field; Atropos' run-api refuses null).
ATROPOS_REGISTRATION: dict[str, Any] = {
    "wandb_group": "group",
    "wandb_project": "project",
    "batch_size": 8,
    "max_token_len": 512,
    "starting_step": 0,
    "checkpoint_dir": "checkpoints",
    "save_checkpoint_interval": 10,
    "num_steps": 100,
}


def atropos_register_env(group_size: int = 4, name: str = "blackjack", **changes: Any) -> dict[str, Any]:
    """What atroposlib 0.4.0 BaseEnv._register_env posts (min_batch_allocation None by default)."""
    body = {
        "max_token_length": 512,
        "desired_name": name,
        "weight": 1.0,
        "min_batch_allocation": None,
        "group_size": group_size,
    }
    body.update(changes)
    return body


def make_group(n: int = 4, length: int = 12, prompt: int = 5, env_id: int | None = 0, uid: str = "g") -> dict[str, Any]:
    """A valid group shaped like atroposlib's: optional fields as empty lists, our `episodes` extra."""
    tokens, masks, logprobs = [], [], []
    for i in range(n):
        seq = [(7 * i + j) % 50 + 1 for j in range(length)]
        tokens.append(seq)
        masks.append([-100] * prompt + seq[prompt:])
        logprobs.append([1.0] * prompt + [-0.5] * (length - prompt))
    return {
        "tokens": tokens,
        "masks": masks,
        "scores": [1.0 if i % 2 else -1.0 for i in range(n)],
        "inference_logprobs": logprobs,
        "advantages": [],
        "ref_logprobs": [],
        "messages": [],
        "group_overrides": {},
        "overrides": [],
        "images": [],
        "env_id": env_id,
        "episodes": [{"uid": uid, "index": i, "outcome": "win"} for i in range(n)],
    }


def uids(batch_groups: list[dict[str, Any]]) -> list[str]:
    return [g["episodes"][0]["uid"] for g in batch_groups]
