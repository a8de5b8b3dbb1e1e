"""Checkpoints (--save-every) and resuming from one (--resume).

A checkpoint is the model as a run saves it (LoRA: the adapter only) plus trainer_state.pt:
the trained parameters, the optimizer, the step, and the random states of the deal stream and
torch, so a resumed run takes the very step the whole run would have taken.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from blackjack_rl.contract.tokens import HFTokenizer
from blackjack_rl.model.base_ref import CONFIG, check_base
from blackjack_rl.model.io import export_model
from blackjack_rl.model.lora_stack import adapter_files, save_lora
from blackjack_rl.train.sources import GroupSource

STATE = "trainer_state.pt"


def adapter_id(path: Path | None) -> str | None:
    """What a run trained over, by content: a copied adapter folder still resumes."""
    if path is None:
        return None
    return hashlib.sha256(adapter_files(path)[0].read_bytes()).hexdigest()[:16]


def trainer_state(step: int, optimizer: torch.optim.Optimizer, source: GroupSource,
                  base_adapter: Path | None) -> dict[str, Any]:
    """What resuming after `step` needs, but the parameters (`save` adds them)."""
    return {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "deals": source.get_state(),
        "torch_rng": torch.get_rng_state(),
        "base_adapter": adapter_id(base_adapter),
    }


def save(model: Any, tokenizer: HFTokenizer, path: Path, state: dict[str, Any] | None = None,
         over: Path | None = None, base: str | None = None) -> None:
    """The model (LoRA: the adapter only, stacked `over` a --base-adapter, over `base`: the
    --model-path the run started from, None for the embedded GGUF), and with `state` what resuming
    needs, with the trained parameters."""
    if hasattr(model, "peft_config"):
        save_lora(model, path, over, base)
        tokenizer.tok.save_pretrained(str(path))
    else:
        export_model(model, tokenizer, path)
    if state is not None:
        trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        tmp = path / (STATE + ".tmp")
        torch.save({**state, "parameters": trained}, tmp)
        tmp.replace(path / STATE)


def check_resumable(path: str | Path) -> Path:
    """The trainer-state file of the checkpoint in `path`; asked before the model loads (seconds)."""
    file = Path(path) / STATE
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint with trainer state (no {STATE}); "
                                "checkpoints are written by --save-every")
    return file


def load_trainer_state(path: Path) -> dict[str, Any]:
    return torch.load(check_resumable(path), weights_only=False)


def restore(path: Path, model: Any, optimizer: torch.optim.Optimizer, source: GroupSource, *,
            base: str | None, base_adapter: Path | None) -> int:
    """Load the checkpoint in `path` into the run: its parameters, optimizer, deal stream and torch
    random state. Returns the step it was written after. One clear error for a checkpoint of
    another model, base model or --base-adapter."""
    state = load_trainer_state(path)
    if (Path(path) / CONFIG).is_file():  # a LoRA checkpoint: trained over the same base model?
        check_base(path, base)
    if state.get("base_adapter") != adapter_id(base_adapter):
        raise ValueError(f"{path} was trained over another --base-adapter (or none): resume with the "
                         "--base-adapter it was trained over")
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state["parameters"].items():
            if name not in named:
                raise ValueError(f"{path} does not fit this model: it has no parameter {name}; "
                                 "resume with the same --model-path, --lora and --train-layers")
            named[name].copy_(value)
    optimizer.load_state_dict(state["optimizer"])
    if state.get("deals") is not None:
        source.set_state(state["deals"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])
