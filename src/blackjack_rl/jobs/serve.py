"""The environment worker: plays groups and feeds them to the trajectory API during training.

It keeps at most `max_batches_offpolicy x batch_size` sequences queued, parked or being
played (the API's count at the last poll, plus what this worker posted since, plus what it
plays now), so the trainer never waits and the data never gets too stale. Every finished
group is handed to the client's `submit`, which sends it gzip-compressed with retries, or
parks it in an on-disk outbox when the API is unreachable; the outbox drains in order when
the API returns. SIGTERM stops new work, lets groups in flight finish (up to
`drain_timeout`), flushes and disconnects.

A worker restarted with the same `--worker-id` and `--seed` continues its stream of deals
(OUT/serve_state.json) instead of replaying it, and takes over its registration with the
API instead of leaving a dead one behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import os
import signal
import socket
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blackjack_rl.api.client import ApiUnavailable, EnvClient
from blackjack_rl.api.models import RegisterEnv
from blackjack_rl.retry import RetryPolicy
from blackjack_rl.config import Settings
from blackjack_rl.jobs.fidelity import PROBE_BUDGET, PROBE_WIDTH, exact_fidelity, samples_of
from blackjack_rl.measure.evaluation import compute_metrics
from blackjack_rl.measure.probe import can_probe
from blackjack_rl.outputs import prepare_folder
from blackjack_rl.rollout.core import GroupResult
from blackjack_rl.rollout.players import Player
from blackjack_rl.rollout.runner import DealResult, DealRunner, Tally
from blackjack_rl.contract.records import EpisodeRecord, Outcome, ScoredDataGroup

log = logging.getLogger(__name__)


@dataclass
class ServeStats(Tally):
    """What the deal runner played (`Tally`), and what became of the groups."""

    groups_sent: int = 0
    groups_parked: int = 0
    groups_rejected: int = 0
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


def deal_seed(stream: int, index: int) -> int:
    """The seed of deal number `index` of a stream: random-looking, and computable from the index."""
    digest = hashlib.blake2b(f"{stream}:{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big")


class DealCursor:
    """This worker's position in its stream of deals, kept durably in OUT/serve_state.json.

    A deal counts as done once every group it yielded was acknowledged by the API, parked in
    the outbox, refused or dropped; only then is it written down. A restart continues after
    the done deals (skipping done ones beyond the first unfinished), so nothing delivered is
    played again; deals that were being played when the worker died are played again, which
    repeats nothing, since they were never delivered.
    """

    def __init__(self, path: Path, stream: int, key: str) -> None:
        self.path, self.stream, self.key = path, stream, key
        state = self._read().get(key, {})
        self.watermark = int(state.get("watermark", 0))  # every deal below it is done
        self.done: set[int] = {int(i) for i in state.get("done", []) if int(i) >= self.watermark}
        self._next = self.watermark

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"cannot read {self.path} ({exc}); it holds this worker's place in its deals: "
                "repair it, or delete it to start the stream again (deals would repeat)"
            ) from None
        return dict(data.get("streams", {})) if isinstance(data, dict) else {}

    def take(self) -> tuple[int, int]:
        """The next deal to play: (index, seed)."""
        while self._next in self.done:
            self._next += 1
        index = self._next
        self._next += 1
        return index, deal_seed(self.stream, index)

    def finish(self, index: int) -> None:
        self.done.add(index)
        while self.watermark in self.done:
            self.done.discard(self.watermark)
            self.watermark += 1
        streams = self._read()
        streams[self.key] = {"watermark": self.watermark, "done": sorted(self.done)}
        _write_durably(self.path, json.dumps({"streams": streams}, indent=1))


def _write_durably(path: Path, text: str) -> None:
    """Replace `path` atomically and on disk: a crash leaves the old version or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class Worker:
    def __init__(self, settings: Settings, player: Player, client: EnvClient, metrics: MetricsLog) -> None:
        self.settings, self.player, self.client, self.metrics = settings, player, client, metrics
        self.cfg = settings.serve
        self.stats = ServeStats()
        self.stopping = asyncio.Event()
        self.worker_id = self.cfg.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        stream = worker_seed(settings.seed, self.worker_id)
        stream_key = f"{self.cfg.env_name}/{self.worker_id}/{settings.seed}"
        self.cursor = DealCursor(Path(settings.out) / "serve_state.json", stream, stream_key)
        # Idempotency-Keys follow from the deal: a deal played again after a crash between
        # the API's answer and writing the cursor is recognised by the API, not queued twice.
        self._key_prefix = hashlib.blake2b(stream_key.encode(), digest_size=12).hexdigest()
        self._tasks: dict[asyncio.Task[DealResult], int] = {}
        self._sent_since_poll = 0  # groups posted (or flushed) since the API last said how many it holds
        self.runner = DealRunner(player, settings.groups, settings.groups.concurrency)
        self.runner.tally = self.stats  # the runner counts what it plays into this worker's stats
        self._last_eval_step: int | None = None
        self._eval_task: asyncio.Task[None] | None = None
        if self.cfg.fidelity_every and not can_probe(player.policy):
            raise ValueError(f"--fidelity-every needs the policy's probabilities of the two calls; "
                             f"{player.policy.name} cannot give them (use the embedded model or a bot)")
        self._scored: list[ScoredDataGroup] = []  # sent since the last fidelity reading (--fidelity-every)
        self._fidelity_task: asyncio.Task[None] | None = None

    def stop(self) -> None:
        self.stopping.set()

    async def register(self) -> int:
        g = self.settings.groups
        answer = await self.client.register_env(
            RegisterEnv(
                max_token_length=self.settings.episode.max_token_length,
                desired_name=self.cfg.env_name,
                weight=self.cfg.weight,
                group_size=g.sequences,
                min_batch_allocation=self.cfg.min_batch_allocation,
                worker_id=self.worker_id,
            ),
            poll_interval_s=self.cfg.poll_interval,
            timeout_s=self.cfg.register_timeout,
        )
        info = (await self.client._request("GET", "/info")).json()
        self.batch_size = int(info.get("batch_size") or -1)
        if self.batch_size <= 0:
            self.batch_size = g.sequences * 8
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
        return max(1, math.ceil(self.cfg.max_batches_offpolicy * self.batch_size / self.settings.groups.sequences))

    def _launch(self) -> None:
        index, seed = self.cursor.take()
        task = asyncio.create_task(self.runner.deal(seed))
        self._tasks[task] = index

    def _room(self, polled_groups: int) -> int:
        """Deals to start now: the off-policy budget minus everything this worker has ahead.

        The API's count is refreshed once per poll; what was posted since is counted here,
        so the bound holds between polls too.
        """
        parked = self.client.outbox.pending_groups() if self.client.outbox is not None else 0
        ahead = polled_groups + self._sent_since_poll + len(self._tasks) + parked
        room = self._groups_ahead() - ahead
        if self.cfg.max_groups is not None:
            room = min(room, self.cfg.max_groups - self.stats.groups_sent - self.stats.groups_parked - len(self._tasks))
        return room

    async def _finish(self, task: asyncio.Task[DealResult]) -> None:
        """Deliver a finished deal's groups, then record the deal as done."""
        index = self._tasks.pop(task)
        for number, result in enumerate(task.result().groups):
            await self._deliver(result, key=f"{self._key_prefix}-{index}-{number}")
        self.cursor.finish(index)

    async def _deliver(self, result: GroupResult, key: str) -> None:
        s = self.stats  # the runner counted the deal's games and groups
        if result.group is None:
            return
        sent = await self.client.submit([result.group.to_json()], key=key)
        self._sent_since_poll += sent.sent_groups
        s.groups_sent += sent.sent_groups
        s.groups_rejected += len(sent.rejected)
        s.groups_parked = sent.parked_groups
        meta = result.group.episodes
        self.metrics.write(
            "group",
            seed=result.seed,
            mean_score=sum(result.group.scores) / len(result.group.scores),
            valid_rate=sum(m.invalid_reason is None for m in meta) / max(1, len(meta)),
            win_rate=sum(isinstance(m, EpisodeRecord) and m.outcome == Outcome.WIN for m in meta) / max(1, len(meta)),
            sent=s.groups_sent,
            parked=s.groups_parked,
            rejected=s.groups_rejected,
        )
        for r in sent.rejected:
            log.error("the API refused a group (HTTP %s): %s", r.status, r.detail)
        if self.cfg.fidelity_every and sent.sent_groups:
            self._scored.append(result.group)
            del self._scored[: -self.cfg.fidelity_every]  # while a reading runs, the newest N wait for the next
            self._maybe_fidelity()

    def _maybe_fidelity(self) -> None:
        """Every `fidelity_every` groups sent: their credit against A^pi of this worker's policy.

        The worker plays a fixed model, so its credit is that policy's advantage, not the
        trainer's; the trainer scores the same groups against its own (`train --fidelity-every`).
        One reading at a time: of the groups sent meanwhile the newest N wait for the next, so a
        reading slower than the worker skips groups instead of holding them all."""
        if len(self._scored) < self.cfg.fidelity_every or (self._fidelity_task and not self._fidelity_task.done()):
            return
        groups, self._scored = self._scored, []
        sent = self.stats.groups_sent

        async def score() -> None:
            t0 = time.monotonic()
            samples = samples_of(groups, self.player, scale=True)
            if not samples:
                return
            fidelity = await exact_fidelity(samples, self.player, budget=PROBE_BUDGET, target_width=PROBE_WIDTH)
            self.metrics.write("fidelity", policy="worker", groups=len(groups), sent=sent,
                               seconds=time.monotonic() - t0, **fidelity.to_dict())
            f = fidelity.scores["all"]
            log.info("fidelity of %d groups against this worker's policy: sign %s (|A| >= 0.01), correlation %s",
                     len(groups), f.sign_clear, f.correlation)

        self._fidelity_task = asyncio.create_task(score())

    def _maybe_evaluate(self, step: int) -> None:
        every = self.cfg.steps_per_eval
        if not every or self._last_eval_step is None or step < self._last_eval_step + every:
            return
        if self._eval_task is not None and not self._eval_task.done():
            return
        self._last_eval_step = step

        async def evaluate() -> None:
            runner = DealRunner(self.player, self.settings.groups, self.settings.evaluate.concurrency)
            episodes = await runner.evaluation(self.cfg.eval_episodes)
            m = compute_metrics(episodes, self.player)
            self.stats.evaluations += 1
            self.metrics.write("eval", step=step, mean_reward=m.mean_reward.mean, win_rate=m.win.rate,
                               invalid_rate=m.invalid.rate, decision_accuracy=m.decision_accuracy.rate,
                               mean_regret=m.mean_regret.mean, episodes=m.episodes)
            log.info("eval at step %s: mean reward %.4f, invalid %.1f%%", step, m.mean_reward.mean or 0,
                     100 * (m.invalid.rate or 0))

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
                    self._sent_since_poll = 0
                    self._maybe_evaluate(status.current_step)
                    if self.client.outbox is not None and self.client.outbox.pending_posts():
                        flushed = await self.client.flush_outbox(RetryPolicy(attempts=1, max_elapsed_s=2.0))
                        self._sent_since_poll += flushed.sent_groups
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
                await self._finish(task)
        await self.shutdown()
        return self.stats

    async def _sleep_or_stop(self, seconds: float) -> None:
        try:  # asyncio.timeout: wait_for can swallow a cancellation on 3.11 (policies/pool.py)
            async with asyncio.timeout(seconds):
                await self.stopping.wait()
        except TimeoutError:
            pass

    async def shutdown(self) -> None:
        """Finish (or give up on) groups in flight, deliver or park them, flush, disconnect."""
        if self._tasks:
            done, pending = await asyncio.wait(self._tasks, timeout=self.cfg.drain_timeout)
            for task in pending:
                task.cancel()
            for task in done:
                if not task.cancelled() and task.exception() is None:
                    await self._finish(task)
            self._tasks.clear()
        if self._eval_task is not None and not self._eval_task.done():
            self._eval_task.cancel()
        if self._fidelity_task is not None:
            try:  # a reading under way is of groups already sent: let it be written
                async with asyncio.timeout(max(5.0, self.cfg.drain_timeout)):
                    await self._fidelity_task  # cancelled at the limit, as wait_for did
            except TimeoutError:
                log.warning("a fidelity reading did not finish within the drain timeout")
            except Exception as exc:  # a measurement: serving went on without it
                log.warning("a fidelity reading failed: %s: %s", type(exc).__name__, exc)
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
    out = prepare_folder(settings.out)
    metrics = MetricsLog(out / "serve_metrics.jsonl", wandb_run)
    try:
        client = EnvClient(settings.serve.api_url, token=settings.serve.api_token, outbox=out / "outbox.sqlite")
    except BaseException:
        metrics.close()
        raise
    loop = asyncio.get_running_loop()
    try:
        worker = Worker(settings, player, client, metrics)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop)
        return await worker.run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await client.aclose()
        metrics.close()
