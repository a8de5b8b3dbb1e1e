"""`serve --ray --workers N`: N environment workers as Ray actors, supervised, feeding one trajectory API.

Why it looks like this:
- Each actor runs the ordinary worker (`serve.serve`) with its own worker id
  (`ID-0` ... `ID-(N-1)`) and its own output folder `OUT/<worker id>/`: its deals, its
  outbox and its position in its seed stream live there, so a restarted worker (same
  id, same folder) continues where the dead one stopped and re-sends what it had
  parked. On several nodes, OUT must be a shared filesystem for that (docs/cluster.md).
- The actor runs `serve` on its main thread (a one-at-a-time actor), so the worker's own
  SIGTERM handling is the drain: stopping the command sends SIGTERM to every worker
  process, through a zero-CPU task pinned to that worker's node, and each one finishes
  its groups in flight, flushes its outbox and disconnects, exactly as a `serve` process does.
- The driver restarts a worker whose actor or node died (up to `max_restarts` times per
  worker, after a backoff that doubles from 1 s to 30 s), and stops them all on one Ctrl-C
  or SIGTERM. A worker that raises is reported, not restarted, except when it found its
  outbox still held: its predecessor's process had not finished exiting, so it tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from blackjack_rl.api.dblock import DatabaseInUse
from blackjack_rl.config import Settings
from blackjack_rl.jobs.serve import ServeStats
from blackjack_rl.cluster import ClusterError, connected, node_failure_errors, task_error
from blackjack_rl.policies import reads

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = 1.0  # doubling with each restart of the worker, up to MAX_BACKOFF_S
MAX_BACKOFF_S = 30.0
NAME_WAIT_S = 30


class ServeWorker:
    """One Ray actor: one `serve` worker. Run with max_concurrency=1, so `run` owns the main thread."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = Settings(**settings)

    def where(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def run(self) -> ServeStats:
        from blackjack_rl.rollout.players import run_with_player
        from blackjack_rl.jobs.serve import serve

        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        return run_with_player(self.settings, lambda player: serve(self.settings, player))


def _terminate(pid: int) -> bool:
    """Runs on the worker's node: SIGTERM to the worker process (serve's drain)."""
    try:
        os.kill(pid, signal.SIGTERM)
        return True
    except ProcessLookupError:
        return False


@dataclass
class _Slot:
    worker_id: str
    payload: dict[str, Any]
    handle: Any = None
    where: asyncio.Future[Any] | None = None  # (node id, pid) once Ray has placed the actor
    run: asyncio.Future[Any] | None = None
    restarts: int = 0
    stats: list[ServeStats] = field(default_factory=list)


@dataclass
class ClusterServeStats:
    """Totals over every worker and every restart (a dead actor's own counts die with it)."""

    workers: int
    restarts: int
    totals: ServeStats
    per_worker: dict[str, ServeStats]


def actor_name(worker_id: str) -> str:
    return f"serve:{worker_id}"


def worker_ids(base: str | None, n: int) -> list[str]:
    base = base or socket.gethostname()
    return [f"{base}-{i}" for i in range(n)]


class Supervisor:
    def __init__(self, ray: Any, settings: Settings) -> None:
        self.ray = ray
        self.settings = settings
        r = settings.ray
        self.cpus, self.max_restarts = r.cpus, r.max_restarts
        self._remote = ray.remote(ServeWorker)
        self._terminate = ray.remote(num_cpus=0, max_retries=0)(_terminate)
        self.slots: list[_Slot] = []
        for wid in worker_ids(settings.serve.worker_id, r.workers):
            payload = settings.model_dump(mode="json")
            payload["serve"]["worker_id"] = wid
            payload["out"] = str(Path(settings.out) / wid)
            if payload["policy"]["n_threads"] is None and reads(settings.policy.kind, "n_threads"):
                payload["policy"]["n_threads"] = max(1, int(self.cpus))
            self.slots.append(_Slot(wid, payload))
        self.stopping = asyncio.Event()

    async def _start(self, slot: _Slot) -> None:
        """Create the actor and queue `where` then `run` on it (one at a time, in that order);
        nothing here waits for Ray to place it, so a worker waiting for room holds up no other."""
        for _ in range(NAME_WAIT_S * 5):
            try:
                slot.handle = self._remote.options(num_cpus=self.cpus, max_restarts=0, max_concurrency=1,
                                                   name=actor_name(slot.worker_id)).remote(slot.payload)
                break
            except ValueError:  # the name is still the dead actor's until Ray has finished removing it
                await asyncio.sleep(0.2)
        else:
            raise ClusterError(f"worker {slot.worker_id}: its actor name stayed taken for {NAME_WAIT_S}s")
        slot.where = asyncio.wrap_future(slot.handle.where.remote().future())
        slot.run = asyncio.wrap_future(slot.handle.run.remote().future())

    async def stop_all(self) -> None:
        """SIGTERM to every live worker process, which then drains on its own; a worker not
        started yet has nothing to drain and is simply removed."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        calls = []
        for slot in self.slots:
            if slot.run is None or slot.run.done():
                continue
            if slot.where is not None and slot.where.done() and slot.where.exception() is None:
                node, pid = slot.where.result()
                strategy = NodeAffinitySchedulingStrategy(node, soft=False)
                ref = self._terminate.options(scheduling_strategy=strategy).remote(pid)
                calls.append(asyncio.wrap_future(ref.future()))
            else:
                with contextlib.suppress(Exception):
                    self.ray.kill(slot.handle, no_restart=True)
        for call in calls:
            with contextlib.suppress(Exception):
                await call

    async def run(self) -> ClusterServeStats:
        for slot in self.slots:
            await self._start(slot)
        failures = node_failure_errors(self.ray)
        stop_wait: asyncio.Task[bool] = asyncio.create_task(self.stopping.wait())
        stopped = False
        try:
            while True:
                live = {s.run: s for s in self.slots if s.run is not None and not s.run.done()}
                finished = [s for s in self.slots if s.run is not None and s.run.done() and s.handle is not None]
                for slot in finished:
                    await self._collect(slot, failures, restart=not stopped)
                live = {s.run: s for s in self.slots if s.run is not None and not s.run.done()}
                if not live:
                    break
                await asyncio.wait([*live, stop_wait], return_when=asyncio.FIRST_COMPLETED)
                if stop_wait.done() and not stopped:
                    stopped = True
                    log.warning("stopping: every worker drains its groups in flight")
                    await self.stop_all()
        finally:
            stop_wait.cancel()
            for slot in self.slots:
                if slot.handle is not None:
                    with contextlib.suppress(Exception):
                        self.ray.kill(slot.handle, no_restart=True)
        return self._totals()

    async def _collect(self, slot: _Slot, failures: tuple[type[BaseException], ...], restart: bool) -> None:
        assert slot.run is not None
        try:
            slot.stats.append(slot.run.result())
            slot.handle = None
            return
        except self.ray.exceptions.RayTaskError as exc:
            if not isinstance(getattr(exc, "cause", None), DatabaseInUse):
                raise task_error(self.ray, exc, f"worker {slot.worker_id}") from None
            error = exc  # its predecessor's process still holds the outbox: it is about to exit, try again
        except failures as exc:
            error = exc
        with contextlib.suppress(Exception):
            self.ray.kill(slot.handle, no_restart=True)
        slot.handle = None
        if not restart:
            log.warning("worker %s died while stopping (%s)", slot.worker_id, type(error).__name__)
            return
        slot.restarts += 1
        if slot.restarts > self.max_restarts:
            raise ClusterError(f"worker {slot.worker_id} died {slot.restarts} times; giving up (last: {error})")
        log.warning("worker %s died (%s); restarting it (restart %d)", slot.worker_id, type(error).__name__,
                    slot.restarts)
        await asyncio.sleep(min(MAX_BACKOFF_S, RESTART_BACKOFF_S * 2 ** min(slot.restarts - 1, 8)))
        if not self.stopping.is_set():
            await self._start(slot)

    def _totals(self) -> ClusterServeStats:
        totals, per_worker = ServeStats(), {}
        for slot in self.slots:
            mine = ServeStats()
            for run in slot.stats:
                _add(mine, run)
                mine.groups_parked = run.groups_parked  # what the last run left parked is what is still parked
            per_worker[slot.worker_id] = mine
            _add(totals, mine)
        return ClusterServeStats(len(self.slots), sum(s.restarts for s in self.slots), totals, per_worker)


def _add(into: ServeStats, more: ServeStats) -> None:
    for f in fields(ServeStats):
        a, b = getattr(into, f.name), getattr(more, f.name)
        if isinstance(a, dict):
            for k, v in b.items():
                a[k] = a.get(k, 0) + v
        else:
            setattr(into, f.name, a + b)


def serve_on_ray(settings: Settings) -> ClusterServeStats:
    """The `serve --ray` command: start the workers, supervise them, stop them all on SIGINT/SIGTERM."""
    assert settings.ray.address is not None
    with connected(settings.ray.address) as ray:

        async def main() -> ClusterServeStats:
            supervisor = Supervisor(ray, settings)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, supervisor.stopping.set)
            try:
                return await supervisor.run()
            finally:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)

        return asyncio.run(main())
