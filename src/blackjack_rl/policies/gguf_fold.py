"""The base GGUF with a LoRA adapter folded into its weights: an adapter with no run-time products.

Why: llama.cpp applies a GGUF adapter (gguf_lora.py) at run time, two extra products per adapted
weight at every token; folding W + scale * B @ A once gives a plain model of the base's shape.

The adapted weights are dequantized (Q4_1 -> float32), the update added in float32 and the sum
written as F16 by default (or f32, or q8_0 with gguf-py's quantizer, ggml's reference one, which is
what llama.cpp's own quantizer runs without an importance matrix). Not back to Q4_1: a trained
update is far smaller than a Q4_1 step, so requantizing snaps most weights back to their old level
(docs/inference.md has the measurements). Every other tensor is copied byte for byte, and every
metadata field (vocabulary, chat template).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from blackjack_rl.contract.tokens import embedded_model_path
from blackjack_rl.model.base_ref import CONFIG, check_base, file_sha256, read_config
from blackjack_rl.model.lora_stack import WEIGHTS, lora_scale
from blackjack_rl.policies.gguf_lora import lora_pairs

if TYPE_CHECKING:
    import gguf

log = logging.getLogger(__name__)

OUT_TYPES = ("f16", "f32", "q8_0")
FOLD_VERSION = 1  # part of the cache key: a change to how folds are made never reuses an old one
FIELD = "blackjack_rl.folded_lora"  # the fold's cache key, written into the GGUF (provenance)


def fold_lora_gguf(adapter_dir: str | Path, base_gguf: str | Path | None, out_path: str | Path,
                   out_type: str = "f16", *, weight: float = 1.0) -> Path:
    """Write `base_gguf` (None: the embedded model) with the peft adapter in `adapter_dir` folded in,
    atomically, to `out_path`; the adapted weights as `out_type`, everything else as it was.

    `weight` scales the update: 0 writes the base with the adapted weights re-encoded as `out_type`,
    the reference that runs the same kernels as the fold (how the tests check a fold exactly)."""
    import gguf

    qtype = _qtype(out_type)
    adapter_dir, base = Path(adapter_dir), Path(base_gguf) if base_gguf else embedded_model_path()
    config = read_config(adapter_dir)
    if config.get("use_dora") or config.get("rank_pattern") or config.get("alpha_pattern") \
            or config.get("fan_in_fan_out") or config.get("modules_to_save"):
        raise ValueError(f"{adapter_dir}: only plain LoRA adapters fold (no DoRA, per-module ranks or alphas, "
                         "fan_in_fan_out or modules_to_save)")
    check_base(adapter_dir, base)
    scale = lora_scale(config) * weight
    reader = gguf.GGUFReader(str(base))
    if reader.endianess != gguf.GGUFEndian.LITTLE:
        raise ValueError(f"{base}: only little-endian GGUFs fold")
    pairs = lora_pairs(adapter_dir, reader)
    if missing := set(pairs) - {t.name for t in reader.tensors}:
        raise ValueError(f"{adapter_dir} adapts weights that {base.name} does not have: {sorted(missing)[:3]}")

    out = Path(out_path)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), reader.fields["general.architecture"].contents())
    try:
        if (alignment := reader.fields.get("general.alignment")) is not None:
            writer.data_alignment = int(alignment.contents())
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name == "general.architecture":
                continue  # written by the writer itself
            kind = field.types[0]
            writer.add_key_value(field.name, field.contents(), kind,
                                 sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
        writer.add_string(FIELD, fold_key(adapter_dir, base, out_type, weight))
        for t in reader.tensors:
            if t.name not in pairs:
                writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
                continue
            a, b = pairs[t.name]
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=True)
            if w.shape != (b.shape[0], a.shape[1]):
                raise ValueError(f"{adapter_dir}: {t.name} is {w.shape} here, the adapter's update {(b.shape[0], a.shape[1])}")
            w += np.float32(scale) * (b @ a)
            writer.add_tensor(t.name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.replace(out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


def fold_key(adapter_dir: str | Path, base_gguf: str | Path, out_type: str, weight: float = 1.0) -> str:
    """sha256 of what a fold depends on: the adapter's weights and config, the base's bytes, the type."""
    digest = hashlib.sha256(f"fold {FOLD_VERSION} {out_type} {weight!r} {file_sha256(base_gguf)}\n".encode())
    for name in (WEIGHTS, CONFIG):
        digest.update(f"{name} {file_sha256(Path(adapter_dir) / name)}\n".encode())
    return digest.hexdigest()


def fold_cache_path(adapter_dir: str | Path, base_gguf: str | Path | None = None, out_type: str = "f16") -> Path:
    """Where the fold of this adapter over this base is kept: named by content, so a retrained
    adapter (or another base) never reuses a stale fold."""
    adapter_dir, base = Path(adapter_dir), Path(base_gguf) if base_gguf else embedded_model_path()
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "blackjack-rl" / "folded"
    key = fold_key(adapter_dir, base, _check_type(out_type))
    return root / f"{base.stem}+{adapter_dir.resolve().name}.{out_type}.{key[:16]}.gguf"


def folded_gguf(adapter: str | Path, base_gguf: str | Path | None = None, out_type: str = "f16") -> Path:
    """The GGUF to load instead of base + `--lora adapter`: `adapter` is a peft folder or a shipped
    adapter's name; folded once (seconds) and kept in ~/.cache/blackjack-rl/folded."""
    from blackjack_rl import trained

    adapter_dir = Path(adapter)
    if not adapter_dir.exists() and (shipped := trained.folder(str(adapter))) is not None:
        adapter_dir = shipped
    if not (adapter_dir / WEIGHTS).is_file() or not (adapter_dir / CONFIG).is_file():
        raise FileNotFoundError(f"no peft LoRA adapter at {adapter} (a folder with {WEIGHTS} and {CONFIG}, "
                                "or a shipped adapter's name): only those fold, not a .gguf adapter")
    path = fold_cache_path(adapter_dir, base_gguf, out_type)
    if path.is_file():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK):
            raise PermissionError(f"{path.parent} is not writable")
    except OSError as exc:  # a read-only cache only costs every load its fold
        log.warning("could not cache the folded model: %s", exc)
        path = Path(tempfile.mkdtemp(prefix="blackjack-rl-fold-")) / path.name
    return fold_lora_gguf(adapter_dir, base_gguf, path, out_type)


def _check_type(out_type: str) -> str:
    if out_type not in OUT_TYPES:
        raise ValueError(f"out_type {out_type!r}: choose one of {', '.join(OUT_TYPES)}")
    return out_type


def _qtype(out_type: str) -> gguf.GGMLQuantizationType:
    import gguf

    return gguf.GGMLQuantizationType[_check_type(out_type).upper()]
