"""Token-exact rollouts from a pool of servers: prompt ids in, sampled ids and their logprobs out.

The chat-completions path sends messages and gets text back, so the trained ids are a
re-tokenization of that text, which can differ from what the model sampled, and it has
no logprobs. Here the episode's own token ids (rendered once, extended turn by turn)
are the prompt, and the reply is built from exactly the ids and logprobs the server
returned. Three server APIs can do that:

- vLLM `POST /v1/completions`: `prompt` as a list of ints, `logprobs: 0` and
  `return_tokens_as_token_ids: true`, so each sampled token comes back as the string
  `"token_id:123"` next to its logprob (or as `token_ids`, where the server adds them).
- SGLang `POST /generate`: `input_ids`, `return_logprob: true`; the ids and logprobs
  come back as `meta_info.output_token_logprobs` = `[[logprob, id, text], ...]`.
- llama.cpp's `llama-server` `POST /completion`: `prompt` as ids, `return_tokens: true`,
  `n_probs: 1`; ids in `tokens`, logprobs in `completion_probabilities`.

llama-cpp-python's server (`python -m llama_cpp.server`) accepts only text prompts
(a list of ints is answered with HTTP 500) and returns token *strings*, never ids, so
it cannot be token-exact; `token_path="auto"` detects that and uses the chat path.
Whatever path is used is fixed once per policy and recorded in `generation_params()`
as `token_path`, so every group says how its ids were produced.
"""

from __future__ import annotations

import asyncio
import logging
import math
import json
from dataclasses import dataclass, replace
from itertools import repeat
from typing import Any, Literal, Protocol, Sequence

import httpx

from blackjack_rl.contract.protocol import TOOLS
from blackjack_rl.contract.tokens import ChatFormat
from blackjack_rl.policies.base import InferenceError, Reply, Turn
from blackjack_rl.policies.chat_body import chat_replies, chat_sampling
from blackjack_rl.policies.pool import ServerPool, affinity_key
from blackjack_rl.policies.sampling import Sampling
from blackjack_rl.policies.structured import CALL_SCHEMA, structured_output_fields

log = logging.getLogger(__name__)

COMPLETIONS_PATH = "completions-token-ids"
CHAT_PATH = "chat-text"
TokenPathSetting = Literal["auto", "completions", "chat"]
ServerApi = Literal["vllm", "sglang", "llamacpp"]


class MalformedAnswer(ValueError):
    """The server answered 200, but not with what its API documents."""


@dataclass(slots=True)
class ServerCompletion:
    """One sampled completion as the server reported it."""

    ids: list[int]
    logprobs: list[float]
    length: bool  # stopped by max_tokens
    stopped_on: int | None | Literal["eos", "other"]  # the stop token when known; "eos": an unnamed EOS


class TokenApi(Protocol):
    """How one server family takes token ids and gives sampled ids and logprobs back."""

    name: str
    path: str
    supports_n: bool

    def body(self, model: str, prompt_ids: Sequence[int], n: int, seed: int, s: Sampling) -> dict[str, Any]: ...

    def samples(self, data: Any) -> list[ServerCompletion]: ...

    def constraint(self, mode: str) -> dict[str, Any]:
        """Request fields that let the model write only a valid call (`--constrained`)."""
        ...


class VLLMApi:
    name, path, supports_n = "vllm", "/v1/completions", True

    def body(self, model: str, prompt_ids: Sequence[int], n: int, seed: int, s: Sampling) -> dict[str, Any]:
        # Neutral sampling stated explicitly: vLLM otherwise applies the model's
        # generation_config defaults, and the trainer must know the distribution.
        return {
            "model": model,
            "prompt": prompt_ids,
            "n": n,
            "seed": seed,
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k if s.top_k > 0 else -1,
            "min_p": s.min_p,
            "repetition_penalty": 1.0,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            **s.extra,
        }

    def constraint(self, mode: str) -> dict[str, Any]:
        # vLLM's completions endpoint takes the chat endpoint's structured-output fields, but has no tools.
        if mode == "tool_choice":
            raise ValueError("tool_choice forces a chat tool call: vLLM's /v1/completions has no tools")
        return structured_output_fields(mode)

    def samples(self, data: Any) -> list[ServerCompletion]:
        out = []
        for choice in sorted(_list(data, "choices"), key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0):
            if not isinstance(choice, dict):
                raise MalformedAnswer(f"a choice is not an object: {choice!r:.100}")
            lp = choice.get("logprobs")
            if not isinstance(lp, dict):
                raise MalformedAnswer("no `logprobs` in the choice: the server ignored `logprobs: 0`")
            tokens, logprobs = lp.get("tokens"), lp.get("token_logprobs")
            if not isinstance(tokens, list) or not isinstance(logprobs, list) or len(tokens) != len(logprobs):
                raise MalformedAnswer("`logprobs.tokens` and `logprobs.token_logprobs` missing or of different lengths")
            ids = _token_ids(tokens)
            given = choice.get("token_ids")
            if given is not None and list(given) != ids:
                raise MalformedAnswer("`token_ids` and `logprobs.tokens` disagree")
            finish, reason = choice.get("finish_reason"), choice.get("stop_reason")
            if finish == "length":
                stopped: Any = None
            elif finish == "stop":
                # vLLM: stop_reason None means the EOS token; an int is a stop token id; a str a stop string.
                stopped = "eos" if reason is None else reason if isinstance(reason, int) else "other"
            else:
                raise MalformedAnswer(f"unexpected finish_reason {finish!r}")
            out.append(ServerCompletion(ids, _floats(logprobs), finish == "length", stopped))
        return out


class SGLangApi:
    name, path, supports_n = "sglang", "/generate", True

    def body(self, model: str, prompt_ids: Sequence[int], n: int, seed: int, s: Sampling) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k if s.top_k > 0 else -1,
            "min_p": s.min_p,
            "n": n,
        }
        params.update(s.extra.get("sampling_params", {}))
        body = {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True, "logprob_start_len": -1}
        body.update({k: v for k, v in s.extra.items() if k != "sampling_params"})
        return body

    def constraint(self, mode: str) -> dict[str, Any]:
        # SGLang's native API has one way: a JSON schema, as a string, among the sampling parameters.
        return {"sampling_params": {"json_schema": json.dumps(CALL_SCHEMA)}}

    def samples(self, data: Any) -> list[ServerCompletion]:
        items = data if isinstance(data, list) else [data]
        out = []
        for item in items:
            meta = item.get("meta_info") if isinstance(item, dict) else None
            if not isinstance(meta, dict):
                raise MalformedAnswer("no `meta_info` in the answer")
            triples = meta.get("output_token_logprobs")
            if not isinstance(triples, list):
                raise MalformedAnswer("no `meta_info.output_token_logprobs`: the server ignored `return_logprob`")
            try:
                ids = [_int(t[1]) for t in triples]
                logprobs = _floats([t[0] for t in triples])
            except (TypeError, IndexError, KeyError) as exc:
                raise MalformedAnswer(f"bad `output_token_logprobs` entry: {exc}") from None
            given = item.get("output_ids")
            if given is not None and list(given) != ids:
                raise MalformedAnswer("`output_ids` and `output_token_logprobs` disagree")
            reason = meta.get("finish_reason") or {}
            kind = reason.get("type") if isinstance(reason, dict) else reason
            if kind not in ("stop", "length"):
                raise MalformedAnswer(f"unexpected finish_reason {reason!r}")
            matched = reason.get("matched") if isinstance(reason, dict) else None
            stopped: Any = None if kind == "length" else matched if isinstance(matched, int) else "other" if matched else "eos"
            out.append(ServerCompletion(ids, logprobs, kind == "length", stopped))
        return out


class LlamaCppApi:
    name, path, supports_n = "llamacpp", "/completion", False

    def body(self, model: str, prompt_ids: Sequence[int], n: int, seed: int, s: Sampling) -> dict[str, Any]:
        # llama-server's defaults (top_k 40, min_p 0.05, ...) change the distribution; neutralize them.
        return {
            "prompt": prompt_ids,
            "n_predict": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "min_p": s.min_p,
            "typical_p": 1.0,
            "repeat_penalty": 1.0,
            "xtc_probability": 0.0,
            "dry_multiplier": 0.0,
            "seed": seed,
            "n_probs": 1,
            "return_tokens": True,
            "cache_prompt": True,
            **s.extra,
        }

    def constraint(self, mode: str) -> dict[str, Any]:
        # llama-server turns `json_schema` into a grammar.
        return {"json_schema": CALL_SCHEMA}

    def samples(self, data: Any) -> list[ServerCompletion]:
        if not isinstance(data, dict):
            raise MalformedAnswer("the answer is not an object")
        probs = data.get("completion_probabilities", data.get("probs"))
        if not isinstance(probs, list):
            raise MalformedAnswer("no `completion_probabilities`: the server ignored `n_probs`")
        try:
            prob_ids = [_int(p["id"]) for p in probs]
            logprobs = _floats([p["logprob"] for p in probs])
        except (TypeError, KeyError) as exc:
            raise MalformedAnswer(f"bad `completion_probabilities` entry: {exc}") from None
        tokens = data.get("tokens")
        ids = [_int(t) for t in tokens] if tokens else prob_ids
        if ids != prob_ids[: len(ids)] or len(prob_ids) > len(ids) + 1:
            raise MalformedAnswer("`tokens` and `completion_probabilities` disagree")
        stop = data.get("stop_type")
        if stop not in ("eos", "limit", "word"):
            raise MalformedAnswer(f"unexpected stop_type {stop!r}")
        sample = ServerCompletion(ids, logprobs[: len(ids)], stop == "limit", "eos" if stop == "eos" else None if stop == "limit" else "other")
        if len(prob_ids) == len(ids) + 1 and stop == "eos":  # the EOS was scored but left out of `tokens`
            sample.ids, sample.logprobs = prob_ids, logprobs
        return [sample]


APIS: dict[str, TokenApi] = {"vllm": VLLMApi(), "sglang": SGLangApi(), "llamacpp": LlamaCppApi()}


class OpenAICompletionsPolicy:
    """A policy over a `ServerPool`: token ids when the servers can, chat text when they cannot."""

    def __init__(
        self,
        pool: ServerPool,
        model: str,
        chat: ChatFormat,
        *,
        api: ServerApi = "vllm",
        token_path: TokenPathSetting = "auto",
        sampling: Sampling = Sampling(),
        native_tools: bool = False,
        extra_body: dict[str, Any] | None = None,
        structured_output: str | None = None,
    ) -> None:
        if api not in APIS:
            raise ValueError(f"unknown server API {api!r}; choose one of {sorted(APIS)}")
        if token_path not in ("auto", "completions", "chat"):
            raise ValueError(f"token_path must be auto, completions or chat, not {token_path!r}")
        self.pool = pool
        self.model = model
        self.name = model
        self.chat = chat
        self.api: TokenApi = APIS[api]
        self.sampling = replace(sampling, extra={**sampling.extra, **(extra_body or {})})
        # Constrained decoding for play and evaluation only: it changes what is sampled.
        self.structured_output = structured_output
        self._chat_constraint = structured_output_fields(structured_output) if structured_output else {}
        self._token_sampling = self.sampling
        if structured_output:
            self._token_sampling = replace(self.sampling, extra={**self.api.constraint(structured_output),
                                                                 **self.sampling.extra})
        self.native_tools = native_tools
        self.token_path_setting = token_path
        self._path: str | None = {"completions": COMPLETIONS_PATH, "chat": CHAT_PATH}.get(token_path)
        self._path_reason = f"set to {token_path}" if self._path else ""
        self._decide_lock = asyncio.Lock()
        eot = chat.end_of_turn_ids
        self._eot: int | None = eot[0] if len(eot) == 1 else None
        self._decode = chat.backend.decode
        self._vocab = vocab_size(chat.backend)

    @property
    def token_path(self) -> str | None:
        """`completions-token-ids`, `chat-text`, or None until the servers were asked."""
        return self._path

    def generation_params(self) -> dict[str, Any]:
        path = self._path
        params = {
            "policy": "openai",
            "model": self.model,
            "servers": self.pool.urls,
            "server_api": self.api.name,
            "token_path": path or "undecided",
            "token_path_reason": self._path_reason or None,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "top_k": self.sampling.top_k,
            "min_p": self.sampling.min_p,
            "max_tokens": self.sampling.max_tokens,
            "native_tools": self.native_tools,
            "logprobs": "server logprob of each sampled token" if path == COMPLETIONS_PATH
            else "unavailable on the chat-completions path (0.0 recorded)",
        }
        if self.structured_output:
            params["constrained"] = True
            params["structured_output"] = self.structured_output if path != COMPLETIONS_PATH else f"{self.api.name} schema"
        return params

    async def respond(self, turn: Turn) -> Reply:
        path = self._path or await self._decide_path()
        if path == COMPLETIONS_PATH:
            return (await self._complete(turn.prompt_ids, 1, turn.seed, affinity_key(turn.messages)))[0]
        return (await self._chat(turn.messages, 1, turn.seed))[0]

    async def respond_many(self, turn: Turn, n: int) -> list[Reply]:
        """n answers to one prompt: one request with `n` (one prefill) where the server honours it.

        A server that returns fewer choices (or an API without `n`) is topped up with
        single requests seeded `seed + i`, the seeds vLLM gives the children of an n-request.
        """
        path = self._path or await self._decide_path()
        ask = self._complete if path == COMPLETIONS_PATH else self._chat
        source = turn.prompt_ids if path == COMPLETIONS_PATH else turn.messages
        first = n if (path == CHAT_PATH or self.api.supports_n) else 1
        key = affinity_key(turn.messages)  # every answer to the shared prompt goes to one server's cache
        replies = (await ask(source, first, turn.seed, key))[:n]
        if len(replies) < n:
            more = await asyncio.gather(*(ask(source, 1, turn.seed + i, key) for i in range(len(replies), n)))
            replies += [r[0] for r in more]
        return replies

    async def aclose(self) -> None:
        await self.pool.aclose()

    # -- the token-id path ---------------------------------------------------------

    async def _complete(self, prompt_ids: Sequence[int], n: int, seed: int, key: str | None = None) -> list[Reply]:
        api = self.api
        data = await self.pool.post(api.path, api.body(self.model, prompt_ids, n, seed & 0x7FFFFFFF, self._token_sampling),
                                    key)
        try:
            samples = api.samples(data)
        except MalformedAnswer as exc:
            raise InferenceError(f"{api.name} server answered {api.path} without usable token ids: {exc}") from None
        except (AttributeError, TypeError, ValueError, KeyError) as exc:
            raise InferenceError(f"{api.name} server answered {api.path} with an unexpected shape: {exc!r}") from None
        if not samples:
            raise InferenceError(f"{api.name} server answered {api.path} with no choices")
        if self._vocab is not None:
            # An id the tokenizer does not have would abort the process inside llama.cpp's
            # decoder (an uncatchable C++ exception) and poison the trainer's embedding lookup.
            bad = next((i for s in samples for i in s.ids if i >= self._vocab), None)
            if bad is not None:
                raise InferenceError(
                    f"{api.name} server answered {api.path} with token id {bad}, outside the tokenizer's "
                    f"{self._vocab} ids: does --tokenizer match the served model?")
        return [self._reply(s) for s in samples]

    def _reply(self, s: ServerCompletion) -> Reply:
        """The reply is exactly the server's ids and logprobs; the end-of-turn id is appended
        only when the server says it stopped on that token but left it out."""
        ids, logprobs, eot = s.ids, s.logprobs, self._eot
        if ids and ids[-1] == eot:
            finish = "stop"
        elif not s.length and eot is not None and (s.stopped_on == eot or s.stopped_on == "eos"):
            ids.append(eot)
            logprobs.append(0.0)  # not reported by the server: probability one, as for bots
            finish = "stop"
        else:
            finish = "length"  # the model did not close its turn: the template closes it as context
        text = self._decode(ids[:-1] if finish == "stop" else ids)
        return Reply(text=text, completion_ids=ids, logprobs=logprobs, finish_reason=finish)

    # -- the chat-text path --------------------------------------------------------

    async def _chat(self, messages: Sequence[dict], n: int, seed: int, key: str | None = None) -> list[Reply]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": list(messages),
            **chat_sampling(self.sampling),
            "seed": seed & 0x7FFFFFFF,
            "n": n,
            **self.sampling.extra,
        }
        if self.native_tools:
            body["tools"] = TOOLS
        body.update(self._chat_constraint)
        data = await self.pool.post("/v1/chat/completions", body, key)
        return chat_replies(data, "/v1/chat/completions")

    # -- choosing the path ---------------------------------------------------------

    async def _decide_path(self) -> str:
        """Ask each healthy server once whether it returns token ids; all must, or the chat path is used."""
        async with self._decide_lock:
            if self._path is not None:
                return self._path
            urls = self.pool.healthy_urls()
            answers = await asyncio.gather(*(self._probe(url) for url in urls))
            known = {url: a for url, a in zip(urls, answers) if a[0] is not None}
            if not known:
                raise InferenceError(
                    "could not find out whether the servers return token ids: none answered a probe ("
                    + "; ".join(f"{u}: {a[1]}" for u, a in zip(urls, answers))
                    + "). Check that they are running, or set token_path (--token-path) explicitly."
                )
            if all(ok for ok, _ in known.values()):
                self._path, self._path_reason = COMPLETIONS_PATH, f"probed: {self.api.name} token ids"
            else:
                refusing = [f"{u} ({why})" for u, (ok, why) in known.items() if not ok]
                self._path = CHAT_PATH
                self._path_reason = "probed: no token ids from " + ", ".join(refusing)
                log.warning("falling back to chat completions (trajectories re-tokenized from text, no logprobs): "
                            "%s. Use --server-api to pick the server's API.", self._path_reason)
            return self._path

    async def _probe(self, url: str) -> tuple[bool | None, str]:
        """(True, _) token ids work; (False, why) the server answers but cannot; (None, why) unknown."""
        ids = self.chat.backend.encode("Hello") or [0]
        body = self.api.body(self.model, ids, 1, 0, Sampling(0.0, 1.0, 0, 0.0, 1, self.sampling.extra))
        try:
            response = await self.pool.post_to(url, self.api.path, body)
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"
        status = response.status_code
        if status == 200:
            try:
                return (True, "ok") if self.api.samples(response.json()) else (False, "no choices")
            except (ValueError, TypeError, AttributeError, KeyError) as exc:
                return False, f"answered without token ids ({exc})"
        if status < 500:
            return False, f"HTTP {status} on {self.api.path}"
        # llama-cpp-python answers a prompt of token ids with HTTP 500 (a validation error):
        # a plain text completion tells that apart from a server that is broken.
        try:
            control = await self.pool.post_to(url, "/v1/completions", {"model": self.model, "prompt": "Hello", "max_tokens": 1})
        except httpx.HTTPError as exc:
            return None, f"HTTP {status}, then {type(exc).__name__}"
        if control.status_code == 200:
            return False, f"HTTP {status} for a token-id prompt, 200 for text"
        return None, f"HTTP {status}"


def _list(data: Any, key: str) -> list[Any]:
    value = data.get(key) if isinstance(data, dict) else None
    if not isinstance(value, list):
        raise MalformedAnswer(f"no `{key}` list in the answer")
    return value


def _token_ids(tokens: list[Any]) -> list[int]:
    """vLLM's `"token_id:123"` strings -> ids (map and startswith run in C: this is the hot path)."""
    try:
        if all(map(str.startswith, tokens, repeat("token_id:"))):
            ids = [int(t[9:]) for t in tokens]
            if not ids or min(ids) >= 0:
                return ids
    except (TypeError, ValueError):
        pass
    bad = next((t for t in tokens if not (isinstance(t, str) and t.startswith("token_id:") and t[9:].isdigit())), None)
    raise MalformedAnswer(
        f"token {bad!r:.40} is not of the form 'token_id:N': the server ignored "
        "`return_tokens_as_token_ids` (vLLM >= 0.5.5 supports it)"
    )


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedAnswer(f"token id {value!r:.40} is not a non-negative integer")
    return value


def vocab_size(backend: Any) -> int | None:
    """How many ids the tokenizer has (llama.cpp's vocabulary or a Hugging Face tokenizer), if it says."""
    size = getattr(backend, "vocab_size", None)
    if isinstance(size, int):
        return size
    llama = getattr(backend, "llama", None)
    if llama is not None and hasattr(llama, "n_vocab"):
        return int(llama.n_vocab())
    tok = getattr(backend, "tok", None)
    return len(tok) if tok is not None and hasattr(tok, "__len__") else None


def _floats(values: list[Any]) -> list[float]:
    """Logprobs, checked: numbers (not bools or strings), finite, <= 0 up to rounding."""
    if not set(map(type, values)) <= _NUMBER_TYPES:
        bad = next(v for v in values if type(v) not in _NUMBER_TYPES)
        raise MalformedAnswer(f"logprob {bad!r:.40} is not a number")
    out = list(map(float, values))
    if out and (max(out) > 1e-3 or not math.isfinite(sum(out))):
        raise MalformedAnswer(f"logprobs must be finite and <= 0, got {min(out)!r:.40} .. {max(out)!r:.40}")
    return out


_NUMBER_TYPES = frozenset((int, float))
