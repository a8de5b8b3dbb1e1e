"""The default player: a GGUF model run in-process by llama.cpp (SmolLM2-135M-Instruct).

It consumes and returns token ids directly, so a trajectory holds exactly the ids
the model read and sampled, with the model's logprob of each sampled id.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from blackjack_rl.contract.protocol import ACTION_NAMES, tool_call_text
from blackjack_rl.contract.tokens import ChatFormat, LlamaCppTokenizer, common_prefix_length, embedded_model_path
from blackjack_rl.policies.base import InferenceError, Reply, Turn
from blackjack_rl.policies.llama_batch import BatchDecoder, Job, body_chunks, body_start, log_softmax_at
from blackjack_rl.policies.llama_load import load_llama
from blackjack_rl.policies.sampling import Sampling
from blackjack_rl.threads import ThreadChooser, usable_cpus

# Constrained decoding: the only valid answers are these two texts, followed by the
# end-of-turn token. Used for play and evaluation, never for training data:
# constraining changes the distribution the answers were sampled from.
VALID_ANSWERS = tuple(tool_call_text(action) for action in ACTION_NAMES)
_CANDIDATES = 64  # constrained sampling looks at the model's top tokens only (plus a fallback)
PARALLEL = 8  # sequences decoded together by the free-sampling path (see llama_batch.py)


class EmbeddedPolicy:
    """One llama.cpp model, shared by every concurrent episode of a worker.

    llama.cpp runs on a single worker thread (the event loop stays free for progress and
    I/O). Free sampling decodes up to `parallel` answers together, each in its own KV stream
    (llama_batch.py), with the same ids and logprobs as one at a time; scoring and
    constrained sampling use one context, one request at a time. Either way a cache keeps
    what a prompt shares with earlier ones (the system prompt, a group's deal).
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        sampling: Sampling = Sampling(),
        n_ctx: int = 2048,
        n_threads: int | None = None,
        constrained: bool = False,
        lora_path: str | Path | None = None,
        lora_name: str | None = None,
        lora_fold: str | None = None,
        parallel: int = PARALLEL,
    ) -> None:
        self.model_path = Path(model_path) if model_path else embedded_model_path()
        if not self.model_path.is_file():
            raise FileNotFoundError(f"no GGUF model at {self.model_path}")
        self.sampling = sampling
        self.temperature, self.max_tokens = sampling.temperature, sampling.max_tokens
        self.constrained = constrained
        # the adapter as the user named it (a path, or a shipped adapter's name): runs record it
        self.lora = lora_name or (str(lora_path) if lora_path else None)
        if lora_fold and not self.lora:
            raise ValueError("lora_fold folds an adapter: name one (lora_name or lora_path)")
        load_path = self.model_path
        if lora_fold:  # the adapter folded into the weights once: no run-time adapter products
            from blackjack_rl.policies.gguf_fold import folded_gguf

            load_path, lora_path = folded_gguf(self.lora, self.model_path, lora_fold), None
        self.lora_fold = lora_fold
        self.llama = load_llama(
            model_path=str(load_path),
            n_ctx=n_ctx,
            n_threads=n_threads or usable_cpus(),
            n_threads_batch=n_threads or usable_cpus(),
            lora_path=str(_gguf_adapter(Path(lora_path), self.model_path)) if lora_path else None,
            logits_all=True,  # logprobs of sampled tokens need the logits of every position
            verbose=False,
        )
        self.name = self.model_path.stem + (f"+{Path(self.lora).name}" if self.lora else "") \
            + (f" (folded, {lora_fold})" if lora_fold else "")
        self.tokenizer = LlamaCppTokenizer(self.llama, self.model_path.name)
        self.chat = ChatFormat.learn(self.tokenizer)
        self._pieces: dict[int, str] = {}
        self._body = 0  # the leading cached tokens decoded as a prompt body (see _prime)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama")
        self.parallel = parallel
        self._batcher: BatchDecoder | None = None  # made on first use: its KV cache is `parallel` contexts' worth
        self._queue: deque[Job] = deque()
        self._queue_lock = threading.Lock()
        self._draining = False
        import llama_cpp

        vocab = self.llama._model.vocab
        self._is_end = lambda tok: bool(llama_cpp.llama_vocab_is_eog(vocab, tok))
        # Unless told how many, no more threads than free cores (see threads.py), revisited as load changes.
        self._threads = None if n_threads else ThreadChooser(self._set_threads)

    def _set_threads(self, n: int) -> None:
        import llama_cpp

        llama_cpp.llama_set_n_threads(self.llama.ctx, n, n)
        if self._batcher is not None:
            self._batcher.set_threads(n)

    def generation_params(self) -> dict[str, Any]:
        return {
            "policy": "embedded",
            "model": self.model_path.name,
            "lora": self.lora,
            "lora_fold": self.lora_fold,
            "temperature": self.temperature,
            "top_p": self.sampling.top_p,
            "top_k": self.sampling.top_k,
            "min_p": self.sampling.min_p,
            "max_tokens": self.max_tokens,
            "constrained": self.constrained,
            "logprobs": "model log-softmax at temperature 1 of each sampled token",
        }

    async def respond(self, turn: Turn) -> Reply:
        loop = asyncio.get_running_loop()
        if self.constrained or self.parallel <= 1:
            return await loop.run_in_executor(self._worker, self.generate, list(turn.prompt_ids), turn.seed)
        prompt = list(turn.prompt_ids)
        self._check_prompt(prompt)
        future: asyncio.Future[Reply] = loop.create_future()

        def settle(result: Reply | BaseException) -> None:
            if future.done():  # the episode was cancelled meanwhile
                return
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

        job = Job(prompt, turn.seed, lambda result: loop.call_soon_threadsafe(settle, result))
        with self._queue_lock:
            self._queue.append(job)
            start, self._draining = not self._draining, True
        if start:
            self._worker.submit(self._drain)
        return await future

    def _take(self, n: int) -> list[Job]:
        if n and self._threads is not None:
            self._threads.check()
        with self._queue_lock:
            return [self._queue.popleft() for _ in range(min(n, len(self._queue)))]

    def _drain(self) -> None:
        """On the worker thread: decode queued prompts together until none is left."""
        try:
            if self._batcher is None:
                self._batcher = BatchDecoder(
                    self.llama, slots=self.parallel, sampling=self.sampling,
                    is_end=self._is_end, decode_text=self.tokenizer.decode)
            self._batcher.run(self._take)
        except BaseException as exc:  # noqa: BLE001 - no queued episode may wait forever
            for job in self._take(len(self._queue)):
                job.done(exc if isinstance(exc, InferenceError) else InferenceError(f"llama.cpp failed: {exc!r}"))
        finally:
            with self._queue_lock:
                again = self._draining = bool(self._queue)
            if again:
                self._worker.submit(self._drain)

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise InferenceError("empty prompt")
        if len(prompt_ids) + self.max_tokens > self.llama.n_ctx():
            raise InferenceError(
                f"prompt of {len(prompt_ids)} tokens + {self.max_tokens} new tokens exceeds the "
                f"context of {self.llama.n_ctx()}; raise n_ctx or lower max_token_length"
            )

    def generate(self, prompt_ids: list[int], seed: int) -> Reply:
        """One answer on the single context (constrained, or when batching is off)."""
        self._check_prompt(prompt_ids)
        if self._threads is not None:
            self._threads.check()
        try:
            return self._sample(prompt_ids, seed)
        except Exception as exc:  # llama.cpp failures are inference failures, not game results
            raise InferenceError(f"llama.cpp generation failed: {exc!r}") from exc

    async def answer_logprobs(
        self, prompt_ids: list[int], answers: list[list[int]], temperature: float | None = None
    ) -> list[list[float]]:
        """The model's logprob of every token of each given answer to the prompt (no sampling).

        `temperature` None gives the convention of this policy's sampled logprobs
        (temperature 1), so the logprobs of forced and sampled answers are comparable.
        """
        return (await self.answer_logprobs_many([(prompt_ids, answers)], temperature))[0]

    async def answer_logprobs_many(
        self, items, temperature: float | None = None, same_kernels: bool = True
    ) -> list[list[list[float]]]:
        """`answer_logprobs` of many (prompt, answers) pairs.

        `same_kernels` decodes the answers one token at a time, as sampling does: llama.cpp's
        batched kernels give this Q4_1 model logprobs up to ~0.25 away from the single-token
        ones, too far for an importance ratio clipped at 0.2. False decodes the answers in
        chunks, several times faster, for a strategy chart read at the 1e-2 level; the token
        before the answers part still goes alone (see score_answers).
        """
        loop = asyncio.get_running_loop()

        def run() -> list[list[list[float]]]:
            out = []
            for p, ans in items:
                if self._threads is not None:  # a chart is minutes of scoring: revisit the free cores
                    self._threads.check()
                out.append(self.score_answers(list(p), [list(a) for a in ans], temperature or 1.0, same_kernels))
            return out

        return await loop.run_in_executor(self._worker, run)

    def score_answers(
        self, prompt_ids: list[int], answers: list[list[int]], temperature: float, same_kernels: bool = True
    ) -> list[list[float]]:
        """Synchronous `answer_logprobs_many` of one prompt. The answers' shared beginning is
        decoded once."""
        if not prompt_ids or any(not a for a in answers):
            raise InferenceError("scoring needs a prompt and non-empty answers")
        longest = max(len(a) for a in answers)
        if len(prompt_ids) + longest > self.llama.n_ctx():
            raise InferenceError(f"prompt of {len(prompt_ids)} tokens + an answer of {longest} exceeds the context")
        llama = self.llama

        def feed(ids: list[int]) -> None:
            if same_kernels:
                for t in ids:
                    llama.eval([t])
            elif ids:
                llama.eval(ids)

        try:
            self._prime(prompt_ids)
            llama.eval(prompt_ids[-1:])
            base = len(prompt_ids)
            shared = min(common_prefix_length(answers), min(len(a) for a in answers) - 1)
            # the answers' shared beginning, its last token alone as sampling decodes it, so that
            # the logits where the answers diverge (the two calls' action words) are that kernel's
            if shared:
                feed(answers[0][: shared - 1])
                llama.eval(answers[0][shared - 1 : shared])
            out = []
            for answer in answers:
                self._truncate(base + shared)
                feed(answer[shared:-1])
                logits = np.asarray(llama.scores[base - 1 : base - 1 + len(answer)], dtype=np.float64)
                out.append(log_softmax_at(logits / temperature, answer))
            return out
        except InferenceError:
            raise
        except Exception as exc:
            raise InferenceError(f"llama.cpp scoring failed: {exc!r}") from exc

    def _truncate(self, keep: int) -> None:
        llama = self.llama
        if llama.n_tokens > keep:
            if not llama._ctx.kv_cache_seq_rm(-1, keep, -1):
                raise InferenceError("llama.cpp could not trim its KV cache")
            llama.n_tokens = keep

    def _sample(self, prompt_ids: list[int], seed: int) -> Reply:
        """Not thread-safe: call from the policy's single worker thread (or synchronously)."""
        if self.constrained:
            return self._sample_constrained(prompt_ids, seed)
        llama = self.llama
        self._prime(prompt_ids)
        llama.set_seed(seed & 0x7FFFFFFF)
        ids: list[int] = []
        finish = "length"
        for tok in llama.generate(
            prompt_ids,
            temp=self.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k,
            min_p=self.sampling.min_p,
            repeat_penalty=1.0,
        ):
            ids.append(int(tok))
            if self._is_end(tok):
                finish = "stop"
                break
            if len(ids) >= self.max_tokens:
                break
        start = len(prompt_ids) - 1
        logits = np.asarray(llama.scores[start : start + len(ids)], dtype=np.float64)
        logprobs = log_softmax_at(logits, ids)
        answer = ids[:-1] if finish == "stop" else ids
        return Reply(
            text=self.tokenizer.decode(answer),
            completion_ids=ids,
            logprobs=logprobs,
            finish_reason=finish,
        )

    def _sample_constrained(self, prompt_ids: list[int], seed: int) -> Reply:
        """Sample token by token among the model's top tokens that keep the text a prefix of
        a valid answer, renormalized (temperature applied), then force the end of turn.

        Equivalent to a grammar for this two-answer language, but cheap: llama.cpp's GBNF
        sampler checks the whole 49k vocabulary at every step and made constrained
        evaluation ~10x slower than free sampling here. Logprobs are the model's own
        (temperature 1, unconstrained), as for free sampling.
        """
        llama = self.llama
        self._prime(prompt_ids)
        llama.eval(prompt_ids[-1:])
        rng = np.random.default_rng(seed)
        eos = llama.token_eos()
        text, ids, logprobs = "", [], []
        for _ in range(self.max_tokens):
            logits = np.asarray(llama.scores[llama.n_tokens - 1], dtype=np.float64)
            if text in VALID_ANSWERS:
                allowed = np.asarray([eos])
            else:
                top = np.argpartition(logits, -_CANDIDATES)[-_CANDIDATES:]
                allowed = np.asarray([t for t in top if self._continues(text, int(t))] or [self._next_char(text)])
            z = logits[allowed]
            if self.temperature > 0:
                p = np.exp((z - z.max()) / self.temperature)
                tok = int(rng.choice(allowed, p=p / p.sum()))
            else:
                tok = int(allowed[int(np.argmax(z))])
            peak = logits.max()
            logprobs.append(float(logits[tok] - peak - np.log(np.exp(logits - peak).sum())))
            ids.append(tok)
            if tok == eos:
                return Reply(text=text, completion_ids=ids, logprobs=logprobs, finish_reason="stop")
            text += self._piece(tok)
            llama.eval([tok])
        return Reply(text=text, completion_ids=ids, logprobs=logprobs, finish_reason="length")

    def _piece(self, token: int) -> str:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.llama.detokenize([token]).decode("utf-8", errors="replace")
        return piece

    def _continues(self, text: str, token: int) -> bool:
        piece = self._piece(token)
        return bool(piece) and any(answer.startswith(text + piece) for answer in VALID_ANSWERS)

    def _next_char(self, text: str) -> int:
        """When none of the top tokens fits, the single-character token of the next character."""
        answer = next(a for a in VALID_ANSWERS if a.startswith(text))
        return self.llama.tokenize(answer[len(text)].encode(), add_bos=False, special=False)[0]

    def _prime(self, prompt_ids: list[int]) -> None:
        """Put the prompt's body (all but its last token) in the KV cache, reusing only what
        earlier bodies put there.

        The logits a token is sampled from must not depend on what happened to be cached:
        llama.cpp decodes a token alone with other kernels than a chunk of several, enough
        to flip a sample. So the body goes in chunks of two or more (whose bits do not depend
        on the split), the last prompt token alone (llama's `generate` then does exactly
        that), and what was decoded alone (an earlier turn's answer) is decoded again as body
        (llama_batch.py). The same tokens and seed give the same answer, whatever was cached.
        """
        llama = self.llama
        body = len(prompt_ids) - 1
        self._body = min(self._body, llama.n_tokens)  # a cache cleared or trimmed elsewhere
        keep = body_start(min(_common_prefix(llama.input_ids[: llama.n_tokens], prompt_ids), self._body), body)
        if keep < llama.n_tokens:
            if not llama._ctx.kv_cache_seq_rm(-1, keep, -1):
                llama.reset()
                keep = 0
            llama.n_tokens = keep
        self._body = keep
        # No body logit is ever read (the last prompt token follows alone), so llama.cpp skips the
        # vocabulary head over the body (docs/inference.md). The cache gets the same bits either way.
        llama._logits_all = False
        try:
            for start, end in body_chunks(keep, body, llama.n_batch):
                llama.eval(prompt_ids[start:end])
        finally:
            llama._logits_all = True
        self._body = body

    async def aclose(self) -> None:
        self._worker.shutdown(wait=True)
        if self._batcher is not None:
            self._batcher.close()
        self.llama.close()


def _gguf_adapter(path: Path, model_path: Path) -> Path:
    """A GGUF adapter for llama.cpp: the file itself, or a peft adapter folder converted once
    (kept beside it as adapter.gguf)."""
    if path.is_file():
        return path
    if not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(f"no LoRA adapter at {path}: pass a .gguf adapter or a folder saved by `train --lora`")
    converted = path / "adapter.gguf"
    source = path / "adapter_model.safetensors"
    if not converted.is_file() or converted.stat().st_mtime < source.stat().st_mtime:
        try:
            from blackjack_rl.policies.gguf_lora import export_gguf_lora
        except ImportError as exc:
            raise ImportError("converting a peft adapter needs the train extra: pip install 'blackjack-rl[train]'") from exc
        export_gguf_lora(path, converted, model_path)
    return converted


def _common_prefix(cached: np.ndarray, ids: list[int]) -> int:
    n = min(len(cached), len(ids))
    if n == 0:
        return 0
    diff = np.flatnonzero(cached[:n] != np.asarray(ids[:n]))
    return int(diff[0]) if diff.size else n
