"""The environment worker: plays groups and feeds them to the trajectory API during training.

It keeps `max_batches_offpolicy x batch_size` sequences queued or in flight (read from
/status-env), so the trainer never waits and the data never gets too stale. Every
finished group is handed to the client's `submit`, which sends it gzip-compressed with
retries, or parks it in an on-disk outbox when the API is unreachable; the outbox
drains in order when the API returns. SIGTERM stops new work, lets groups in flight
finish (up to `drain_timeout`), flushes and disconnects.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import signal
import socket
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .api.client import ApiUnavailable, EnvClient, RetryPolicy
from .api.models import RegisterEnv
from .config import Settings
from .evaluate import compute_metrics, run_evaluation
from .groups import GroupResult, Player, play_deal

log = logging.getLogger(__name__)


@dataclass
class ServeStats:
    groups_played: int = 0
    groups_sent: int = 0
    groups_parked: int = 0
    groups_dropped: dict[str, int] = field(default_factory=dict)
    groups_rejected: int = 0
    episodes: int = 0
    episodes_failed: int = 0
    evaluations: int = 0


class MetricsLog:
    """One JSON object per line: easy to tail, plot or load into pandas."""

    def __init__(self, path: Path, wandb_run: Any | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = path.open("a", encoding="utf-8")
        self._wandb = wandb_run

    def write(self, kind: str, **values: Any) -> None:
        row = {"time": time.time(), "kind": kind, **values}
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()
        if self._wandb is not None:
            flat = {f"{kind}/{k}": v for k, v in values.items() if isinstance(v, (int, float))}
            self._wandb.log(flat)

    def close(self) -> None:
        self._fh.close()


def worker_seed(seed: int, worker_id: str) -> int:
    """Deals depend on the base seed and the worker, so workers sharing an API play different deals."""
    return (seed << 32) ^ zlib.crc32(worker_id.encode())


class Worker:
    def __init__(self, settings: Settings, player: Player, client: EnvClient, metrics: MetricsLog) -> None:
        self.settings, self.player, self.client, self.metrics = settings, player, client, metrics
        self.cfg = settings.serve
        self.stats = ServeStats()
        self.stopping = asyncio.Event()
        worker_id = self.cfg.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        import random

        self._rng = random.Random(worker_seed(settings.seed, worker_id))
        self._tasks: set[asyncio.Task[list[GroupResult]]] = set()
        self._limiter = asyncio.Semaphore(settings.groups.concurrency)
        self._last_eval_step: int | None = None
        self._eval_task: asyncio.Task[None] | None = None

    def stop(self) -> None:
        self.stopping.set()

    async def register(self) -> int:
        g = self.settings.groups
        answer = await self.client.register_env(
            RegisterEnv(
                max_token_length=self.settings.episode.max_token_length,
                desired_name=self.cfg.env_name,
                weight=self.cfg.weight,
                group_size=g.group_size,
                min_batch_allocation=self.cfg.min_batch_allocation,
            ),
            poll_interval_s=self.cfg.poll_interval,
            timeout_s=self.cfg.register_timeout,
        )
        info = (await self.client._request("GET", "/info")).json()
        self.batch_size = int(info.get("batch_size") or -1)
        if self.batch_size <= 0:
            self.batch_size = g.group_size * 8
        trainer_max = int(info.get("max_token_len") or -1)
        if 0 < trainer_max < self.player.settings.max_token_length:
            # The trainer cannot take longer sequences: budget episodes to fit, rather
            # than have the API refuse whole groups.
            self.player.settings = dataclasses.replace(self.player.settings, max_token_length=trainer_max)
            log.info("episode token budget lowered to the trainer's max_token_len %s", trainer_max)
        self._last_eval_step = answer.starting_step or 0
        self.metrics.write("registered", env_id=answer.env_id, batch_size=self.batch_size,
                           wandb_name=answer.wandb_name, starting_step=answer.starting_step)
        log.info("registered as env %s (trainer batch size %s)", answer.env_id, self.batch_size)
        return int(answer.env_id or 0)

    def _groups_ahead(self) -> int:
        return max(1, math.ceil(self.cfg.max_batches_offpolicy * self.batch_size / self.settings.groups.group_size))

    def _launch(self) -> None:
        g = self.settings.groups
        task = asyncio.create_task(play_deal(self.player, self._rng.randrange(2**32), g, self._limiter))
        self._tasks.add(task)

    def _room(self, queued_groups: int) -> int:
        parked = self.client.outbox.pending_groups() if self.client.outbox is not None else 0
        room = self._groups_ahead() - queued_groups - len(self._tasks) - parked
        if self.cfg.max_groups is not None:
            room = min(room, self.cfg.max_groups - self.stats.groups_sent - self.stats.groups_parked - len(self._tasks))
        return room

    async def _deliver(self, result: GroupResult) -> None:
        s = self.stats
        s.groups_played += 1
        s.episodes += len(result.episodes)
        s.episodes_failed += sum(ep.failed for ep in result.episodes)
        if result.group is None:
            s.groups_dropped[result.dropped or "?"] = s.groups_dropped.get(result.dropped or "?", 0) + 1
            return
        sent = await self.client.submit([result.group])
        s.groups_sent += sent.sent_groups
        s.groups_rejected += len(sent.rejected)
        s.groups_parked = sent.parked_groups
        meta = result.group.get("episodes") or []
        self.metrics.write(
            "group",
            seed=result.seed,
            mean_score=sum(result.group["scores"]) / len(result.group["scores"]),
            valid_rate=sum(m.get("invalid_reason") is None for m in meta) / max(1, len(meta)),
            win_rate=sum(m.get("outcome") == "win" for m in meta) / max(1, len(meta)),
            sent=s.groups_sent,
            parked=s.groups_parked,
            rejected=s.groups_rejected,
        )
        for r in sent.rejected:
            log.error("the API refused a group (HTTP %s): %s", r.status, r.detail)

    def _maybe_evaluate(self, step: int) -> None:
        every = self.cfg.steps_per_eval
        if not every or self._last_eval_step is None or step < self._last_eval_step + every:
            return
        if self._eval_task is not None and not self._eval_task.done():
            return
        self._last_eval_step = step

        async def evaluate() -> None:
            episodes = await run_evaluation(self.player, self.cfg.eval_episodes, self.settings.evaluate.concurrency)
            m = compute_metrics(episodes, self.player)
            self.stats.evaluations += 1
            self.metrics.write("eval", step=step, mean_reward=m["mean_reward"]["mean"], win_rate=m["win"]["rate"],
                               invalid_rate=m["invalid"]["rate"], decision_accuracy=m["decision_accuracy"]["rate"],
                               mean_regret=m["mean_regret"]["mean"], episodes=m["episodes"])
            log.info("eval at step %s: mean reward %.4f, invalid %.1f%%", step, m["mean_reward"]["mean"] or 0,
                     100 * (m["invalid"]["rate"] or 0))

        self._eval_task = asyncio.create_task(evaluate())

    def _done(self) -> bool:
        return self.cfg.max_groups is not None and self.stats.groups_sent + self.stats.groups_parked >= self.cfg.max_groups

    async def run(self) -> ServeStats:
        await self.register()
        queued = 0
        next_poll = 0.0
        next_report = time.monotonic() + 30.0
        while not self.stopping.is_set() and not self._done():
            now = time.monotonic()
            if now >= next_report:  # a heartbeat on the console; the JSONL log has every group
                next_report = now + 30.0
                s = self.stats
                log.info("groups sent %d, parked %d, dropped %s, refused %d; episodes %d (%d failed); %d in flight",
                         s.groups_sent, s.groups_parked, s.groups_dropped or 0, s.groups_rejected, s.episodes,
                         s.episodes_failed, len(self._tasks))
            if now >= next_poll:
                next_poll = now + self.cfg.poll_interval
                try:
                    status = await self.client.status_env()
                    queued = status.self_queue_size
                    self._maybe_evaluate(status.current_step)
                    if self.client.outbox is not None and self.client.outbox.pending_posts():
                        flushed = await self.client.flush_outbox(RetryPolicy(attempts=1, max_elapsed_s=2.0))
                        self.stats.groups_sent += flushed.sent_groups
                        self.stats.groups_parked = flushed.parked_groups
                except ApiUnavailable as exc:
                    log.warning("API unreachable (%s); finished groups go to the outbox", exc)
            for _ in range(self._room(queued)):
                self._launch()
            if not self._tasks:
                await self._sleep_or_stop(self.cfg.poll_interval)
                continue
            done, _ = await asyncio.wait(self._tasks, timeout=self.cfg.poll_interval, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                self._tasks.discard(task)
                for result in task.result():
                    await self._deliver(result)
        await self.shutdown()
        return self.stats

    async def _sleep_or_stop(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stopping.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass

    async def shutdown(self) -> None:
        """Finish (or give up on) groups in flight, deliver or park them, flush, disconnect."""
        if self._tasks:
            done, pending = await asyncio.wait(self._tasks, timeout=self.cfg.drain_timeout)
            for task in pending:
                task.cancel()
            for task in done:
                if not task.cancelled() and task.exception() is None:
                    for result in task.result():
                        await self._deliver(result)
            self._tasks.clear()
        if self._eval_task is not None and not self._eval_task.done():
            self._eval_task.cancel()
        if self.client.outbox is not None and self.client.outbox.pending_posts():
            # Patient, like the drain: an API that is restarting should still get these now;
            # whatever it cannot take stays parked on disk for the next start.
            patience = RetryPolicy(attempts=1000, max_delay_s=2.0, max_elapsed_s=max(5.0, self.cfg.drain_timeout))
            flushed = await self.client.flush_outbox(patience)
            self.stats.groups_sent += flushed.sent_groups
            self.stats.groups_parked = flushed.parked_groups
        try:
            await self.client.disconnect()
        except ApiUnavailable:
            log.warning("could not tell the API this worker left; it will see it stop posting")
        s = self.stats
        self.metrics.write("stopped", sent=s.groups_sent, parked=s.groups_parked, dropped=s.groups_dropped,
                           rejected=s.groups_rejected, episodes=s.episodes, episodes_failed=s.episodes_failed)


async def serve(settings: Settings, player: Player, wandb_run: Any | None = None) -> ServeStats:
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics = MetricsLog(out / "serve_metrics.jsonl", wandb_run)
    client = EnvClient(settings.serve.api_url, token=settings.serve.api_token, outbox=out / "outbox.sqlite")
    worker = Worker(settings, player, client, metrics)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    try:
        return await worker.run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await client.aclose()
        metrics.close()
