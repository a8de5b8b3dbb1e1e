"""Validation in worker processes, so ingest uses more than one core.

Parsing and checking a group is CPU work that holds Python's GIL (~1.3 ms for 16 x 300
tokens with logprobs). With `ingest_workers = N > 0` it runs in N processes while the server
process only moves bytes, talks HTTP and writes SQLite. With 0 it runs in the server
process, which is simplest and fastest when there are few cores.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial

from .errors import ApiError
from .ingest import IngestContext, PreparedGroup, prepare_groups

log = logging.getLogger(__name__)


def _ready() -> bool:
    return True


class IngestPool:
    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    def _new_pool(self) -> ProcessPoolExecutor:
        # spawn: a clean interpreter, never a fork of a process that runs threads.
        return ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"))

    async def start(self) -> None:
        """Start the workers now, so the first posts don't wait for interpreters to boot."""
        if self.workers <= 0:
            return
        self._pool = self._new_pool()
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._pool, _ready) for _ in range(self.workers)))

    async def prepare(
        self, raw: bytes, coding: str, ctx: IngestContext, *, as_list: bool, max_bytes: int
    ) -> list[PreparedGroup]:
        if self._pool is None:
            return prepare_groups(raw, coding, ctx, as_list=as_list, max_bytes=max_bytes)
        job = partial(prepare_groups, raw, coding, ctx, as_list=as_list, max_bytes=max_bytes)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, job)
        except BrokenProcessPool:
            log.error("an ingest worker died; starting a new pool")
            broken, self._pool = self._pool, self._new_pool()
            broken.shutdown(wait=False, cancel_futures=True)
            raise ApiError(503, "an ingest worker crashed while checking this post; send it again") from None

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
