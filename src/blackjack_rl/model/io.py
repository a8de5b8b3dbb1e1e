"""Load the policy into PyTorch (from a GGUF or a saved folder) and export what was trained.

The embedded default is a quantized GGUF. Transformers can dequantize it, but the model it
returns still remembers its GGUF origin, so we rebuild a plain `*ForCausalLM` from its config
and state dict: that one trains and saves like any other. Transformers' GGUF tokenizer
conversion gets SmolLM2's special tokens wrong (its eos comes out as `<|im_start|>`), so the
tokenizer is rebuilt from the GGUF's own vocabulary and merges instead, token-identical to
llama.cpp (the tests compare them), with eos `<|im_end|>` and no BOS added.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from blackjack_rl.contract.tokens import HFTokenizer, embedded_model_path
from blackjack_rl.model.forward import causal_lm, check_architecture
from blackjack_rl.model.base_ref import check_base, resolve_base
from blackjack_rl.model.lora_stack import adapter_files, fold_adapter, save_lora

log = logging.getLogger(__name__)


def build_hf_tokenizer(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write a Hugging Face tokenizer folder rebuilt from a GGUF's byte-level BPE vocabulary.

    Needs only `gguf` and `tokenizers` (no torch, no hub). Mirrors llama.cpp's "smollm"
    pre-tokenizer: digits split one by one, then GPT-2's byte-level split.
    """
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    reader = gguf.GGUFReader(str(gguf_path))

    def field(name: str) -> Any:
        if name not in reader.fields:
            raise ValueError(f"{gguf_path} has no {name} in its metadata; it needs a byte-level BPE vocabulary")
        return reader.fields[name].contents()

    if field("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"{gguf_path}: only byte-level BPE ('gpt2') GGUF vocabularies can be rebuilt")
    tokens: list[str] = field("tokenizer.ggml.tokens")
    types: list[int] = field("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    # token types 3 (control) and 4 (user-defined) are special: never split, never merged
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)])

    def token(key: str) -> str | None:
        return tokens[int(field(key))] if key in reader.fields else None

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=token("tokenizer.ggml.eos_token_id"),
        bos_token=token("tokenizer.ggml.bos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        chat_template=field("tokenizer.chat_template"),
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


def load_model(path: str | Path | None = None) -> tuple[Any, HFTokenizer]:
    """A float32 causal LM and its tokenizer, from a GGUF file (None: the embedded
    SmolLM2-135M-Instruct) or from a folder saved by `export_model` / `save_pretrained`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path) if path else embedded_model_path()
    if path.is_file() and path.suffix == ".gguf":
        cached = _converted_dir(path)
        if (cached / "config.json").is_file() and (cached / "model.safetensors").is_file():
            model, tokenizer = load_model(cached)
            tokenizer.name = path.name
            return model, tokenizer
        quantized = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        model = AutoModelForCausalLM.from_config(quantized.config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
        if unexpected or [k for k in missing if "lm_head" not in k]:
            raise ValueError(f"{path}: tensors do not match the architecture (missing {missing}, unexpected {unexpected})")
        model.tie_weights()
        del quantized
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = HFTokenizer(str(build_hf_tokenizer(path, tmp)))
        _save_converted(model, tokenizer, cached)
    elif path.is_dir() and (path / "adapter_config.json").is_file():
        return load_adapter(path)
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: pass a GGUF file or a folder saved by `blackjack-rl train`")
        AutoConfig.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        tokenizer = HFTokenizer(str(path))
    else:
        raise FileNotFoundError(f"no model at {path}: pass a .gguf file or a model folder")
    _forget_gguf_origin(model)
    model.eval()
    check_architecture(model)
    tokenizer.name = path.name
    return model, tokenizer


def load_adapter(path: Path) -> tuple[Any, HFTokenizer]:
    """A LoRA adapter folder saved by `train --lora` (OUT/adapter): the base model it names
    (`base_ref`: the embedded GGUF, or the --model-path it was trained on), checked by content
    hash, with the adapter folded in."""
    try:
        import peft  # noqa: F401
    except ImportError as exc:
        raise ImportError("a LoRA adapter needs peft: pip install 'blackjack-rl[train]'") from exc
    base = resolve_base(path)
    check_base(path, base)  # before the base model loads
    model, tokenizer = load_model(base)
    model = fold_adapter(model, path, base)
    model.eval()
    tokenizer.name = path.name
    return model, tokenizer


def save_adapter(model: Any, tokenizer: HFTokenizer, out_dir: str | Path, base: str | None,
                 over: str | Path | None = None) -> Path:
    """The LoRA adapter alone (a few MB), loadable by `--policy hf --model-path OUT_DIR`; with
    `over`, stacked on the adapter it was trained over (`lora_stack`). `base` is the model the run
    started from (None: the embedded GGUF), named by name and content hash (`base_ref`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_lora(model, out, over, base)
    return out


# End-of-generation markers llama.cpp also stops on, when a vocabulary has them as special tokens.
END_MARKERS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def _converted_dir(gguf_path: Path) -> Path:
    """Where a dequantized GGUF is kept: converting takes ~30 s (transformers parses the file
    twice), loading the saved safetensors well under one."""
    stat = gguf_path.stat()
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "blackjack-rl" / "dequantized"
    return root / f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}"


def _save_converted(model: Any, tokenizer: HFTokenizer, out: Path) -> None:
    try:
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        export_model(model, tokenizer, tmp)
        tmp.replace(out)
    except OSError as exc:  # a read-only home only costs the next load its conversion
        log.warning("could not cache the dequantized model in %s: %s", out, exc)


def stop_ids(model: Any, tokenizer: HFTokenizer, end_of_turn_ids: list[int]) -> set[int]:
    """Tokens that end an answer: the chat template's end of turn, every eos the model
    declares, and the usual end-of-text markers (as llama.cpp's end-of-generation set)."""
    ids = set(end_of_turn_ids)
    special = set(tokenizer.tok.all_special_tokens) | set(getattr(tokenizer.tok, "added_tokens_encoder", {}))
    for marker in END_MARKERS:
        if marker in special:
            ids.add(int(tokenizer.tok.convert_tokens_to_ids(marker)))
    for source in (causal_lm(model).config, getattr(causal_lm(model), "generation_config", None)):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.tok.eos_token_id is not None:
        ids.add(int(tokenizer.tok.eos_token_id))
    return ids


def add_lora(model: Any, rank: int, alpha: float, layers: list[int] | None = None) -> Any:
    """Wrap `model` with LoRA adapters on every attention and MLP projection (peft),
    of the given decoder layers only when `layers` is set."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ImportError("LoRA needs peft: pip install 'blackjack-rl[train]'") from exc
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        layers_to_transform=layers,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def load_adapter_weights(model: Any, path: str | Path) -> None:
    """Start `model`'s LoRA adapters from a saved adapter (OUT/adapter, or a checkpoint) of the
    same shape, so one adapter can be trained in several runs and still be a single adapter
    over the base model (what the GGUF export and llama.cpp's --lora need)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    if not hasattr(model, "peft_config"):
        raise ValueError("--init-adapter starts LoRA adapters from a saved one: it needs --lora")
    file, _ = adapter_files(path)
    saved = load_file(str(file))
    adapters = {n for n, _ in model.named_parameters() if "lora_" in n}
    misfit = (f"the adapter in {path} does not fit this model: use the --lora-rank and --train-layers it was "
              "trained with")
    try:
        result = set_peft_model_state_dict(model, saved)
    except RuntimeError as exc:  # torch's size mismatch, one line per tensor
        raise ValueError(misfit) from exc
    if result.unexpected_keys or adapters & set(result.missing_keys):
        raise ValueError(f"{misfit} ({len(saved)} saved tensors for {len(adapters)} adapter weights here)")


def merged(model: Any) -> Any:
    """A plain model with LoRA adapters folded in (a copy; the training model is untouched)."""
    if not hasattr(model, "merge_and_unload"):
        return model
    import copy

    return copy.deepcopy(model).merge_and_unload()


def _forget_gguf_origin(model: Any) -> None:
    """Weights dequantized from a GGUF are plain float32, but transformers still marks the
    model as GGUF-quantized and then refuses to save it: drop the marks."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    if getattr(model, "is_quantized", False):
        model.is_quantized = False


def export_model(model: Any, tokenizer: HFTokenizer, out_dir: str | Path) -> Path:
    """Save safetensors weights, config and tokenizer: a folder `--policy hf --model-path` loads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plain = merged(model)
    _forget_gguf_origin(plain)
    plain.save_pretrained(str(out), safe_serialization=True)
    tokenizer.tok.save_pretrained(str(out))
    return out
