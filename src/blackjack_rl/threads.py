"""How many threads llama.cpp gets: the CPUs this process may use, less what others keep busy.

llama.cpp splits each matrix product over its threads, which then wait for each other at
a barrier by spinning. With more threads than free cores, one descheduled thread holds up
all the others, and they spend their time slices spinning: on 2 cores kept busy by other
processes (load ~7) the main evaluation ran 25 times slower than on idle cores. With no
more threads than free cores (one when none is free) the slowdown stays proportional to
the share of the CPU this process gets.

The free cores are measured, not guessed from a load average (which lags by a minute):
over each interval, the busy time of the CPUs this process may run on (/proc/stat) minus
this process's own CPU time is what other processes used. The choice is revisited every
few seconds, so contention that starts or ends mid-run changes the thread count.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable

RECHECK_S = 2.0  # how often the thread count is revisited


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity set, capped by a cgroup CPU quota if there is one."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max", encoding="ascii").read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def threads_for(cpus: int, others_busy: float) -> int:
    """One thread per core the others leave free; a core counts as free once 70% of it is."""
    return max(1, min(cpus, int(cpus - others_busy + 0.3)))


def _busy_seconds(cpus: set[int]) -> float | None:
    """Busy time (everything but idle and iowait) of the given CPUs since boot, from /proc/stat."""
    try:
        lines = open("/proc/stat", encoding="ascii").read().splitlines()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = [int(v) for v in rest.split()]
            busy += sum(fields[:8]) - fields[3] - fields[4]  # user nice system idle iowait irq softirq steal
    return busy / ticks


class ThreadChooser:
    """Keeps llama.cpp at no more threads than there are free cores; `check()` from the decoding thread.

    `apply(n)` sets the thread count (llama_set_n_threads for both single tokens and batches).
    """

    def __init__(self, apply: Callable[[int], None], cpus: int | None = None, recheck_s: float = RECHECK_S) -> None:
        self.cpus = cpus or usable_cpus()
        self.recheck_s = recheck_s
        try:
            self._cpu_set = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self._cpu_set = set(range(os.cpu_count() or 1))
        self._apply = apply
        self.threads = self._initial()
        apply(self.threads)
        self._mark = self._reading()

    def _initial(self) -> int:
        """Before any measurement: the load average's view (a minute behind, but it has one)."""
        try:
            return threads_for(self.cpus, max(0.0, os.getloadavg()[0]))
        except (AttributeError, OSError):
            return self.cpus

    def _reading(self) -> tuple[float, float | None, float]:
        return time.monotonic(), _busy_seconds(self._cpu_set), time.process_time()

    def check(self) -> int:
        """Re-measure if the last measurement is older than `recheck_s`; returns the thread count in use."""
        wall0, busy0, own0 = self._mark
        if time.monotonic() - wall0 < self.recheck_s:
            return self.threads
        mark = self._reading()
        self._mark = mark
        now, busy1, own1 = mark
        if busy0 is None or busy1 is None:
            return self.threads
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (now - wall0)
        threads = threads_for(self.cpus, others)
        if threads != self.threads:
            self.threads = threads
            self._apply(threads)
        return self.threads
