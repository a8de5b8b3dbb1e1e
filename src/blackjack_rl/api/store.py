"""Durable state of the trajectory API in one SQLite file (WAL).

What survives `kill -9`: the trainer registration, environment registrations, the step
counter, every group answered with 200, the batch in flight and the Idempotency-Keys.
Group payloads live on disk as compressed blobs; memory holds only counters (per
environment and group size), so it stays flat however long the queue grows.

`Store` is single-threaded by design: `StoreRunner` owns it on one writer thread and runs
callers' operations there, several per transaction (group commit). With
`synchronous=FULL` one fsync then covers many posts, so durability against power loss
costs little throughput.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import math
import os
import queue
import sqlite3
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from blackjack_rl.api.dblock import DatabaseLock, take_lock
from blackjack_rl.api.batching import (
    Candidate,
    divisors_text,
    form_batch,
    minimum_sequences,
    runapi_buffer_release,
    window_for,
)
from blackjack_rl.api.errors import ApiError
from blackjack_rl.api.ingest import IngestContext, PreparedGroup, known_envs_text
from blackjack_rl.api.models import Registration, RegisterEnv

SCHEMA_VERSION = "1"
MIN_ENV_WEIGHT = 0.01  # as Atropos: no environment's weight drops to zero
#: Seconds an environment may stay silent and still be owed its min_batch_allocation share:
#: three polls of `blackjack-rl serve` (one a second; atroposlib's workers poll several times
#: a second). ApiConfig.env_lease_s (--env-lease) sets it.
DEFAULT_ENV_LEASE_S = 3.0
WAIT_FOR_TRAINER = "wait for trainer to start"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS trainers(uuid TEXT PRIMARY KEY, registered_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS envs(
    env_id INTEGER PRIMARY KEY,
    desired_name TEXT NOT NULL,
    real_name TEXT NOT NULL,
    max_token_length INTEGER NOT NULL,
    weight REAL NOT NULL,
    group_size INTEGER NOT NULL,
    min_batch_allocation REAL,
    connected INTEGER NOT NULL,
    registered_at REAL NOT NULL,
    worker_id TEXT
);
CREATE TABLE IF NOT EXISTS queue(
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    env_id INTEGER,
    n_seq INTEGER NOT NULL,
    batch_id INTEGER
);
CREATE INDEX IF NOT EXISTS queue_by_env ON queue(env_id, id) WHERE batch_id IS NULL;
CREATE INDEX IF NOT EXISTS queue_by_batch ON queue(batch_id) WHERE batch_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS payloads(
    id INTEGER PRIMARY KEY,
    fmt INTEGER NOT NULL,
    suffix BLOB NOT NULL,
    data BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS batches(
    batch_id INTEGER PRIMARY KEY AUTOINCREMENT,
    step INTEGER NOT NULL,
    n_groups INTEGER NOT NULL,
    created_at REAL NOT NULL,
    deliveries INTEGER NOT NULL,
    redeliver INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS idempotency(
    key TEXT PRIMARY KEY, response TEXT NOT NULL, created_at REAL NOT NULL, digest TEXT NOT NULL DEFAULT ''
);
"""
#: Columns added after the first release, with how to add them to an older file.
_ADDED_COLUMNS = {
    ("envs", "worker_id"): "ALTER TABLE envs ADD COLUMN worker_id TEXT",
    ("idempotency", "digest"): "ALTER TABLE idempotency ADD COLUMN digest TEXT NOT NULL DEFAULT ''",
}
#: Environments one run may register. Workers that restart under their worker_id reuse
#: their registration, so only a misbehaving client comes near this.
MAX_ENVS = 10_000

T = TypeVar("T")


@dataclass
class EnvRecord:
    env_id: int
    desired_name: str
    real_name: str
    max_token_length: int
    weight: float
    group_size: int
    min_batch_allocation: float | None
    connected: bool
    worker_id: str | None = None
    #: Store.clock() at the last request that named it (registration, status-env, a posted
    #: group, disconnect-env); not stored: after a restart of the API every environment starts
    #: a fresh lease.
    last_seen: float = 0.0


@dataclass
class RunApiBuffer:
    """The queued groups of one environment that Atropos' run-api would still hold back.

    run-api keeps a group whose size differs from its environment's `group_size` out of its
    queue, in a buffer, until some buffered groups add up to `group_size` (failed episodes
    dropped: 2 + 1 + 1 of 4). Here such groups are queued and batched at once; this mirror of
    run-api's buffer only lets `/status-env` count the queue exactly as run-api does.
    """

    groups: list[tuple[int, int]] = field(default_factory=list)  # (queue id, size), oldest first
    target: int = 0  # the group_size `reach` was computed for
    reach: int = 1  # bit j: some of the groups add up to j (j <= target)

    def rebuild(self, target: int) -> None:
        self.target, self.reach = target, 1
        full = (1 << (target + 1)) - 1
        for _, size in self.groups:
            self.reach = (self.reach | (self.reach << size)) & full


@dataclass
class InFlight:
    """The batch handed to the trainer and not yet acknowledged."""

    batch_id: int
    step: int
    redeliver: bool


@dataclass
class BatchRows:
    """A batch to send: ids and stored payloads, decoded outside the writer thread."""

    batch_id: int
    step: int
    redelivered: bool
    payloads: list[tuple[int, bytes, bytes]]  # (fmt, data, suffix) in queue order


@dataclass
class Mirror:
    """In-memory summary of the database: small, and rebuilt from disk at start."""

    trainer: Registration | None = None
    step: int = 0
    started: bool = False
    envs: dict[int, EnvRecord] = field(default_factory=dict)
    counts: Counter[tuple[int | None, int]] = field(default_factory=Counter)  # (env, size) -> groups
    inflight: InFlight | None = None
    #: Queued groups run-api would still buffer, per environment; `held` counts them like `counts`.
    buffers: dict[int, RunApiBuffer] = field(default_factory=dict)
    held: Counter[tuple[int | None, int]] = field(default_factory=Counter)
    held_ids: set[int] = field(default_factory=set)

    @property
    def queued_groups(self) -> int:
        return sum(self.counts.values())

    @property
    def queued_sequences(self) -> int:
        return sum(size * n for (_, size), n in self.counts.items())


class Store:
    """SQLite-backed state. Not thread-safe: use it from one thread (see StoreRunner)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: str = "FULL",
        max_queued_sequences: int = 100_000,
        retry_after_s: int = 2,
        idempotency_ttl_s: float = 86_400.0,
        env_lease_s: float = DEFAULT_ENV_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self.env_lease_s = env_lease_s
        self.clock = clock
        self.max_queued_sequences = max_queued_sequences
        self.retry_after_s = retry_after_s
        self.idempotency_ttl_s = idempotency_ttl_s
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be NORMAL or FULL, not {synchronous!r}")
        self._lock_file: DatabaseLock | None = self._take_lock()
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            self._open(synchronous)
        except BaseException:
            self.close()  # a damaged or foreign file: let go of it
            raise

    def _open(self, synchronous: str) -> None:
        # Only takes effect on a new file. SQLite's default: every commit rewrites the pages it
        # touched into the WAL, and with 16 KB pages a post of one group wrote ~3x the bytes.
        self.db.execute("PRAGMA page_size=4096")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={synchronous}")
        self.db.execute("PRAGMA journal_size_limit=67108864")
        # Checkpoint every 16 MB of WAL (as with the 16 KB pages of earlier files): the longer
        # the interval, the more rewrites of the same pages (and of payloads already served and
        # deleted) one checkpoint copies only once.
        page = int(self.db.execute("PRAGMA page_size").fetchone()[0])
        self.db.execute(f"PRAGMA wal_autocheckpoint={max(1000, (16 << 20) // page)}")
        self.db.execute("PRAGMA busy_timeout=5000")
        # Some builds (Debian's) zero every deleted page, which writes each acknowledged batch's
        # payloads a second time; FAST zeroes deleted content only in pages written anyway.
        self.db.execute("PRAGMA secure_delete=FAST")
        self.db.executescript(_SCHEMA)
        self._add_missing_columns()
        self._check_schema()
        self.mirror = Mirror()
        self.queued_sequences_hint = 0  # readable from other threads (an int, replaced whole)
        self.generation = 0
        self.context = IngestContext(batch_size=None)
        self.latest: tuple[int, bytes, bytes] | None = None
        self._enqueues_since_prune = 0
        self.reload()

    # --- lifecycle ---------------------------------------------------------------------

    def _take_lock(self) -> DatabaseLock:
        return take_lock(self.path)

    def _add_missing_columns(self) -> None:
        for (table, column), sql in _ADDED_COLUMNS.items():
            present = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}
            if column not in present:
                self.db.execute(sql)

    def _check_schema(self) -> None:
        row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row is None:
            self.db.execute("INSERT INTO meta(key, value) VALUES('schema_version', ?)", (SCHEMA_VERSION,))
        elif row[0] != SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.path} has schema version {row[0]}, this API writes {SCHEMA_VERSION}; use a new --db file"
            )

    def close(self) -> None:
        self.db.close()
        if self._lock_file is not None:
            self._lock_file.release()
            self._lock_file = None

    def reload(self) -> None:
        """Rebuild the in-memory summary from disk (at start, or after a failed commit)."""
        m = Mirror()
        meta = dict(self.db.execute("SELECT key, value FROM meta").fetchall())
        if "trainer" in meta:
            # Files written before null was refused may hold null for a defaulted field.
            stored = {k: v for k, v in json.loads(meta["trainer"]).items() if v is not None}
            m.trainer = Registration.model_validate(stored)
        m.step = int(meta.get("step", 0))
        m.started = meta.get("started") == "1"
        for row in self.db.execute(
            "SELECT env_id, desired_name, real_name, max_token_length, weight, group_size, "
            "min_batch_allocation, connected, worker_id FROM envs ORDER BY env_id"
        ):
            m.envs[row[0]] = EnvRecord(*row[:7], connected=bool(row[7]), worker_id=row[8], last_seen=self.clock())
        for env_id, size, n in self.db.execute(
            "SELECT env_id, n_seq, COUNT(*) FROM queue WHERE batch_id IS NULL GROUP BY env_id, n_seq"
        ):
            m.counts[(env_id, size)] = n
        row = self.db.execute("SELECT batch_id, step, redeliver FROM batches ORDER BY batch_id LIMIT 1").fetchone()
        if row is not None:
            m.inflight = InFlight(row[0], row[1], bool(row[2]))
        self.mirror = m
        # run-api's buffers, replayed from the queued groups of other sizes (exact until a
        # batch took some of them; from then on run-api's queue differs anyway).
        for queue_id, env_id, size in self.db.execute(
            "SELECT q.id, q.env_id, q.n_seq FROM queue q JOIN envs e ON e.env_id = q.env_id "
            "WHERE q.batch_id IS NULL AND q.n_seq != e.group_size ORDER BY q.id"
        ):
            self._buffer_like_runapi(env_id, queue_id, size)
        self.queued_sequences_hint = m.queued_sequences
        latest = self.db.execute("SELECT fmt, data, suffix FROM payloads ORDER BY id DESC LIMIT 1").fetchone()
        if latest is not None:
            self.latest = (latest[0], latest[1], latest[2])
        self._publish_context()

    def _publish_context(self) -> None:
        """Hand validation (on other threads) a fresh, immutable view of the registrations."""
        self.generation += 1
        m = self.mirror
        self.context = IngestContext(
            batch_size=m.trainer.batch_size if m.trainer else None,
            max_token_len=m.trainer.max_token_len if m.trainer else -1,
            env_group_sizes={e.env_id: e.group_size for e in m.envs.values()},
            generation=self.generation,
        )

    # --- transactions (used by StoreRunner) ----------------------------------------------

    def begin(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def commit(self) -> None:
        self.db.execute("COMMIT")

    def rollback(self) -> None:
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        self.db.execute("SAVEPOINT op")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK TO op")
            self.db.execute("RELEASE op")
            raise
        self.db.execute("RELEASE op")

    def _set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES(?, ?)", (key, value))

    # --- trainer and environments ---------------------------------------------------------

    def register_trainer(self, reg: Registration) -> int:
        """Record the trainer; the first registration fixes the run, as in Atropos.

        A trainer registering while a batch is in flight is taken to be a restart after a
        crash: that batch is sent again on its next GET /batch.
        """
        m = self.mirror
        trainer_uuid = uuid.uuid4().int
        first = m.trainer is None
        if first and reg.batch_size > self.max_queued_sequences:
            raise ApiError(
                422,
                f"batch_size {reg.batch_size} can never be filled: this API queues at most "
                f"{self.max_queued_sequences} sequences (--max-queued-sequences); use a smaller batch "
                "or start the API with a larger queue",
            )
        if first:
            self._set_meta("trainer", reg.model_dump_json())
            self._set_meta("step", str(reg.starting_step))
            self._set_meta("started", "0")
        self.db.execute(
            "INSERT INTO trainers(uuid, registered_at) VALUES(?, ?)", (str(trainer_uuid), time.time())
        )
        if m.inflight is not None:
            self.db.execute("UPDATE batches SET redeliver=1 WHERE batch_id=?", (m.inflight.batch_id,))
            m.inflight.redeliver = True
        if first:
            m.trainer = reg
            m.step = reg.starting_step
            m.started = False
            self._publish_context()
        return trainer_uuid

    def register_env(self, req: RegisterEnv) -> dict[str, Any]:
        m = self.mirror
        if m.trainer is None or not m.started:
            return {"status": WAIT_FOR_TRAINER}
        batch_size = m.trainer.batch_size
        if req.group_size > batch_size or batch_size % req.group_size:
            raise ApiError(
                422,
                f"group_size {req.group_size} cannot be packed into the trainer's batches of {batch_size} "
                f"sequences; use a size that divides {batch_size} (one of {divisors_text(batch_size)})",
            )
        previous = self._registration_of(req)
        if previous is None and len(m.envs) >= MAX_ENVS:
            raise ApiError(
                409,
                f"{MAX_ENVS} environments are registered in this run; restart workers with their "
                "--worker-id so they reuse their registration, or start a new run (new --db)",
            )
        if previous is not None:
            env_id, real_name = previous.env_id, previous.real_name
        else:
            env_id = max(m.envs, default=-1) + 1
            same_name = sum(1 for e in m.envs.values() if e.desired_name == req.desired_name)
            real_name = f"{req.desired_name}_{same_name}"
        record = EnvRecord(
            env_id=env_id,
            desired_name=req.desired_name,
            real_name=real_name,
            max_token_length=req.max_token_length,
            weight=req.weight,
            group_size=req.group_size,
            min_batch_allocation=req.min_batch_allocation,
            connected=True,
            worker_id=req.worker_id,
            last_seen=self.clock(),
        )
        self.db.execute(
            "INSERT OR REPLACE INTO envs(env_id, desired_name, real_name, max_token_length, weight, group_size, "
            "min_batch_allocation, connected, registered_at, worker_id) VALUES(?, ?, ?, ?, ?, ?, ?, 1, ?, ?)",
            (
                env_id,
                record.desired_name,
                record.real_name,
                record.max_token_length,
                record.weight,
                record.group_size,
                record.min_batch_allocation,
                time.time(),
                record.worker_id,
            ),
        )
        m.envs[env_id] = record
        self._publish_context()
        return {
            "status": "success",
            "env_id": env_id,
            "wandb_name": record.real_name,
            "checkpoint_dir": m.trainer.checkpoint_dir,
            "starting_step": m.step,
            "checkpoint_interval": m.trainer.save_checkpoint_interval,
            "num_steps": m.trainer.num_steps,
        }

    def _registration_of(self, req: RegisterEnv) -> EnvRecord | None:
        """The earlier registration of the same worker (same worker_id and name), if any."""
        if req.worker_id is None:
            return None
        for env in self.mirror.envs.values():
            if env.worker_id == req.worker_id and env.desired_name == req.desired_name:
                return env
        return None

    def _env(self, env_id: int) -> EnvRecord:
        env = self.mirror.envs.get(env_id)
        if env is None:
            raise ApiError(
                404,
                f"env_id {env_id} is not registered here (known: {known_envs_text(self.mirror.envs)}); "
                "register with POST /register-env",
            )
        return env

    def _live(self, env: EnvRecord, now: float) -> bool:
        """Connected and heard from within the lease: only such an environment is owed a share.

        A worker killed without /disconnect-env would otherwise hold back every batch that
        it is owed a part of, forever.
        """
        return env.connected and now - env.last_seen <= self.env_lease_s

    def _seen(self, env_id: int | None) -> None:
        env = self.mirror.envs.get(env_id) if env_id is not None else None
        if env is not None:
            env.last_seen = self.clock()

    def disconnect_env(self, env_id: int) -> dict[str, Any]:
        env = self._env(env_id)
        self._seen(env_id)
        self.db.execute("UPDATE envs SET connected=0 WHERE env_id=?", (env_id,))
        env.connected = False
        return {"status": "success"}

    # --- ingest ---------------------------------------------------------------------------

    def enqueue(
        self,
        groups: list[PreparedGroup],
        *,
        as_list: bool,
        idempotency_key: str | None,
        generation: int,
        digest: str = "",
    ) -> dict[str, Any]:
        """Queue validated groups atomically; replay the first answer for a repeated key.

        `digest` identifies the body: a key reused for a different body is refused (409),
        since answering "received" would tell the client that data was queued when it was not.
        """
        now = time.time()
        for g in groups:
            self._seen(g.env_id)
        if idempotency_key is not None:
            row = self.db.execute(
                "SELECT response, digest FROM idempotency WHERE key=?", (idempotency_key,)
            ).fetchone()
            if row is not None:
                if row[1] and digest and row[1] != digest:
                    raise ApiError(
                        409,
                        f"Idempotency-Key {idempotency_key!r} was already used for a different body; "
                        "send new data with a new key (a retry must repeat the same bytes)",
                    )
                return dict(json.loads(row[0]))
        m = self.mirror
        if generation != self.generation:
            self._recheck(groups)
        incoming = sum(g.n_seq for g in groups)
        if incoming > self.max_queued_sequences:
            raise ApiError(
                413,
                f"this post holds {incoming} sequences, more than the queue may ever hold "
                f"({self.max_queued_sequences}); send fewer groups per request",
            )
        queued = m.queued_sequences
        if queued + incoming > self.max_queued_sequences:
            raise ApiError(
                503,
                f"queue is full: {queued} of {self.max_queued_sequences} sequences are waiting for the "
                f"trainer; retry after {self.retry_after_s} s",
                {"Retry-After": str(self.retry_after_s)},
            )
        queue_ids: list[int] = []
        for g in groups:
            cur = self.db.execute("INSERT INTO queue(env_id, n_seq) VALUES(?, ?)", (g.env_id, g.n_seq))
            queue_ids.append(int(cur.lastrowid or 0))
            self.db.execute(
                "INSERT INTO payloads(id, fmt, suffix, data) VALUES(?, ?, ?, ?)", (cur.lastrowid, g.fmt, g.suffix, g.data)
            )
        response: dict[str, Any] = (
            {"status": "received", "groups_processed": len(groups)} if as_list else {"status": "received"}
        )
        if idempotency_key is not None:
            self.db.execute(
                "INSERT INTO idempotency(key, response, created_at, digest) VALUES(?, ?, ?, ?)",
                (idempotency_key, json.dumps(response), now, digest),
            )
        if self._enqueues_since_prune >= 1000:
            self.db.execute("DELETE FROM idempotency WHERE created_at < ?", (now - self.idempotency_ttl_s,))
            self._enqueues_since_prune = 0
        self._enqueues_since_prune += 1
        for g, queue_id in zip(groups, queue_ids):
            m.counts[(g.env_id, g.n_seq)] += 1
            self._buffer_like_runapi(g.env_id, queue_id, g.n_seq)
        self.queued_sequences_hint = m.queued_sequences
        if groups:
            last = groups[-1]
            self.latest = (last.fmt, last.data, last.suffix)
        return response

    def _recheck(self, groups: list[PreparedGroup]) -> None:
        """Registrations changed while the groups were validated: check what could differ."""
        ctx = self.context
        for g in groups:
            if ctx.batch_size is None or ctx.batch_size % g.n_seq:
                raise ApiError(503, "the trainer registration changed while this post was checked; send it again")
            if g.env_id is not None and g.env_id not in ctx.env_group_sizes:
                raise ApiError(422, f"env_id {g.env_id} is not registered here; register with POST /register-env")

    def _buffer_like_runapi(self, env_id: int | None, queue_id: int, size: int) -> None:
        """Follow run-api's buffer for a group just queued: hold it there if its size is not its
        environment's group_size, then release what run-api would release after this post."""
        m = self.mirror
        env = m.envs.get(env_id) if env_id is not None else None
        if env is None or size == env.group_size:
            return  # run-api queues it at once
        buffer = m.buffers.setdefault(env.env_id, RunApiBuffer())
        buffer.groups.append((queue_id, size))
        m.held[(env_id, size)] += 1
        m.held_ids.add(queue_id)
        if buffer.target != env.group_size:
            buffer.rebuild(env.group_size)
        else:
            buffer.reach = (buffer.reach | (buffer.reach << size)) & ((1 << (buffer.target + 1)) - 1)
        if not (buffer.reach >> buffer.target) & 1:
            return  # nothing adds up to group_size: run-api releases nothing (the usual case, in O(1))
        picked = runapi_buffer_release([s for _, s in buffer.groups], buffer.target)
        self._unbuffer([Candidate(buffer.groups[i][0], env_id, buffer.groups[i][1]) for i in picked])

    def _unbuffer(self, groups: list[Candidate]) -> None:
        """Groups leave run-api's buffer: released into its queue, or (here only) batched."""
        m = self.mirror
        if not groups:
            return
        gone = {c.id for c in groups}
        for c in groups:
            key = (c.env_id, c.size)
            m.held[key] -= 1
            if m.held[key] <= 0:
                del m.held[key]
        m.held_ids -= gone
        for env_id in {c.env_id for c in groups}:
            buffer = m.buffers.get(env_id) if env_id is not None else None
            if buffer is None:
                continue
            buffer.groups = [g for g in buffer.groups if g[0] not in gone]
            if buffer.groups:
                buffer.rebuild(buffer.target)
            else:
                del m.buffers[env_id]

    # --- batches --------------------------------------------------------------------------

    def next_batch(self, ack: int | None) -> BatchRows | None:
        """The trainer's GET /batch: acknowledge or resend the batch in flight, else form one.

        Without `ack`, asking again acknowledges the batch in flight, unless the trainer
        re-registered since (then it is sent again). With `ack`, only that batch id is
        acknowledged; any other batch in flight was not received and is sent again.
        """
        m = self.mirror
        if m.trainer is None:
            raise ApiError(409, "no trainer has registered; POST /register first")
        start = not m.started
        if start:
            self._set_meta("started", "1")
        flight = m.inflight
        acknowledged = False
        if flight is not None:
            resend = flight.redeliver if ack is None else flight.batch_id != ack
            if resend:
                self.db.execute(
                    "UPDATE batches SET redeliver=0, deliveries=deliveries+1 WHERE batch_id=?", (flight.batch_id,)
                )
                rows = self._payloads(flight.batch_id)
                flight.redeliver = False
                m.started = True
                return BatchRows(flight.batch_id, flight.step, True, rows)
            self.db.execute(
                "DELETE FROM payloads WHERE id IN (SELECT id FROM queue WHERE batch_id=?)", (flight.batch_id,)
            )
            self.db.execute("DELETE FROM queue WHERE batch_id=?", (flight.batch_id,))
            self.db.execute("DELETE FROM batches WHERE batch_id=?", (flight.batch_id,))
            acknowledged = True
        chosen = self._choose(m.trainer.batch_size)
        result: BatchRows | None = None
        if chosen:
            step = m.step + 1
            cur = self.db.execute(
                "INSERT INTO batches(step, n_groups, created_at, deliveries, redeliver) VALUES(?, ?, ?, 1, 0)",
                (step, len(chosen), time.time()),
            )
            batch_id = int(cur.lastrowid or 0)
            self.db.executemany("UPDATE queue SET batch_id=? WHERE id=?", [(batch_id, c.id) for c in chosen])
            self._set_meta("step", str(step))
            result = BatchRows(batch_id, step, False, self._payloads(batch_id))
        # Everything that could fail has run; now update the summary.
        m.started = True
        if acknowledged:
            m.inflight = None
        if result is not None:
            for c in chosen or ():
                key = (c.env_id, c.size)
                m.counts[key] -= 1
                if m.counts[key] == 0:
                    del m.counts[key]
            self._unbuffer([c for c in chosen or () if c.id in m.held_ids])
            m.step = result.step
            m.inflight = InFlight(result.batch_id, result.step, False)
            self.queued_sequences_hint = m.queued_sequences
        return result

    def _payloads(self, batch_id: int) -> list[tuple[int, bytes, bytes]]:
        return [
            (fmt, data, suffix)
            for fmt, data, suffix in self.db.execute(
                "SELECT p.fmt, p.data, p.suffix FROM queue q JOIN payloads p ON p.id = q.id "
                "WHERE q.batch_id=? ORDER BY q.id",
                (batch_id,),
            )
        ]

    def _choose(self, batch_size: int) -> list[Candidate] | None:
        m = self.mirror
        if m.queued_sequences < batch_size:
            return None
        now = self.clock()
        allocations = {
            e.env_id: e.min_batch_allocation
            for e in m.envs.values()
            if e.min_batch_allocation is not None and self._live(e, now)
        }
        smallest: dict[int, int] = {}
        for env_id, size in m.counts:
            if env_id in allocations:
                smallest[env_id] = min(size, smallest.get(env_id, size))
        owed = minimum_sequences(batch_size, allocations, smallest)
        window = window_for(batch_size) + (batch_size if owed else 0)
        oldest = self._candidates("SELECT id, env_id, n_seq FROM queue WHERE batch_id IS NULL ORDER BY id LIMIT ?", (window,))
        owed_candidates = {
            env: self._candidates(
                "SELECT id, env_id, n_seq FROM queue WHERE batch_id IS NULL AND env_id=? ORDER BY id LIMIT ?",
                (env, window),
            )
            for env in owed
        }
        return form_batch(oldest, batch_size, owed, owed_candidates)

    def _candidates(self, sql: str, args: tuple[Any, ...]) -> list[Candidate]:
        return [Candidate(i, e, n) for i, e, n in self.db.execute(sql, args)]

    # --- reads ----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {"current_step": self.mirror.step, "queue_size": self.mirror.queued_groups}

    def info(self) -> dict[str, Any]:
        t = self.mirror.trainer
        return {"batch_size": t.batch_size if t else -1, "max_token_len": t.max_token_len if t else -1}

    def wandb_info(self) -> dict[str, Any]:
        t = self.mirror.trainer
        return {"group": t.wandb_group if t else None, "project": t.wandb_project if t else None}

    def status_env(self, env_id: int) -> dict[str, Any]:
        """Atropos' /status-env numbers: how much of the queue is this environment's, and its weight."""
        m = self.mirror
        me = self._env(env_id)
        self._seen(env_id)
        now = self.clock()
        connected = [e for e in m.envs.values() if self._live(e, now)]
        total = sum(e.max_token_length * max(0.0, e.weight) for e in connected)
        weight = me.max_token_length * me.weight / total if total > 0 else 1.0
        weight = max(MIN_ENV_WEIGHT, weight)
        allocated = sum(e.min_batch_allocation or 0.0 for e in connected)
        batch_size = m.trainer.batch_size if m.trainer else 0
        owed = {
            e.env_id: int(batch_size * e.min_batch_allocation)
            for e in connected
            if e.min_batch_allocation is not None
        }
        # The queue as run-api holds it (without the groups it would still buffer), and run-api's
        # arithmetic on it, step for step, so atroposlib workers budget alike against both.
        queued = m.counts - m.held if m.held else m.counts
        max_group = max([1] + [size for _, size in queued])
        own_group = max([me.group_size] + [size for env, size in queued if env == env_id])
        own = 0
        others: Counter[int | None] = Counter()
        for (env, size), n in queued.items():
            if env == env_id:
                own += size * n
            else:
                others[env] += size * n
        available = 0
        if max_group > 1:  # run-api counts no other environment's groups while every group has one sequence
            available = sum(
                max(0, math.ceil(seqs / max_group) * max_group - (owed.get(env, 0) if env is not None else 0))
                for env, seqs in others.items()
            )
        return {
            "current_step": m.step,
            "queue_size": (own + available) // own_group,
            "unallocated_fraction": 1.0 - min(allocated, 1.0),
            "self_queue_size": own // own_group,
            "max_group_size": max_group,
            "env_weight": weight,
        }

    # --- reset ----------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the run: registrations, step, queue, batch in flight. Ids keep increasing."""
        for table in ("trainers", "envs", "queue", "payloads", "batches", "idempotency"):
            self.db.execute(f"DELETE FROM {table}")  # noqa: S608 - fixed table names
        self.db.execute("DELETE FROM meta WHERE key != 'schema_version'")
        self.mirror = Mirror()
        self.queued_sequences_hint = 0
        self.latest = None
        self._publish_context()


class StoreRunner:
    """Runs Store operations on one thread, grouping concurrent ones into one transaction.

    Each operation runs inside its own savepoint: one that raises is rolled back alone and
    its caller gets the exception; the others commit together. If the commit itself fails
    (disk full), every caller of that group gets the error and the summary is reloaded.
    """

    _STOP = object()

    def __init__(self, store: Store, max_group: int = 64) -> None:
        self.store = store
        self.max_group = max_group
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="trajectory-store", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(self._STOP)
            self._thread.join()

    async def call(self, op: Callable[[Store], T]) -> T:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._jobs.put((op, _LoopFuture(loop, fut)))
        return await fut

    def call_sync(self, op: Callable[[Store], T]) -> T:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((op, fut))
        return fut.result()

    def _run(self) -> None:
        stopping = False
        while not stopping:
            item = self._jobs.get()
            if item is self._STOP:
                break
            group = [item]
            while len(group) < self.max_group:
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is self._STOP:
                    stopping = True
                    break
                group.append(nxt)
            self._run_group(group)
        self.store.close()

    def _run_group(self, group: list[tuple[Callable[[Store], Any], Any]]) -> None:
        """Run `group` in one transaction; each caller's future (thread or loop) gets its outcome."""
        store = self.store
        outcomes: list[tuple[Any, Any, BaseException | None]] = []
        try:
            store.begin()
            for op, fut in group:
                try:
                    with store.savepoint():
                        outcomes.append((fut, op(store), None))
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    outcomes.append((fut, None, exc))
            store.commit()
        except Exception as exc:  # noqa: BLE001 - the whole group failed
            with contextlib.suppress(Exception):
                store.rollback()
            with contextlib.suppress(Exception):
                store.reload()
            failure = ApiError(503, f"the queue database could not commit ({exc}); retry shortly")
            _settle([(fut, None, failure) for _, fut in group])
            return
        _settle(outcomes)


class _LoopFuture:
    """An asyncio future to settle from the writer thread: the outcomes of one transaction
    reach each event loop in one call, not one wake-up of the loop per operation."""

    __slots__ = ("loop", "future")

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]) -> None:
        self.loop = loop
        self.future = future


def _settle(outcomes: list[tuple[Any, Any, BaseException | None]]) -> None:
    """Hand each caller its result or exception: thread futures at once, loop futures per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any, BaseException | None]]] = {}
    for fut, value, error in outcomes:
        if isinstance(fut, _LoopFuture):
            by_loop.setdefault(fut.loop, []).append((fut.future, value, error))
        elif error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
    for loop, settled in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting any more
            loop.call_soon_threadsafe(_settle_on_loop, settled)


def _settle_on_loop(settled: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for fut, value, error in settled:
        if fut.done():  # cancelled: its request is gone
            continue
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
