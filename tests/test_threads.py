"""llama.cpp's thread count follows the free cores (policies/threads.py), measured for real."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from blackjack_rl.threads import ThreadChooser, threads_for, usable_cpus


def test_one_thread_per_free_core_never_none_never_more_than_the_cpus():
    assert threads_for(2, 0.0) == 2 and threads_for(2, 0.2) == 2  # idle, or nearly
    assert threads_for(2, 0.6) == 1  # a core mostly taken: sharing it would stall every step
    assert threads_for(2, 7.0) == 1  # oversubscribed: one thread, no barrier to spin at
    assert threads_for(16, 3.0) == 13 and threads_for(16, 0.0) == 16


def test_usable_cpus_is_this_process_s_affinity_set():
    import os

    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


def test_two_busy_processes_take_threads_away_and_their_end_gives_them_back():
    """Counted, not timed: each check sees what the busy processes used while it waited."""
    cpus = usable_cpus()
    applied: list[int] = []
    chooser = ThreadChooser(applied.append, cpus=cpus, recheck_s=0.0)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(1.0)  # let them burn CPU time for the next measurement to see
        busy = chooser.check()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert busy <= max(1, cpus - 1)  # at least one core counted as taken
    assert applied and applied[-1] == busy == chooser.threads  # and llama.cpp was told


@pytest.mark.embedded
def test_the_embedded_model_runs_with_the_chosen_threads(embedded):
    import llama_cpp

    assert embedded._threads is not None  # no --threads given: chosen, not fixed
    embedded._threads.recheck_s = 0.0
    embedded.generate(embedded.chat.prompt_ids([{"role": "user", "content": "hi"}]), 1)
    chosen = embedded._threads.threads
    assert llama_cpp.llama_n_threads(embedded.llama.ctx) == chosen
    assert llama_cpp.llama_n_threads_batch(embedded.llama.ctx) == chosen


@pytest.mark.embedded
def test_scoring_revisits_the_thread_count_before_each_prompt(embedded, monkeypatch):
    """A chart scores 560 prompts, minutes of work: the thread count is revisited as it goes,
    not fixed at what the load average said when the model loaded."""
    from blackjack_rl.contract.protocol import HIT, tool_call_text

    asked = []
    monkeypatch.setattr(embedded._threads, "check", lambda: asked.append(1) or embedded._threads.threads)
    prompt = embedded.chat.prompt_ids([{"role": "user", "content": "hi"}])
    call = embedded.chat.answer_ids(tool_call_text(HIT))
    asyncio.run(embedded.answer_logprobs_many([(prompt, [call]), (prompt, [call[:3]]), (prompt, [call])]))
    assert len(asked) == 3
