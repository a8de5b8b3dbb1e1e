"""Sampling many prompts at once on one llama.cpp model: one decode call per step serves them all.

A single-sequence decode of a 135M model on a CPU is mostly fixed cost (reading the weights,
waking the threads); with several sequences in each decode that cost is shared.

Batching must not change what is sampled. Every sequence gets its own KV stream
(`kv_unified=False`), so its attention reads only its own cells, laid out as they would be
alone, and llama.cpp computes each row of a batch with the same per-row kernels: a sequence's
logits are bit-for-bit those of decoding it alone. Its sampler is llama-cpp-python's own chain,
seeded as `Llama.generate` seeds it, so a seed gives the same ids and logprobs batched or not
(tests/test_embedded.py holds the two paths to that; with one unified KV cache for all
sequences it fails, as the cells of other sequences change how attention sums). This uses `Llama._init_sampler`, `_model`
and `_lora_adapter`, which is why llama-cpp-python is pinned.

A cache is reused only where it was filled as a cold start fills it. llama.cpp's attention takes
another kernel for a sequence with one token in a decode than for one with several, and the two
differ in the last bits (on AVX2 CPUs by up to ~1 in a logit). A chunk of two tokens or more gives
the same bits however the tokens are split, so a prompt's body (all but its last token) goes in
chunks of at least two, and its last token and the sampled ones go alone. Those decoded alone are
never reused as the body of a later prompt: a later turn, which holds the earlier answer, decodes
it again with its own body. So a token's logits depend on the tokens before it alone, not on
what the cache held, and an episode plays the same at any concurrency (with an adapter applied at
run time, to ~1e-5: docs/inference.md, "Which kernels a token meets").
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from blackjack_rl.contract.tokens import common_prefix_length
from blackjack_rl.policies.base import InferenceError, Reply
from blackjack_rl.policies.sampling import Sampling

_COPY_GAIN = 32  # copy another stream's prefix when it saves at least this many prompt tokens


def body_start(cached: int, body: int) -> int:
    """Where a prompt body of `body` tokens starts decoding when its first `cached` tokens are in
    the cache, filled by body chunks: never one token before the end, which would go alone."""
    keep = min(cached, body)
    return keep - 1 if body - keep == 1 and keep > 0 else keep


def body_chunks(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) as decode calls of at most `size` tokens, none of one token alone (unless
    the whole span is one token)."""
    out = []
    while start < stop:
        end = min(start + size, stop)
        if stop - end == 1 and end - start > 2:
            end -= 1
        out.append((start, end))
        start = end
    return out


@dataclass
class Job:
    """One prompt to answer, and its progress while it decodes."""

    prompt: list[int]
    seed: int
    done: Callable[[Reply | BaseException], None]
    pos: int = 0
    feed: int = 0  # the token the next decode step puts into the sequence
    sampler: Any = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class BatchDecoder:
    """A second llama.cpp context on the same weights, with `slots` sequences decoded together.

    Not thread-safe: `run` belongs to one thread, the same one that uses the `llama` it was
    built from (it borrows that object's sampler factory).
    """

    def __init__(self, llama: Any, *, slots: int, sampling: Sampling,
                 is_end: Callable[[int], bool], decode_text: Callable[[list[int]], str]) -> None:
        import llama_cpp

        self._lib, self.llama, self.slots, self.sampling = llama_cpp, llama, slots, sampling
        self._is_end, self._decode_text = is_end, decode_text
        self._n_batch = llama.n_batch
        params = type(llama.context_params).from_buffer_copy(llama.context_params)
        params.n_ctx = llama.n_ctx() * slots  # each sequence gets the single context's length
        params.n_seq_max = slots
        params.kv_unified = False
        self.ctx = llama_cpp.llama_init_from_model(llama._model.model, params)
        if not self.ctx:
            raise InferenceError(f"llama.cpp could not make a context for {slots} sequences of {llama.n_ctx()} tokens")
        if llama._lora_adapter is not None:
            adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(llama._lora_adapter)
            if llama_cpp.llama_set_adapters_lora(self.ctx, adapters, 1, (ctypes.c_float * 1)(llama.lora_scale)):
                raise InferenceError("llama.cpp could not apply the LoRA adapter to the batch context")
        self._mem = llama_cpp.llama_get_memory(self.ctx)
        self._batch = llama_cpp.llama_batch_init(max(self._n_batch, slots), 0, 1)
        self._n_vocab = llama_cpp.llama_vocab_n_tokens(llama._model.vocab)
        # the tokens each stream holds as a prompt body (the last prompt token and the answer,
        # decoded alone, are in its cells too, but never reused)
        self._cached: list[list[int]] = [[] for _ in range(slots)]

    def set_threads(self, n: int) -> None:
        self._lib.llama_set_n_threads(self.ctx, n, n)

    def run(self, take: Callable[[int], list[Job]]) -> None:
        """Decode until no job is left. Between steps, `take(n)` hands over up to n newly queued
        jobs, which join the batch as soon as a sequence finishes (continuous batching)."""
        active: dict[int, Job] = {}
        while True:
            free = [s for s in range(self.slots) if s not in active]
            for job in take(len(free)):
                try:
                    self._admit(job, free, active)
                except Exception as exc:  # noqa: BLE001 - the job's caller gets it
                    self._reset()
                    self._fail(list(active.values()) + [job], exc)
                    active.clear()
                    free = list(range(self.slots))
            if not active:
                return
            try:
                self._step(active)
            except Exception as exc:  # noqa: BLE001
                self._reset()
                self._fail(list(active.values()), exc)
                active.clear()

    def _admit(self, job: Job, free: list[int], active: dict[int, Job]) -> None:
        """Give the job a stream whose cache shares the most of its prompt, and prefill the rest
        (all but the last token, which the next step decodes with the others)."""
        target = job.prompt[:-1]
        shared = [common_prefix_length((cached, target)) for cached in self._cached]
        slot = max(free, key=shared.__getitem__)
        source = max(range(self.slots), key=shared.__getitem__)
        keep = body_start(shared[slot], len(target))
        if shared[source] >= keep + _COPY_GAIN:
            self._lib.llama_memory_seq_cp(self._mem, source, slot, -1, -1)  # the whole stream, copied as is
            self._cached[slot] = list(self._cached[source])
            keep = body_start(shared[source], len(target))
        free.remove(slot)
        if not self._lib.llama_memory_seq_rm(self._mem, slot, keep, -1):
            raise InferenceError("llama.cpp could not trim a sequence of its KV cache")
        self._cached[slot] = target[:keep]
        for start, end in body_chunks(keep, len(target), self._n_batch):
            self._decode([(slot, i, target[i]) for i in range(start, end)])
            self._cached[slot].extend(target[start:end])
        job.pos, job.feed = len(target), job.prompt[-1]
        self.llama.set_seed(job.seed & 0x7FFFFFFF)
        s = self.sampling
        job.sampler = self.llama._init_sampler(
            top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, temp=s.temperature, repeat_penalty=1.0)
        active[slot] = job

    def _step(self, active: dict[int, Job]) -> None:
        order = sorted(active)
        self._decode([(slot, active[slot].pos, active[slot].feed) for slot in order], every_row=True)
        for row, slot in enumerate(order):
            job = active[slot]
            job.pos += 1
            tok = int(self._lib.llama_sampler_sample(job.sampler.sampler, self.ctx, row))
            logits = np.ctypeslib.as_array(self._lib.llama_get_logits_ith(self.ctx, row), shape=(self._n_vocab,))
            job.logprobs.append(log_softmax_at(logits[None, :].astype(np.float64), [tok])[0])
            job.ids.append(tok)
            end = self._is_end(tok)
            if end or len(job.ids) >= self.sampling.max_tokens:
                del active[slot]
                self._finish(job, "stop" if end else "length")
            else:
                job.feed = tok

    def _finish(self, job: Job, finish: str) -> None:
        job.sampler.close()
        answer = job.ids[:-1] if finish == "stop" else job.ids
        job.done(Reply(text=self._decode_text(answer), completion_ids=job.ids, logprobs=job.logprobs,
                       finish_reason=finish))

    def _decode(self, items: list[tuple[int, int, int]], every_row: bool = False) -> None:
        """One llama_decode of (sequence, position, token) rows, keeping the logits of every row
        or of the last one only (a prefill's)."""
        batch = self._batch
        batch.n_tokens = len(items)
        for i, (seq, pos, tok) in enumerate(items):
            batch.token[i], batch.pos[i] = tok, pos
            batch.seq_id[i][0], batch.n_seq_id[i] = seq, 1
            batch.logits[i] = every_row or i == len(items) - 1
        rc = self._lib.llama_decode(self.ctx, batch)
        if rc != 0:
            raise InferenceError(f"llama_decode returned {rc}")

    def _reset(self) -> None:
        self._lib.llama_memory_clear(self._mem, True)
        self._cached = [[] for _ in range(self.slots)]

    @staticmethod
    def _fail(jobs: list[Job], exc: BaseException) -> None:
        error = exc if isinstance(exc, InferenceError) else InferenceError(f"llama.cpp batched generation failed: {exc!r}")
        for job in jobs:
            if job.sampler is not None:
                job.sampler.close()
            job.done(error)

    def close(self) -> None:
        if self.ctx:
            self._lib.llama_batch_free(self._batch)
            self._lib.llama_free(self.ctx)
            self.ctx = None


def log_softmax_at(logits: np.ndarray, ids: list[int]) -> list[float]:
    """Each row's log-softmax at its id, in float64."""
    peak = logits.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(logits - peak).sum(axis=1)) + peak[:, 0]
    return (logits[np.arange(len(ids)), ids] - log_norm).tolist()
