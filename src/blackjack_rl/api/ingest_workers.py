"""Validation in worker processes, so ingest uses more than one core.

Parsing and checking a group is CPU work that holds Python's GIL (~1 ms for 16 x 300
tokens with logprobs, ~40% of what the server process spends per post). With
`ingest_workers = N > 0` it runs in N processes while the server process only moves bytes,
talks HTTP and writes SQLite; one worker raised ingest from 461 to 605 posts/s on 2 cores
(bench/bench_api.py). With 0 it runs in the server process, the better choice on one core.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial

import anyio
import anyio.to_thread

from blackjack_rl.threads import usable_cpus
from blackjack_rl.api.errors import ApiError
from blackjack_rl.api.ingest import IngestContext, PreparedGroup, prepare_groups

log = logging.getLogger(__name__)


def _ready() -> bool:
    return True


def _end_with(parent: int) -> None:
    """In each worker: exit once the server process is gone.

    A server killed with SIGKILL never shuts its pool down, and a spawned worker holds both
    ends of its own job pipe, so it would wait for work forever; it watches its parent instead
    (on POSIX an orphan's parent id changes; on Windows it does not, and this does nothing).
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    with contextlib.suppress(RuntimeError):  # no thread to spare: the worker still checks posts
        threading.Thread(target=watch, name="watch-server", daemon=True).start()


def body_digest(raw: bytes, as_list: bool) -> str:
    """What identifies a post for its Idempotency-Key: the endpoint and the bytes as sent."""
    h = hashlib.blake2b(raw, digest_size=16)
    h.update(b"list" if as_list else b"one")
    return h.hexdigest()


def prepare_post(
    raw: bytes, coding: str, ctx: IngestContext, as_list: bool, max_bytes: int, with_digest: bool
) -> tuple[list[PreparedGroup], str]:
    """Check a post and, when it carries an Idempotency-Key, fingerprint it, in one hop."""
    groups = prepare_groups(raw, coding, ctx, as_list=as_list, max_bytes=max_bytes)
    return groups, body_digest(raw, as_list) if with_digest else ""


def default_workers(cpus: int | None = None) -> int:
    """One worker once there is a second core for it: the server process stays the bottleneck
    (HTTP, SQLite, serving batches), so more workers only compete with it for cores."""
    return 1 if (cpus or usable_cpus()) >= 2 else 0


class IngestPool:
    """Where posts are checked: N worker processes, or (N = 0) threads of the server process.

    Never the event loop itself: checking a 16 MB body takes long enough to stall every
    other request if it ran there.
    """

    def __init__(self, workers: int | None, threads: int = 2) -> None:
        self.workers = default_workers() if workers is None else workers
        self.threads = threads
        self._pool: ProcessPoolExecutor | None = None
        self._limiter: anyio.CapacityLimiter | None = None

    def _new_pool(self) -> ProcessPoolExecutor:
        # spawn: a clean interpreter, never a fork of a process that runs threads.
        return ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_end_with,
            initargs=(os.getpid(),),
        )

    async def start(self) -> None:
        """Start the workers now, so the first posts don't wait for interpreters to boot."""
        # Bounds the memory of posts being checked at once (each holds its decompressed body).
        self._limiter = anyio.CapacityLimiter(self.threads)
        if self.workers <= 0:
            return
        self._pool = self._new_pool()
        loop = asyncio.get_running_loop()
        try:
            await asyncio.gather(*(loop.run_in_executor(self._pool, _ready) for _ in range(self.workers)))
        except (BrokenProcessPool, OSError) as exc:
            # e.g. a script that serves the API without an `if __name__ == "__main__":` guard,
            # which every spawned worker would run again
            log.warning("ingest worker processes could not start (%s); checking posts in the server process", exc)
            broken, self._pool, self.workers = self._pool, None, 0
            broken.shutdown(wait=False, cancel_futures=True)

    async def prepare(
        self, raw: bytes, coding: str, ctx: IngestContext, *, as_list: bool, max_bytes: int, with_digest: bool
    ) -> tuple[list[PreparedGroup], str]:
        job = partial(prepare_post, raw, coding, ctx, as_list, max_bytes, with_digest)
        pool = self._pool
        if pool is None:
            return await anyio.to_thread.run_sync(job, limiter=self._limiter)
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, job)
        except BrokenProcessPool:
            if self._pool is pool:  # the first post to find it broken replaces it, once
                log.error("an ingest worker died; starting a new pool")
                self._pool = self._new_pool()
                pool.shutdown(wait=False, cancel_futures=True)
            raise ApiError(503, "an ingest worker crashed while checking this post; send it again") from None

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
