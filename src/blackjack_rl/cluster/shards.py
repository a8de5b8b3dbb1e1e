"""`evaluate` and `process` on Ray: the deals split into shards, played by actors, merged in seed order.

Why it looks like this:
- Each actor builds its own player from the run's settings, once (the embedded model
  per actor, a torch model, or a client of the shared server pool), and plays shard
  after shard. Every episode's cards and sampling seeds depend only on its deal seed, so
  which actor plays a shard changes nothing: the driver puts the shards back in seed
  order and hands them to the same writers as a local run (`jobs.run_evaluate`,
  `jobs.run_process`), which write the same metrics and the same groups.jsonl.
- Shards are small (several per actor), so the one progress bar moves steadily and a
  lost shard costs little.
- A shard whose actor or node dies is played again by another actor; its result is kept
  once, by shard index, so no deal is lost or counted twice. A shard that raises (a bug,
  not a lost node) stops the run with that error. Dead actors are replaced, and new
  shards go only to actors that Ray has actually placed, so a replacement that waits for
  room never holds work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator

from blackjack_rl.config import Settings
from blackjack_rl.rollout.episodes import Episode
from blackjack_rl.rollout.runner import DealResult, DealRunner
from blackjack_rl.cluster import ClusterError, connected, node_failure_errors, task_error
from blackjack_rl.policies import reads

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 4  # plays of one shard before the run gives up on it
PLACEMENT_TIMEOUT_S = 600.0  # with no actor placed at all for this long, the cluster has no room


class ShardPlayer:
    """One Ray actor: a player built from the run's settings, playing shards on request."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from blackjack_rl.rollout.players import build_player

        self.settings = Settings(**settings)
        self.player = build_player(self.settings)

    def ready(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    async def evaluate(self, first: int, count: int) -> list[Episode]:
        runner = DealRunner(self.player, self.settings.groups, self.settings.evaluate.concurrency)
        return await runner.evaluation(count, first)

    async def deals(self, seeds: list[int]) -> list[DealResult]:
        return await DealRunner(self.player, self.settings.groups, self.settings.groups.concurrency).play_all(seeds)


@dataclass
class _Actor:
    handle: Any
    ready: asyncio.Future[Any] | None  # None once placed
    busy: int = 0
    dead: bool = False


class Shards:
    """The shard scheduler of one command: actors, dispatch, retries, merge."""

    def __init__(self, ray: Any, settings: Settings, actors: int | None = None, cpus_per_actor: float = 1.0,
                 per_actor: int = 2) -> None:
        if cpus_per_actor <= 0:
            raise ValueError(f"--ray-cpus must be > 0, got {cpus_per_actor}")
        self.ray = ray
        cluster_cpus = float(ray.cluster_resources().get("CPU", 1.0))
        self.actors = actors or max(1, int(cluster_cpus // cpus_per_actor))
        if self.actors < 1:
            raise ValueError(f"--ray-actors must be >= 1, got {self.actors}")
        self.cpus = cpus_per_actor
        self.per_actor = per_actor
        payload = settings.model_dump(mode="json")
        # llama.cpp / torch threads: the actor's share, not the node's (a bot or a server has none)
        if payload["policy"]["n_threads"] is None and reads(settings.policy.kind, "n_threads"):
            payload["policy"]["n_threads"] = max(1, math.floor(cpus_per_actor))
        self._payload = payload
        self._remote = ray.remote(ShardPlayer)
        self._replaced = 0  # actors lost and started again, over the whole command

    # -- the two jobs ------------------------------------------------------------------

    async def evaluate(self, n: int, advance: Callable[[int], Any]) -> list[Episode]:
        """`jobs.evaluate.EpisodeSource`: the first n evaluation deals, in seed order."""
        size = self._chunk(n, 500)
        chunks = [(first, min(size, n - first)) for first in range(0, n, size)]
        results: dict[int, list[Episode]] = {}
        async for index, episodes in self._run("evaluate", chunks):
            results[index] = episodes
            advance(len(episodes))
        return [ep for i in range(len(chunks)) for ep in results[i]]

    async def deals(self, seeds: list[int]) -> AsyncIterator[DealResult]:
        """`jobs.process.DealSource`: each deal's results, in seed order, as soon as all before it are in."""
        size = self._chunk(len(seeds), 64)
        chunks = [(seeds[i:i + size],) for i in range(0, len(seeds), size)]
        done: dict[int, list[DealResult]] = {}
        next_out = 0
        async for index, per_deal in self._run("deals", chunks):
            done[index] = per_deal
            while next_out in done:
                for deal in done.pop(next_out):
                    yield deal
                next_out += 1

    def _chunk(self, n: int, largest: int) -> int:
        return max(1, min(largest, math.ceil(n / (self.actors * 4))))

    # -- scheduling --------------------------------------------------------------------

    def _spawn(self) -> _Actor:
        handle = self._remote.options(num_cpus=self.cpus, max_restarts=0, max_concurrency=self.per_actor + 2).remote(
            self._payload)
        return _Actor(handle, asyncio.wrap_future(handle.ready.remote().future()))

    async def _run(self, method: str, chunks: list[tuple[Any, ...]]) -> AsyncIterator[tuple[int, Any]]:
        """Yield (chunk index, result) as shards finish, each index exactly once."""
        failures = node_failure_errors(self.ray)
        actors = [self._spawn() for _ in range(min(self.actors, len(chunks)))]
        todo = deque(range(len(chunks)))
        attempts: Counter[int] = Counter()
        running: dict[asyncio.Future[Any], tuple[int, _Actor]] = {}
        delivered: set[int] = set()
        last_placed = time.monotonic()
        try:
            while todo or running:
                for actor in actors:
                    while todo and actor.ready is None and not actor.dead and actor.busy < self.per_actor:
                        index = todo.popleft()
                        ref = getattr(actor.handle, method).remote(*chunks[index])
                        running[asyncio.wrap_future(ref.future())] = (index, actor)
                        actor.busy += 1
                waiting = [a.ready for a in actors if a.ready is not None]
                if not running and not waiting:
                    raise ClusterError("every Ray actor of this run died and none could be started again")
                done, _ = await asyncio.wait([*running, *waiting], timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    if fut in running:
                        index, actor = running.pop(fut)
                        actor.busy -= 1
                        try:
                            value = fut.result()
                        except self.ray.exceptions.RayTaskError as exc:
                            raise task_error(self.ray, exc, f"shard {index} ({method})") from None
                        except failures as exc:
                            attempts[index] += 1
                            if attempts[index] >= MAX_ATTEMPTS:
                                raise ClusterError(f"shard {index} was lost {attempts[index]} times with its Ray "
                                                   f"actor or node; last error: {exc}") from None
                            log.warning("shard %d lost with its actor (%s); playing it again elsewhere",
                                        index, type(exc).__name__)
                            todo.appendleft(index)
                            self._replace(actors, actor, exc)
                            continue
                        if index not in delivered:
                            delivered.add(index)
                            yield index, value
                    else:
                        actor = next(a for a in actors if a.ready is fut)
                        try:
                            fut.result()
                            actor.ready = None
                        except failures as exc:
                            self._replace(actors, actor, exc)
                if running or any(a.ready is None and not a.dead for a in actors):
                    last_placed = time.monotonic()
                elif time.monotonic() - last_placed > PLACEMENT_TIMEOUT_S:
                    raise ClusterError(f"no Ray actor could be placed for {PLACEMENT_TIMEOUT_S:.0f}s: the cluster has "
                                       f"no node with {self.cpus:g} free CPU(s)")
        finally:
            for fut in running:
                fut.cancel()
            for actor in actors:
                with contextlib.suppress(Exception):
                    self.ray.kill(actor.handle, no_restart=True)

    def _replace(self, actors: list[_Actor], actor: _Actor, error: BaseException) -> None:
        """Start another actor in place of a dead one; an actor that cannot even start (its policy
        fails to load on that node) would otherwise be replaced forever."""
        if actor.dead:
            return
        actor.dead = True
        self._replaced += 1
        if self._replaced > MAX_ATTEMPTS * self.actors:
            last = str(error).strip().splitlines()
            raise ClusterError(f"{self._replaced} Ray actors of this run died; the last one: "
                               f"{type(error).__name__}: {last[-1] if last else ''}")
        with contextlib.suppress(Exception):
            self.ray.kill(actor.handle, no_restart=True)
        actors[actors.index(actor)] = self._spawn()


@contextlib.contextmanager
def shards_for(address: str | None, settings: Settings, actors: int | None = None,
               cpus_per_actor: float = 1.0) -> Iterator[Shards | None]:
    """A Shards scheduler on the cluster at `address`, or None (play locally) when there is no address."""
    if address is None:
        yield None
        return
    with connected(address) as ray:
        yield Shards(ray, settings, actors, cpus_per_actor)
