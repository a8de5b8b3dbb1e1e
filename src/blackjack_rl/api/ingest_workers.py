"""Validation in worker processes, so ingest uses more than one core.

Parsing and checking a group is CPU work that holds Python's GIL (~0.7 ms for 16 x 300
tokens with logprobs, about half of what ingest costs in all). With `ingest_workers = N > 0`
it runs in N processes while the server process only moves bytes, talks HTTP and writes
SQLite; with 0 it runs in threads of the server process, the better choice on one core.

Each worker is one spawned process joined to the server by a socket pair. The server writes
a post to it from the event loop (a length-prefixed frame: a small pickled header, then the
body's bytes as sent) and reads the answer there too, so no thread of the server process
takes part and nothing is pickled but the header and the answer. The answer leaves out the
body when the group is stored as sent (the usual gzip post): the server still holds it.
A worker ends when its socket closes, which happens when the server process is gone, even
after a SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import multiprocessing
import pickle
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread

from blackjack_rl.threads import usable_cpus
from blackjack_rl.api.errors import ApiError
from blackjack_rl.api.ingest import IngestContext, PreparedGroup, prepare_groups

log = logging.getLogger(__name__)

#: A frame: the header's length and the body's length, then both.
_FRAME = struct.Struct("<IQ")
#: An answer: its length, then the pickled answer.
_ANSWER = struct.Struct("<Q")
#: Stands for the post's own bytes in an answer (a group stored as the client sent it).
_AS_SENT = None
_READY = -1  # the job id of the frame a worker sends once it has started


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


# --- the worker process ----------------------------------------------------------------------


def _read_exactly(stream: Any, n: int) -> bytes | None:
    data: bytes = stream.read(n)
    if len(data) != n:
        return None  # the server closed its end: it has stopped, or was killed
    return data


def _answer(job: int, outcome: tuple[Any, ...]) -> bytes:
    try:
        payload = pickle.dumps((job, *outcome), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - an exception that does not pickle
        payload = pickle.dumps((job, False, RuntimeError(f"{type(exc).__name__}: {exc}")))
    return _ANSWER.pack(len(payload)) + payload


def serve_posts(sock: socket.socket) -> None:
    """A worker's whole life: read posts from the server, answer each, until its socket closes."""
    ctx: IngestContext | None = None
    with sock, sock.makefile("rb") as stream:
        sock.sendall(_answer(_READY, (True, None)))
        while True:
            head = _read_exactly(stream, _FRAME.size)
            if head is None:
                return
            header_len, body_len = _FRAME.unpack(head)
            header = _read_exactly(stream, header_len)
            raw = _read_exactly(stream, body_len) if body_len else b""
            if header is None or raw is None:
                return
            job, as_list, coding, max_bytes, with_digest, new_ctx = pickle.loads(header)
            if new_ctx is not None:
                ctx = new_ctx
            try:
                assert ctx is not None, "a post arrived before any context"
                groups, digest = prepare_post(raw, coding, ctx, as_list, max_bytes, with_digest)
                # Plain tuples pickle faster than dataclasses; the body itself stays behind.
                light = [(g.env_id, g.n_seq, g.fmt, _AS_SENT if g.data is raw else g.data, g.suffix) for g in groups]
                outcome: tuple[Any, ...] = (True, (light, digest))
            except Exception as exc:  # noqa: BLE001 - the server raises it for the request
                outcome = (False, exc)
            sock.sendall(_answer(job, outcome))


# --- the server's side -------------------------------------------------------------------------


class _WorkerGone(Exception):
    pass


class _Answers(asyncio.Protocol):
    """Reads a worker's answers on the event loop and resolves the posts waiting for them."""

    def __init__(self, worker: _Worker) -> None:
        self.worker = worker
        self.buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        size = _ANSWER.size
        pos = 0
        while len(buf) - pos >= size:
            (length,) = _ANSWER.unpack_from(buf, pos)
            if len(buf) - pos - size < length:
                break
            answer = pickle.loads(memoryview(buf)[pos + size : pos + size + length])
            pos += size + length
            self.worker.answered(answer)
        if pos:
            del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self.worker.lost()


@dataclass(eq=False)
class _Worker:
    process: Any  # multiprocessing's spawned Process
    transport: asyncio.Transport | None = None
    ready: asyncio.Future[None] | None = None
    connected: asyncio.Future[None] | None = None
    pending: dict[int, tuple[asyncio.Future[Any], bytes]] = field(default_factory=dict)
    ctx: IngestContext | None = None  # the context last sent; the worker keeps it
    gone: bool = False
    on_lost: Any = None  # called once the worker is gone

    def answered(self, answer: tuple[Any, ...]) -> None:
        job, ok, value = answer
        if job == _READY:
            if self.ready is not None and not self.ready.done():
                self.ready.set_result(None)
            return
        entry = self.pending.pop(job, None)
        if entry is None:
            return
        fut, raw = entry
        if fut.done():
            return
        if ok:
            groups, digest = value
            fut.set_result((
                [PreparedGroup(env, n, fmt, raw if data is _AS_SENT else data, suffix) for env, n, fmt, data, suffix in groups],
                digest,
            ))
        else:
            fut.set_exception(value)

    def connect_done(self, task: asyncio.Task[Any]) -> None:
        assert self.connected is not None
        if task.cancelled() or task.exception() is not None:
            self.lost()
            return
        self.transport = task.result()[0]
        if not self.connected.done():
            self.connected.set_result(None)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def lost(self) -> None:
        self.gone = True
        for waiting in (self.ready, self.connected):
            if waiting is not None and not waiting.done():
                waiting.set_exception(_WorkerGone())
                waiting.exception()  # retrieved: nobody may be waiting for it
        pending, self.pending = self.pending, {}
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(_WorkerGone())
        if self.on_lost is not None:
            self.on_lost(self)


class IngestPool:
    """Where posts are checked: N worker processes, or (N = 0) threads of the server process.

    Never the event loop itself: checking a 16 MB body takes long enough to stall every
    other request if it ran there.
    """

    def __init__(self, workers: int | None, threads: int = 2) -> None:
        self.workers = default_workers() if workers is None else workers
        self.threads = threads
        self._procs: list[_Worker] = []
        self._limiter: anyio.CapacityLimiter | None = None
        self._jobs = itertools.count()
        self.replaced = 0  # workers started in place of ones that died
        self._running = False  # started, and not shut down: a worker that dies is replaced

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (tests kill one to see the pool recover)."""
        return [w.process.pid for w in self._procs if not w.gone]

    def _spawn(self) -> _Worker:
        """Start one worker; its socket joins the event loop as soon as the loop runs."""
        ours, theirs = socket.socketpair()
        try:
            process = multiprocessing.get_context("spawn").Process(
                target=serve_posts, args=(theirs,), name="blackjack-rl-ingest", daemon=True
            )
            process.start()
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the worker holds its own copy: its end closes when it ends
        loop = asyncio.get_running_loop()
        worker = _Worker(process, ready=loop.create_future(), connected=loop.create_future(), on_lost=self._replace)
        connecting = loop.create_task(loop.connect_accepted_socket(lambda: _Answers(worker), sock=ours))
        connecting.add_done_callback(worker.connect_done)
        return worker

    async def start(self) -> None:
        """Start the workers now, so the first posts don't wait for interpreters to boot."""
        # Bounds the memory of posts being checked at once in threads (each holds its decompressed body).
        self._limiter = anyio.CapacityLimiter(self.threads)
        if self.workers <= 0:
            return
        try:
            self._procs = [self._spawn() for _ in range(self.workers)]
            await asyncio.gather(*(w.ready for w in self._procs if w.ready is not None))
            self._running = True
        except (_WorkerGone, OSError) as exc:
            # e.g. a script that serves the API without an `if __name__ == "__main__":` guard,
            # which every spawned worker would run again
            log.warning(
                "ingest worker processes could not start (%s); checking posts in the server process",
                type(exc).__name__,
            )
            await self.aclose()
            self.workers = 0

    def _choose(self) -> _Worker:
        live = [w for w in self._procs if not w.gone]
        if not live:
            raise ApiError(503, "no ingest worker is running; send the post again")
        return min(live, key=lambda w: len(w.pending))

    async def prepare(
        self, raw: bytes, coding: str, ctx: IngestContext, *, as_list: bool, max_bytes: int, with_digest: bool
    ) -> tuple[list[PreparedGroup], str]:
        if not self._procs:
            return await anyio.to_thread.run_sync(
                prepare_post, raw, coding, ctx, as_list, max_bytes, with_digest, limiter=self._limiter
            )
        worker = self._choose()
        if worker.transport is None:  # a worker started moments ago
            try:
                await worker.connected
            except _WorkerGone:
                raise ApiError(503, "an ingest worker crashed while checking this post; send it again") from None
        assert worker.transport is not None
        job = next(self._jobs)
        # The context goes along only when it changed since this worker's last post.
        header = pickle.dumps(
            (job, as_list, coding, max_bytes, with_digest, None if ctx is worker.ctx else ctx),
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        fut: asyncio.Future[tuple[list[PreparedGroup], str]] = asyncio.get_running_loop().create_future()
        worker.pending[job] = (fut, raw)
        worker.ctx = ctx
        worker.transport.writelines([_FRAME.pack(len(header), len(raw)), header, raw])
        try:
            return await fut
        except _WorkerGone:
            raise ApiError(503, "an ingest worker crashed while checking this post; send it again") from None
        except asyncio.CancelledError:
            worker.pending.pop(job, None)
            raise

    def _replace(self, worker: _Worker) -> None:
        """Start a new worker in place of one that died (once, whoever notices first).

        One that died before it ever started is not replaced (it would only die again, over
        and over): the pool goes on with the others, or checks posts in threads if none is left.
        """
        if not self._running or worker not in self._procs:
            return
        self._procs.remove(worker)
        worker.close()
        with contextlib.suppress(Exception):
            worker.process.join(0)
        ready = worker.ready
        if ready is None or not ready.done() or ready.cancelled() or ready.exception() is not None:
            log.error(
                "an ingest worker died before it started; %s",
                "going on with the others" if self._procs else "checking posts in the server process",
            )
            if not self._procs:
                self.workers = 0
            return
        log.error("an ingest worker died; starting a new one")
        self._procs.append(self._spawn())
        self.replaced += 1

    async def aclose(self) -> None:
        """Stop the workers: each reads the end of its socket and exits."""
        self._running = False
        procs, self._procs = self._procs, []
        for w in procs:
            w.close()
        if procs:
            await anyio.to_thread.run_sync(_join, procs)


def _join(procs: list[_Worker]) -> None:
    for w in procs:
        w.process.join(5)
        if w.process.is_alive():
            w.process.kill()
            w.process.join(5)
