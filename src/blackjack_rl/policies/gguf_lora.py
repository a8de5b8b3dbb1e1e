"""A LoRA adapter trained here, as a GGUF adapter that llama.cpp applies to the quantized model.

The embedded policy is the Q4_1 GGUF run by llama.cpp; training runs on its dequantized
weights in torch. A peft adapter over those weights converts to llama.cpp's adapter format
with no loss: the same low-rank matrices, renamed to llama.cpp's tensor names, and for the
query and key projections with their output rows in llama.cpp's rotary order (GGUF stores
those two weights permuted; Hugging Face's loader undoes the permutation, so the adapter was
trained in the other order).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

_MODULES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_KEY = re.compile(r"layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.lora_([AB])\.weight$")


def _rotary_order(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of a query/key projection's output rows (per head, halves interleaved)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def lora_pairs(adapter_dir: str | Path, reader: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(A, B) of each adapted weight of a peft adapter, by the base GGUF's tensor name (`reader`, a
    GGUFReader), with B's rows in the GGUF's order: what a GGUF adapter stores and what folds in."""
    from safetensors.numpy import load_file

    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUFs are supported, this one is {arch}")
    heads = int(reader.fields["llama.attention.head_count"].contents())
    kv_heads = int(reader.fields["llama.attention.head_count_kv"].contents())
    adapter_dir = Path(adapter_dir)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in load_file(str(adapter_dir / "adapter_model.safetensors")).items():
        m = _KEY.search(key)
        if m is None:
            raise ValueError(f"{adapter_dir}: unexpected tensor {key} (only attention and MLP projections convert)")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = value.astype(np.float32)
    out = {}
    for (layer, module), ab in sorted(pairs.items()):
        a, b = ab["A"], ab["B"]  # A: [rank, in], B: [out, rank], as llama.cpp reads lora_a / lora_b
        if module == "self_attn.q_proj":
            b = _rotary_order(b, heads)
        elif module == "self_attn.k_proj":
            b = _rotary_order(b, kv_heads)
        out[f"blk.{layer}.{_MODULES[module]}.weight"] = (np.ascontiguousarray(a), np.ascontiguousarray(b))
    return out


def export_gguf_lora(adapter_dir: str | Path, out_path: str | Path, base_gguf: str | Path | None = None) -> Path:
    """Write `adapter_dir` (a peft LoRA folder saved by `train --lora`) as a GGUF adapter."""
    import gguf

    from blackjack_rl.contract.tokens import embedded_model_path

    adapter_dir = Path(adapter_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    if config.get("use_dora") or config.get("use_rslora"):
        raise ValueError("only plain LoRA adapters convert to llama.cpp (no DoRA, no rsLoRA)")
    reader = gguf.GGUFReader(str(base_gguf or embedded_model_path()))
    pairs = lora_pairs(adapter_dir, reader)

    out = Path(out_path)
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    for name, (a, b) in pairs.items():
        writer.add_tensor(f"{name}.lora_a", a)
        writer.add_tensor(f"{name}.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
