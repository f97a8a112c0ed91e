"""How many intra-op threads each CPU instance gets, from what else keeps the cores busy.

A decode step's threads meet at a barrier after every op: when another process takes one of
the cores, the instance's other thread spins or waits there, and a batch-1 stream on 2 cores
fell to 7 % of its unloaded rate under two busy processes (issue 12). With fewer threads than
busy cores the instance competes for a fair share instead. The node agent samples, about once
a second, the machine's busy CPU time (``/proc/stat``) and its instances' own (``/proc/<pid>/
stat``, and its pre-warming workers', which run at SCHED_IDLE on what is left): the
difference is what the rest of the machine used, in cores. Each instance gets
``(cores - others) // instances`` threads (at least 1, at most ``max_threads``). A change takes
two samples in a row that agree (so one burst does not flap the thread counts).

Linux only (``/proc``); elsewhere every instance keeps ``cores // instances``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def threads_per_instance(cores: int, others_busy: float, num_instances: int, max_threads: int) -> int:
    """Intra-op threads for each of ``num_instances`` CPU instances when the rest of the
    machine keeps ``others_busy`` cores busy (see the module docstring)."""
    if cores < 1 or num_instances < 1 or max_threads < 1:
        raise ValueError("cores, num_instances and max_threads must be >= 1")
    free = cores - max(0, round(others_busy))
    return max(1, min(max_threads, free // num_instances))


def machine_busy_seconds() -> float | None:
    """CPU seconds every core spent not idle since boot (``/proc/stat``'s first line)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal ...: idle and iowait are not busy.
    ticks = [int(v) for v in fields[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / _TICKS


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds process ``pid`` used (all its threads; None when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime


@dataclass
class CpuShare:
    """The agent's sampler and decision (see the module docstring); not thread-safe."""

    cores: int
    max_threads: int
    read_busy: Callable[[], float | None] = machine_busy_seconds  # the machine's busy CPU s
    read_process: Callable[[int], float | None] = process_cpu_seconds  # one process's CPU s
    _last: tuple[float, float] | None = None  # (wall s, machine busy s) of the last sample
    _cpu: dict[int, float] = field(default_factory=dict)  # pid -> its CPU s at the last sample
    _pending: int | None = None  # a changed decision seen once, waiting for a second sample
    current: dict[int, int] = field(default_factory=dict)  # instances' count -> threads decided

    def __post_init__(self) -> None:
        if self.cores < 1 or self.max_threads < 1:
            raise ValueError("cores and max_threads must be >= 1")

    def share(self, num_instances: int) -> int:
        """Threads per instance decided last for ``num_instances`` instances (an even split of
        the cores until a sample decided otherwise), without a sample: what a starting
        instance is told in its assignment."""
        if num_instances < 1:
            raise ValueError("num_instances must be >= 1")
        return self.current.get(num_instances, self._baseline(num_instances))

    def _baseline(self, num_instances: int) -> int:
        return max(1, min(self.max_threads, self.cores // num_instances))

    def decide(
        self,
        now: float,
        instance_pids: Iterable[int],
        idle_pids: Iterable[int] = (),
        measure: bool = True,
        take_turns: bool = False,
    ) -> int | None:
        """Threads per instance for the instances ``instance_pids`` after a sample at ``now``
        (monotonic seconds); None when there are none. ``idle_pids``: Ember's processes that are not
        instances (pre-warming workers, at SCHED_IDLE, using only what the instances leave; ready
        standbys, which wait): not counted as others.
        ``measure=False``: the last decision for this many instances, without a sample (an
        instance just started or ended; the periodic samples stay evenly spaced).
        ``take_turns``: the instances run one iteration at a time (token-level scheduling,
        :mod:`runtime.mesh`), so each gets what one instance alone would."""
        pids = list(instance_pids)
        if not pids:
            self._last, self._pending = None, None
            return None
        sharing = 1 if take_turns else len(pids)
        baseline = self._baseline(sharing)
        if not measure:
            return self.share(sharing)
        busy = self.read_busy()
        if busy is None:  # no /proc
            return baseline
        cpu = {p: t for p in [*pids, *idle_pids] if (t := self.read_process(p)) is not None}
        # A process first seen now started since the last sample (a new worker): all of its
        # CPU time falls in this interval.
        ours = sum(t - self._cpu.get(p, 0.0) for p, t in cpu.items())
        last, self._last, self._cpu = self._last, (now, busy), cpu
        previous = self.current.get(sharing, baseline)
        if last is None or now - last[0] <= 0:
            return previous
        others = max(0.0, (busy - last[1]) - ours) / (now - last[0])
        wanted = threads_per_instance(self.cores, others, sharing, self.max_threads)
        if wanted == previous:
            self._pending = None
            return previous
        if self._pending != wanted:  # first sample asking for a change: wait for a second
            self._pending = wanted
            return previous
        self._pending = None
        self.current[sharing] = wanted
        return wanted
