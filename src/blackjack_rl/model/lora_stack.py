"""A fresh LoRA adapter trained over an earlier one, saved as one adapter over the base model.

Why train a fresh adapter instead of continuing the old one (`--init-adapter`): the factors of a
trained adapter are aligned with what it learned, and a fresh Adam steps every parameter at the
learning rate whatever its gradient's size. Measured on SmolLM2-135M (docs/training/): continuing
the format-trained adapter, the shared hit/stick preference swung from P(hit) 0.94 to 0.29 in three
steps, in every hand together. A fresh adapter (B = 0) over the folded weights starts where the
old one ended and, at lr 1e-3 after a warm-up, learned the decision faster than the continued one
at lr 3e-4; it still swung first (0.86 -> 0.17 -> 0.69), and so did SGD, so the swing comes from
the gradient itself, not from the old factors (docs/training/README.md, the stacked-adapter run).

Why save one adapter: llama.cpp's `--lora`, the GGUF export and `--policy hf --model-path ADAPTER`
all take a single adapter over the base model. Two LoRA updates of the same weight add, and
s1 B1 A1 + s2 B2 A2 = [s1 B1, s2 B2] [A1; A2], so the sum is one adapter of rank r1 + r2 with
scale 1 (alpha = rank), exactly.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from blackjack_rl.model.base_ref import CONFIG, FIELD, check_base, lora_config, write_base_reference

WEIGHTS = "adapter_model.safetensors"


def adapter_files(path: str | Path) -> tuple[Path, Path]:
    """The weights and config of a saved adapter, or one clear error."""
    path = Path(path)
    if not path.exists():
        from blackjack_rl.trained import names

        raise FileNotFoundError(f"no saved adapter at {path} (shipped adapters, by name: {', '.join(names())})")
    weights, config = path / WEIGHTS, path / CONFIG
    if not weights.is_file() or not config.is_file():
        raise FileNotFoundError(f"{path} holds no LoRA adapter (no {WEIGHTS} and {CONFIG}); pass the adapter/ "
                                "folder of a LoRA run or one of its checkpoints")
    return weights, config


def fold_adapter(model: Any, path: str | Path, base: str | Path | None = None) -> Any:
    """`model` (plain, not yet wrapped, loaded from `base`; None: the embedded GGUF) with the saved
    adapter in `path` added into its weights; one clear error if it was trained on another base."""
    from peft import PeftModel

    adapter_files(path)
    check_base(path, base)
    return PeftModel.from_pretrained(model, str(path), config=lora_config(path)).merge_and_unload()


def lora_scale(config: dict[str, Any]) -> float:
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError("adapters with per-module ranks or alphas (rank_pattern, alpha_pattern) cannot be stacked")
    r = int(config["r"])
    return float(config["lora_alpha"]) / (math.sqrt(r) if config.get("use_rslora") else r)


def _modules(weights: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """(A, B) of each adapted module, by the module's key prefix."""
    out = {}
    for key, a in weights.items():
        if key.endswith(".lora_A.weight"):
            prefix = key[: -len(".lora_A.weight")]
            b = weights.get(prefix + ".lora_B.weight")
            if b is None:
                raise ValueError(f"the adapter has lora_A but no lora_B for {prefix}")
            out[prefix] = (a, b)
    return out


def stacked_weights(parts: list[tuple[dict[str, Any], float]]) -> dict[str, Any]:
    """One adapter's weights, scale 1, equal to the sum of `parts` ((weights, scale) each).

    A module that only some parts adapt gets zero rows (A) and columns (B) for the others, so every
    module has the same rank, as one LoRA config needs.
    """
    import torch

    modules = [_modules(w) for w, _ in parts]
    ranks = [next(iter(m.values()))[0].shape[0] if m else 0 for m in modules]
    out: dict[str, Any] = {}
    for prefix in sorted(set().union(*modules)):
        shape = next(m[prefix] for m in modules if prefix in m)
        n_in, n_out = shape[0].shape[1], shape[1].shape[0]
        a_rows, b_cols = [], []
        for m, r, (_, scale) in zip(modules, ranks, parts):
            if prefix in m:
                a, b = m[prefix]
                a_rows.append(a)
                b_cols.append(b * scale)
            else:
                a_rows.append(torch.zeros(r, n_in, dtype=shape[0].dtype))
                b_cols.append(torch.zeros(n_out, r, dtype=shape[1].dtype))
        out[prefix + ".lora_A.weight"] = torch.cat(a_rows, dim=0).contiguous()
        out[prefix + ".lora_B.weight"] = torch.cat(b_cols, dim=1).contiguous()
    return out


def stacked_config(configs: list[dict[str, Any]]) -> dict[str, Any]:
    """The LoRA config of the stack: the last part's, with the summed rank, scale 1 and the union
    of the adapted modules."""
    out = dict(configs[-1])
    rank = sum(int(c["r"]) for c in configs)
    targets: set[str] = set()
    for c in configs:
        t = c.get("target_modules")
        if isinstance(t, str):
            raise ValueError("adapters whose target_modules is a pattern cannot be stacked")
        targets |= set(t or [])
        if c.get("modules_to_save"):
            raise ValueError("adapters with modules_to_save (fully trained modules) cannot be stacked")
    layers = [c.get("layers_to_transform") for c in configs]
    out.update(r=rank, lora_alpha=float(rank), use_rslora=False, target_modules=sorted(targets),
               layers_to_transform=None if any(x is None for x in layers)
               else sorted({int(i) for x in layers for i in ([x] if isinstance(x, int) else x)}))
    return out


def save_lora(model: Any, out: str | Path, over: str | Path | None = None, base: str | Path | None = None) -> None:
    """Save `model`'s (peft) adapter; with `over`, as the stack over that adapter. Its config names
    `base` (the model the run started from; None: the embedded GGUF) portably (`base_ref`)."""
    if over is None:
        model.save_pretrained(str(out))
    else:
        save_stacked(model, over, out)
    write_base_reference(out, base)


def save_stacked(model: Any, base: str | Path, out: str | Path) -> None:
    """Save `model`'s (peft) adapter, trained over the adapter in `base` folded in, as one adapter
    over the original base model. The fresh adapter is written aside first, so a folder holding
    the final files always holds the whole stack."""
    from safetensors.torch import load_file, save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fresh = out / ".fresh"
    model.save_pretrained(str(fresh))
    parts, configs = [], []
    for folder in (base, fresh):
        weights, config = adapter_files(folder)
        configs.append({k: v for k, v in json.loads(config.read_text(encoding="utf-8")).items() if k != FIELD})
        parts.append((load_file(str(weights)), lora_scale(configs[-1])))
    tmp = out / (WEIGHTS + ".tmp")
    save_file(stacked_weights(parts), str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS)
    tmp = out / (CONFIG + ".tmp")
    tmp.write_text(json.dumps(stacked_config(configs), indent=2) + "\n", encoding="utf-8")
    tmp.replace(out / CONFIG)
    shutil.rmtree(fresh, ignore_errors=True)
