"""The store on real SQLite files: how new and old files are opened, and the writer thread
settling many callers of the event loop at once."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

from api_payloads import make_group

from blackjack_rl.api.ingest import IngestContext, prepare_groups
from blackjack_rl.api.models import Registration, RegisterEnv
from blackjack_rl.api.store import Store, StoreRunner


def _started(store: Store) -> None:
    store.begin()
    store.register_trainer(Registration(batch_size=8, max_token_len=512))
    store.next_batch(None)
    store.register_env(RegisterEnv(max_token_length=512, desired_name="e", weight=1.0, group_size=4))
    store.commit()


def _queue_and_take(store: Store, uids: list[str]) -> list[str]:
    ctx = store.context
    store.begin()
    for uid in uids:
        body = json.dumps(make_group(uid=uid)).encode()
        groups = prepare_groups(body, "identity", ctx, as_list=False, max_bytes=10**6)
        store.enqueue(groups, as_list=False, idempotency_key=None, generation=ctx.generation)
    rows = store.next_batch(None)
    store.commit()
    assert rows is not None
    from blackjack_rl.api.ingest import decode_payload

    return [json.loads(decode_payload(*p))["episodes"][0]["uid"] for p in rows.payloads]


def test_a_new_file_gets_4_kib_pages_and_an_older_file_keeps_its_own(tmp_path: Path) -> None:
    new = Store(tmp_path / "new.sqlite")
    try:
        assert new.db.execute("PRAGMA page_size").fetchone()[0] == 4096
        assert new.db.execute("PRAGMA secure_delete").fetchone()[0] == 2  # FAST
        assert new.db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 4096  # 16 MB of WAL
        _started(new)
        assert _queue_and_take(new, ["a", "b"]) == ["a", "b"]
    finally:
        new.close()

    old_path = tmp_path / "old.sqlite"
    with sqlite3.connect(old_path) as db:  # as earlier versions created it
        db.execute("PRAGMA page_size=16384")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    db.close()
    old = Store(old_path)
    try:
        assert old.db.execute("PRAGMA page_size").fetchone()[0] == 16384
        assert old.db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 1024
        _started(old)
        assert _queue_and_take(old, ["c", "d"]) == ["c", "d"]
    finally:
        old.close()
    reopened = Store(old_path)
    try:
        assert reopened.mirror.inflight is not None and reopened.mirror.step == 1
    finally:
        reopened.close()


def test_callers_on_the_event_loop_get_their_outcomes_even_when_some_give_up(tmp_path: Path) -> None:
    """One transaction settles many callers; a caller cancelled while it waits is skipped,
    and the writer thread goes on serving the others."""
    runner = StoreRunner(Store(tmp_path / "a.sqlite"))
    runner.start()

    def slow_status(store: Store) -> dict[str, int]:
        import time

        time.sleep(0.05)  # keeps the writer busy while the others queue up behind it
        return store.status()

    def refused(store: Store) -> None:
        store.disconnect_env(12345)

    async def run() -> tuple[list[object], object]:
        first = asyncio.ensure_future(runner.call(slow_status))
        await asyncio.sleep(0.01)
        waiting = [asyncio.ensure_future(runner.call(Store.status)) for _ in range(20)]
        failing = asyncio.ensure_future(runner.call(refused))
        await asyncio.sleep(0)  # every call is queued for the writer, which is still on the first
        for task in waiting[::3]:
            task.cancel()
        outcomes = await asyncio.gather(first, *waiting, failing, return_exceptions=True)
        after = await runner.call(Store.info)
        return outcomes, after

    try:
        outcomes, after = asyncio.run(run())
    finally:
        runner.stop()
    first, *waiting, failing = outcomes
    assert first == {"current_step": 0, "queue_size": 0}
    for i, outcome in enumerate(waiting):
        if i % 3 == 0:
            assert isinstance(outcome, asyncio.CancelledError)
        else:
            assert outcome == {"current_step": 0, "queue_size": 0}
    assert getattr(failing, "status", None) == 404
    assert after == {"batch_size": -1, "max_token_len": -1}
