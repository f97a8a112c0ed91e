"""Only the engine's thread of a worker runs parallel regions (runtime.intra_op).

Each case runs in a fresh interpreter: ATen's thread counts are process-wide state."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(code: str) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_workers_pool_threads_start_no_openmp_team() -> None:
    """A parallel torch op in the worker's thread pool (where engines are built and sync
    handlers run) runs inline: no OpenMP team of its own, which would outnumber the cores and
    make libgomp throttle the engine's team; the engine's thread keeps its count."""
    result = run(
        """
        import asyncio, json, os
        import torch
        from runtime.function_sandbox import FunctionSandbox
        from runtime.intra_op import set_engine_threads

        set_engine_threads(2)
        x = torch.randn(1 << 22)
        (x * 2).sum()  # the engine's team exists now

        def threads():
            return len(os.listdir("/proc/self/task"))

        async def main():
            sandbox = FunctionSandbox(None)
            sandbox.install(asyncio.get_running_loop())
            await asyncio.to_thread(lambda: None)  # the pool's first thread, idle
            before = threads()
            seen = await asyncio.to_thread(lambda: ((x * 3).sum(), torch.get_num_threads())[1])
            after = threads()
            sandbox.executor.shutdown()
            return {"pool": seen, "new_threads": after - before, "engine": torch.get_num_threads()}

        print(json.dumps(asyncio.run(main())))
        """
    )
    assert result == {"pool": 1, "new_threads": 0, "engine": 2}


def test_the_engine_thread_keeps_its_count_when_a_pool_thread_came_first() -> None:
    """A pool thread that adopted the count before the engine's thread did cannot leave the
    engine single-threaded: set_engine_threads adopts, then sets."""
    result = run(
        """
        import json, threading
        import torch
        from runtime.intra_op import serial_thread, set_engine_threads

        t = threading.Thread(target=serial_thread)
        t.start(); t.join()  # the process-wide count is 1 now
        set_engine_threads(2)
        x = torch.randn(1 << 22)
        (x * 2).sum()
        print(json.dumps({"engine": torch.get_num_threads()}))
        """
    )
    assert result == {"engine": 2}


@pytest.mark.parametrize("claimed", [True, False])
def test_a_claimed_engine_thread_keeps_the_default_count_after_a_pool_thread_starts(claimed: bool) -> None:
    """A worker without an assigned count (a Knative pod, an OpenWhisk action) keeps the default
    on its engine's thread when it claimed it first; unclaimed, a pool thread's count of one
    would have been adopted (the failure claim_engine_thread prevents)."""
    result = run(
        f"""
        import json, threading
        import torch
        from runtime.intra_op import claim_engine_thread, serial_thread

        seen = []
        probe = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        probe.start(); probe.join()  # the default, read on another thread
        if {claimed}:
            claim_engine_thread()
        pool = threading.Thread(target=serial_thread)
        pool.start(); pool.join()
        print(json.dumps({{"default": seen[0], "engine": torch.get_num_threads()}}))
        """
    )
    if result["default"] < 2:
        pytest.skip("one intra-op thread by default: nothing to lose")
    assert (result["engine"] == result["default"]) is claimed


def test_set_engine_threads_refuses_a_count_below_one() -> None:
    from runtime.intra_op import set_engine_threads

    with pytest.raises(ValueError):
        set_engine_threads(0)
