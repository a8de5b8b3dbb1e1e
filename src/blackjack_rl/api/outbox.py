"""An on-disk outbox for groups an environment worker could not deliver yet.

Atropos' environments drop a group whose send fails. Here a post that cannot reach the API
is parked in a small SQLite file, with the Idempotency-Key it was first sent with, and
flushed in order when the API is back; if the first attempt did reach the API, the key
makes the server answer it without queueing it twice. A post the API refuses outright
(4xx) moves to a `rejected` table with the server's message, so it neither blocks the
posts behind it nor disappears.

One outbox file belongs to one worker process at a time; a second process that opens it
(under any name) is refused.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from blackjack_rl.api.dblock import take_lock

_SCHEMA = """
CREATE TABLE IF NOT EXISTS pending(
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL,
    body BLOB NOT NULL,
    n_groups INTEGER NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS rejected(
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL,
    body BLOB NOT NULL,
    n_groups INTEGER NOT NULL,
    status INTEGER NOT NULL,
    detail TEXT NOT NULL,
    rejected_at REAL NOT NULL
);
"""


@dataclass(frozen=True)
class Parked:
    """One parked post: a gzip-compressed JSON list of groups."""

    id: int
    key: str
    body: bytes
    n_groups: int


@dataclass(frozen=True)
class Rejected:
    id: int
    n_groups: int
    status: int
    detail: str


class Outbox:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = take_lock(self.path, "environment worker", "stop it, or give this worker its own --out")
        self.db = sqlite3.connect(self.path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(_SCHEMA)

    def put(self, key: str, body: bytes, n_groups: int) -> None:
        self.db.execute(
            "INSERT INTO pending(key, body, n_groups, created_at) VALUES(?, ?, ?, ?)",
            (key, body, n_groups, time.time()),
        )

    def oldest(self) -> Parked | None:
        row = self.db.execute("SELECT id, key, body, n_groups FROM pending ORDER BY id LIMIT 1").fetchone()
        return Parked(*row) if row else None

    def remove(self, parked: Parked) -> None:
        self.db.execute("DELETE FROM pending WHERE id=?", (parked.id,))

    def reject(self, parked: Parked, status: int, detail: str) -> None:
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute(
                "INSERT INTO rejected(id, key, body, n_groups, status, detail, rejected_at) VALUES(?, ?, ?, ?, ?, ?, ?)",
                (parked.id, parked.key, parked.body, parked.n_groups, status, detail, time.time()),
            )
            self.db.execute("DELETE FROM pending WHERE id=?", (parked.id,))

    def pending_groups(self) -> int:
        return int(self.db.execute("SELECT COALESCE(SUM(n_groups), 0) FROM pending").fetchone()[0])

    def pending_posts(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM pending").fetchone()[0])

    def rejected(self) -> list[Rejected]:
        return [
            Rejected(*row)
            for row in self.db.execute("SELECT id, n_groups, status, detail FROM rejected ORDER BY id")
        ]

    def close(self) -> None:
        self.db.close()
        self._lock.release()
