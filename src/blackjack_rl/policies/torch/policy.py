"""A torch model as a `Policy`: the weights being trained are the weights that play.

Episodes call `respond` one turn at a time, concurrently; requests that arrive together are
sampled as one batch (a group's `respond_many` contributes all its rows at once), so a group
of 16 or an evaluation with 64 episodes in flight costs one batched forward per token.
Replies carry the exact ids sampled and their logprobs under the sampling distribution
(log-softmax of logits / temperature), which is what the trainer's importance ratio needs.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from blackjack_rl.model import NEEDS_TORCH

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(NEEDS_TORCH) from exc

from blackjack_rl.policies.base import InferenceError, Reply, Turn
from blackjack_rl.policies.sampling import Sampling
from blackjack_rl.contract.tokens import ChatFormat, HFTokenizer, common_prefix_length
from blackjack_rl.model.io import load_model, stop_ids
from blackjack_rl.policies.torch.sampler import sample


@dataclass
class _Request:
    prompts: list[Sequence[int]]
    seeds: list[int]
    future: asyncio.Future


@dataclass
class _Scoring:
    items: list  # (prompt ids, answers' ids)
    temperature: float
    future: asyncio.Future


def _settle(batch: Sequence[_Request | _Scoring], results: Sequence[Any] = (),
            error: BaseException | None = None) -> None:
    """Hand each waiting request of a batch its result, or the batch's error (a caller that
    was cancelled meanwhile is skipped)."""
    for i, r in enumerate(batch):
        if r.future.done():
            continue
        if error is not None:
            r.future.set_exception(error)
        else:
            r.future.set_result(results[i])


_SCORE_CHUNK = 32  # (prompt, answers) items per scoring forward
_TRUNK_CACHE_MAX = 4096  # sequences (~1 MB each for SmolLM2)


def row_seed(seed: int, i: int) -> int:
    """Seeds of the rows of one `respond_many` call: distinct, stable."""
    return int(np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, i]).generate_state(1)[0])


class TorchPolicy:
    def __init__(
        self,
        model: Any,
        tokenizer: HFTokenizer,
        *,
        name: str | None = None,
        sampling: Sampling = Sampling(),
        max_batch: int = 64,
        threads: int | None = None,
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.model = model  # read-only outside: the trainer swaps in the model it trains with `sample_with`
        self.tokenizer = tokenizer
        self.chat = ChatFormat.learn(tokenizer)
        self.stop = stop_ids(model, tokenizer, self.chat.end_of_turn_ids)
        self.name = name or tokenizer.name
        self.sampling = sampling
        self.temperature, self.max_tokens = sampling.temperature, sampling.max_tokens
        self.max_batch = max_batch
        self.pad_id = int(tokenizer.tok.pad_token_id or 0)
        self.sampled_tokens = 0  # totals, for tokens per second
        self.scored_tokens = 0  # tokens of the sequences scored (prompt and answer): forward work
        self.sampling_seconds = 0.0
        # The first trained layer, when only the layers from there up train (`sample_with`):
        # scoring then caches the frozen trunk's output per scored sequence (`_trunk_states`).
        self._frozen_below = 0
        self._trunk_cache: dict[tuple[int, ...], torch.Tensor] = {}
        # While the trainer collects a batch (`recording`): the states entering `_frozen_below`
        # of every sampled and scored sequence, keyed by its ids.
        self._recorded: dict[tuple[int, ...], torch.Tensor] | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-sampler")
        self._pending: list[_Request] = []
        self._drainer: asyncio.Task | None = None
        self._scoring: list[_Scoring] = []
        self._scorer: asyncio.Task | None = None

    @classmethod
    def load(cls, path: str | Path | None = None, **kwargs: Any) -> "TorchPolicy":
        """From a GGUF (None: the embedded SmolLM2-135M-Instruct) or a folder saved by `train`."""
        model, tokenizer = load_model(path)
        return cls(model, tokenizer, **kwargs)

    # --- the trainer's side (train/trainer.py's TrainedPolicy) -----------------------------

    def sample_with(self, model: Any, *, frozen_below: int = 0) -> None:
        """Sample and score with `model` from now on: the model that learns is the model that plays.

        `frozen_below`: the first layer that trains (0: all of them). The layers below it compute
        the same states at sampling and at training time, so scoring keeps their output per
        sequence, and `recording` hands it to the trainer."""
        self.model = model
        self._frozen_below = frozen_below
        self._trunk_cache.clear()

    @contextmanager
    def recording(self) -> Iterator[dict[tuple[int, ...], torch.Tensor]]:
        """While a batch is collected: a dict that receives the states entering the first trained
        layer of every sequence sampled or scored meanwhile, keyed by its ids (prompt + answer),
        so that training need not run the frozen trunk again. Stays empty when every layer trains."""
        states: dict[tuple[int, ...], torch.Tensor] = {}
        self._recorded = states if self._frozen_below else None
        try:
            yield states
        finally:
            self._recorded = None

    @contextmanager
    def aside(self) -> Iterator[None]:
        """Work that must leave training as it was (a fidelity probe): the frozen trunk's cache
        is put back afterwards, since states computed in another batch can differ in their last
        bits, and a step would then train on other numbers than without the probe."""
        saved = dict(self._trunk_cache)
        try:
            yield
        finally:
            self._trunk_cache = saved

    def generation_params(self) -> dict[str, Any]:
        return {
            "policy": "hf",
            "model": self.name,
            "temperature": self.temperature,
            "top_p": self.sampling.top_p,
            **({"top_k": self.sampling.top_k, "min_p": self.sampling.min_p} if self.sampling.truncates else {}),
            "max_tokens": self.max_tokens,
            "constrained": False,
            "logprobs": "log-softmax of logits / temperature (the sampling distribution) of each sampled token"
            + (", before top-p / top-k / min-p" if self.sampling.truncates else ""),
        }

    async def respond(self, turn: Turn) -> Reply:
        return (await self._submit([turn.prompt_ids], [turn.seed]))[0]

    async def respond_many(self, turn: Turn, n: int) -> list[Reply]:
        return await self._submit([turn.prompt_ids] * n, [row_seed(turn.seed, i) for i in range(n)])

    async def answer_logprobs(
        self, prompt_ids: Sequence[int], answers: Sequence[Sequence[int]], temperature: float | None = None
    ) -> list[list[float]]:
        """The model's logprob of every token of each given answer (no sampling), at
        `temperature` (None: the sampling temperature, the convention of sampled logprobs)."""
        return (await self.answer_logprobs_many([(prompt_ids, answers)], temperature))[0]

    async def answer_logprobs_many(
        self, items, temperature: float | None = None, same_kernels: bool = True
    ) -> list[list[list[float]]]:
        """`answer_logprobs` of many (prompt, answers) pairs, in batched forwards (torch has one
        kernel path, so `same_kernels`, which matters to llama.cpp, changes nothing here).

        Requests made at about the same time (the forced calls of every deal of a training
        step) are scored together, so the system prompt they share runs once, not per deal.
        """
        loop = asyncio.get_running_loop()
        t = self.temperature if temperature is None else temperature
        request = _Scoring(list(items), t, loop.create_future())
        self._scoring.append(request)
        if self._scorer is None or self._scorer.done() or self._scorer.get_loop() is not loop:
            self._scorer = loop.create_task(self._drain_scoring())
        return await request.future

    async def _drain_scoring(self) -> None:
        loop = asyncio.get_running_loop()
        while self._scoring:
            for _ in range(4):  # let the other deals resumed with this one queue their calls too
                await asyncio.sleep(0)
            t = self._scoring[0].temperature
            batch = [r for r in self._scoring if r.temperature == t]
            self._scoring = [r for r in self._scoring if r.temperature != t]
            items = [item for r in batch for item in r.items]
            prefixes: dict = {}  # the chunks' shared prefix runs once: the weights hold still while they score
            try:
                flat: list[list[float]] = []
                for i in range(0, len(items), _SCORE_CHUNK):
                    flat += await loop.run_in_executor(self._worker, self.score_answers, items[i : i + _SCORE_CHUNK], t,
                                                       prefixes)
            except Exception as exc:  # noqa: BLE001 - every waiting caller learns it failed
                _settle(batch, error=exc)
                continue
            results = []
            for r in batch:
                out = []
                for _, answers in r.items:
                    out.append(flat[: len(answers)])
                    flat = flat[len(answers) :]
                results.append(out)
            _settle(batch, results)

    def score_answers(self, items: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]],
                      temperature: float, prefixes: dict | None = None) -> list[list[float]]:
        """Synchronous scoring of many (prompt, answers) at once, in one batched forward;
        the answers' logprobs are returned flattened, in order. `prefixes`: see `token_logprobs`."""
        from blackjack_rl.model.logprobs import Targets, token_logprobs

        tokens, rows, positions, ids = [], [], [], []
        for prompt, answers in items:
            for answer in answers:
                r = len(tokens)
                tokens.append([*prompt, *answer])
                for j, t in enumerate(answer):
                    rows.append(r)
                    positions.append(len(prompt) + j)
                    ids.append(t)
        targets = Targets(torch.tensor(rows), torch.tensor(positions), torch.tensor(ids), None)
        self.scored_tokens += sum(len(seq) for seq in tokens)
        t = temperature if temperature > 0 else 1.0
        with torch.no_grad():
            if self._frozen_below:
                states = self._trunk_states(tokens)
                if self._recorded is not None:
                    # scored while a batch is collected (counterfactual calls): training reads these
                    # states instead of running the frozen trunk again
                    self._recorded.update(states)
                logp = token_logprobs(self.model, tokens, targets, t, first_layer=self._frozen_below, states=states,
                                      prefixes=prefixes)
            else:
                logp = token_logprobs(self.model, tokens, targets, t, prefixes=prefixes)
        logp = logp.tolist()
        out, k = [], 0
        for prompt, answers in items:
            for answer in answers:
                out.append(logp[k : k + len(answer)])
                k += len(answer)
        return out

    def _trunk_states(self, tokens: list[list[int]]) -> dict[tuple[int, ...], torch.Tensor]:
        """States entering the first trained layer for each sequence, computed once: below it
        nothing trains, so scoring the same prompts again (the strategy chart at every step)
        runs only the trained layers."""
        from blackjack_rl.model.forward import forward_rows, run_prefix
        from blackjack_rl.model.logprobs import pack_rows

        if len(self._trunk_cache) > _TRUNK_CACHE_MAX:  # the chart's 560 sequences stay; one-off prompts go
            self._trunk_cache.clear()
        todo = list({tuple(seq): list(seq) for seq in tokens if tuple(seq) not in self._trunk_cache}.values())
        if todo:
            # at least one state per row is computed below (a lone sequence would otherwise be all prefix)
            p = max(0, min(common_prefix_length(todo), min(len(x) for x in todo) - 2))
            packed = pack_rows(todo, [len(x) - 1 for x in todo], p)  # the states predicting every token but the first
            trunk = run_prefix(self.model, list(todo[0][:p]), layers=(0, self._frozen_below)) if p > 0 else None
            x = forward_rows(self.model, packed.ids, packed.positions, packed.valid, trunk,
                             layers=(0, self._frozen_below), attend=packed.attend).hidden
            head = trunk.output[0] if trunk is not None else x[0, :0]
            for i, seq in enumerate(todo):
                self._trunk_cache[tuple(seq)] = torch.cat([head, packed.unpack(x, i)])
        return {tuple(seq): self._trunk_cache[tuple(seq)] for seq in tokens}

    async def aclose(self) -> None:
        self._worker.shutdown(wait=True)

    # --- batching -------------------------------------------------------------------------

    async def _submit(self, prompts: list[Sequence[int]], seeds: list[int]) -> list[Reply]:
        loop = asyncio.get_running_loop()
        request = _Request(prompts, seeds, loop.create_future())
        self._pending.append(request)
        if self._drainer is None or self._drainer.done() or self._drainer.get_loop() is not loop:
            self._drainer = loop.create_task(self._drain())
        return await request.future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            for _ in range(4):  # let episodes resumed by the last batch queue their next turn
                await asyncio.sleep(0)
            batch, rows = [], 0
            while self._pending and (not batch or rows + len(self._pending[0].prompts) <= self.max_batch):
                request = self._pending.pop(0)
                batch.append(request)
                rows += len(request.prompts)
            prompts = [p for r in batch for p in r.prompts]
            seeds = [s for r in batch for s in r.seeds]
            try:
                replies = await loop.run_in_executor(self._worker, self.generate, prompts, seeds)
            except Exception as exc:  # noqa: BLE001 - every waiting episode learns it failed
                _settle(batch, error=exc if isinstance(exc, InferenceError) else InferenceError(repr(exc)))
                continue
            results, i = [], 0
            for r in batch:
                results.append(replies[i : i + len(r.prompts)])
                i += len(r.prompts)
            _settle(batch, results)

    def generate(self, prompts: list[Sequence[int]], seeds: list[int]) -> list[Reply]:
        """Sample one reply per prompt, synchronously (one batch)."""
        t0 = time.perf_counter()
        recorded = self._recorded
        record_layer = self._frozen_below if recorded is not None else None
        samples = sample(
            self.model,
            prompts,
            seeds,
            temperature=self.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k,
            min_p=self.sampling.min_p,
            max_new_tokens=self.max_tokens,
            stop=self.stop,
            pad_id=self.pad_id,
            record_layer=record_layer,
        )
        if recorded is not None:
            for prompt, s in zip(prompts, samples):
                recorded[(*prompt, *s.ids)] = s.states
        self.sampling_seconds += time.perf_counter() - t0
        self.sampled_tokens += sum(len(s.ids) for s in samples)
        return [
            Reply(
                text=self.tokenizer.decode(s.ids[:-1] if s.finish_reason == "stop" else s.ids),
                completion_ids=s.ids,
                logprobs=s.logprobs,
                finish_reason=s.finish_reason,
            )
            for s in samples
        ]
