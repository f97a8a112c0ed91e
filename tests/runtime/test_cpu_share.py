"""Intra-op threads per CPU instance from what else keeps the cores busy (runtime.cpu_share)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.cpu_share import CpuShare, machine_busy_seconds, process_cpu_seconds, threads_per_instance


@given(
    cores=st.integers(1, 64),
    others=st.floats(0, 128, allow_nan=False),
    more=st.floats(0, 16, allow_nan=False),
    instances=st.integers(1, 16),
    max_threads=st.integers(1, 64),
)
def test_threads_stay_in_bounds_and_fall_as_others_get_busier(
    cores: int, others: float, more: float, instances: int, max_threads: int
) -> None:
    n = threads_per_instance(cores, others, instances, max_threads)
    assert 1 <= n <= max_threads
    assert n * instances <= max(cores, instances)  # never more threads than cores (1 each at least)
    assert threads_per_instance(cores, others + more, instances, max_threads) <= n


def test_an_idle_machine_gives_one_instance_every_core() -> None:
    assert threads_per_instance(2, 0.1, 1, 64) == 2
    assert threads_per_instance(2, 1.0, 1, 64) == 1  # one busy process: the fair share
    assert threads_per_instance(2, 2.0, 1, 64) == 1  # at least one thread
    assert threads_per_instance(8, 0.0, 3, 64) == 2


class Scripted:
    """Readers fed from a script: the machine's busy seconds and each process's CPU seconds."""

    def __init__(self) -> None:
        self.busy = 0.0
        self.procs: dict[int, float] = {}

    def advance(self, seconds: float, **per_pid: float) -> None:
        """``seconds`` of wall time in which each ``p<pid>`` used that many CPU seconds and the
        whole machine used the sum plus ``others``."""
        others = per_pid.pop("others", 0.0)
        for key, used in per_pid.items():
            pid = int(key[1:])
            self.procs[pid] = self.procs.get(pid, 0.0) + used * seconds
        self.busy += (sum(per_pid.values()) + others) * seconds


def share(script: Scripted) -> CpuShare:
    return CpuShare(2, 64, read_busy=lambda: script.busy, read_process=script.procs.get)


def test_a_busy_neighbour_takes_a_thread_after_two_samples_and_gives_it_back() -> None:
    script = Scripted()
    cpu = share(script)
    script.advance(1.0, p10=1.9)
    assert cpu.decide(0.0, [10]) == 2  # first sample: the baseline
    for t, expect in ((1.0, 2), (2.0, 1), (3.0, 1)):  # a neighbour busy on one core from t=0
        script.advance(1.0, p10=1.0, others=1.0)
        assert cpu.decide(t, [10]) == expect, t  # one sample asks, the second changes it
    script.advance(1.0, p10=1.9, others=0.05)
    assert cpu.decide(4.0, [10]) == 1
    script.advance(1.0, p10=1.9, others=0.05)
    assert cpu.decide(5.0, [10]) == 2


def test_a_single_burst_does_not_flap() -> None:
    script = Scripted()
    cpu = share(script)
    assert cpu.decide(0.0, [10]) == 2
    script.advance(1.0, p10=1.0, others=1.0)
    assert cpu.decide(1.0, [10]) == 2
    script.advance(1.0, p10=1.9)
    assert cpu.decide(2.0, [10]) == 2
    script.advance(1.0, p10=1.0, others=1.0)
    assert cpu.decide(3.0, [10]) == 2  # not two in a row


def test_pre_warming_workers_do_not_count_as_others() -> None:
    script = Scripted()
    cpu = share(script)
    assert cpu.decide(0.0, [10], idle_pids=[20]) == 2
    for t in (1.0, 2.0, 3.0):  # the instance is idle; a SCHED_IDLE worker warms on both cores
        script.advance(1.0, p10=0.0, p20=1.9)
        assert cpu.decide(t, [10], idle_pids=[20]) == 2
    cpu.decide(4.0, [10])  # a worker first seen later started in between: all its time is its own
    script.advance(1.0, p10=0.1, p30=1.8)
    assert cpu.decide(5.0, [10], idle_pids=[30]) == 2
    script.advance(1.0, p10=0.1, p30=1.8)
    assert cpu.decide(6.0, [10], idle_pids=[30]) == 2


def test_without_measuring_it_keeps_the_decision_for_that_many_instances() -> None:
    script = Scripted()
    cpu = share(script)
    assert cpu.decide(0.0, [10, 11], measure=False) == 1  # 2 cores, 2 instances
    assert cpu.decide(0.0, [], measure=False) is None


def test_a_starting_instance_is_told_the_share_decided_for_that_many_instances() -> None:
    script = Scripted()
    cpu = share(script)
    assert (cpu.share(1), cpu.share(2), cpu.share(3)) == (2, 1, 1)  # 2 cores: an even split
    cpu.current[1] = 1  # a busy neighbour took a core from a lone instance
    assert cpu.share(1) == 1
    with pytest.raises(ValueError):
        cpu.share(0)


def test_the_proc_readers_see_a_busy_process() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        t0, m0 = process_cpu_seconds(busy.pid), machine_busy_seconds()
        time.sleep(1.0)
        t1, m1 = process_cpu_seconds(busy.pid), machine_busy_seconds()
    finally:
        busy.kill()
        busy.wait()
    assert t0 is not None and t1 is not None and m0 is not None and m1 is not None
    assert t1 - t0 >= 0.3  # it ran (a shared machine may give it less than a full core)
    assert m1 - m0 >= (t1 - t0) * 0.9  # the machine's busy time includes it
    assert process_cpu_seconds(busy.pid) is None  # gone
