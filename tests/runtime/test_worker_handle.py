"""The agent's handle on a worker process: its lines to the token scheduler are closed on
every way out (a leaked socket is a ResourceWarning, an error under CI's warning filters)."""

from __future__ import annotations

import asyncio
import mmap
import socket
import sys
from pathlib import Path

from runtime.worker_handle import WorkerHandle

IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
)


def test_a_terminate_cancelled_while_the_worker_drains_still_closes_its_lines(tmp_path: Path) -> None:
    async def scenario() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", IGNORES_SIGTERM, stdout=asyncio.subprocess.PIPE
        )
        assert proc.stdout is not None
        await proc.stdout.readline()  # SIGTERM is ignored from here on
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs.close()
        page = mmap.mmap(-1, 4096)
        url, log = "http://127.0.0.1:1", tmp_path / "w.log"
        worker = WorkerHandle(proc, url, log, "t", mesh_sock=ours, mesh_page=page)
        ending = asyncio.create_task(worker.terminate(drain_timeout_s=30.0))
        await asyncio.sleep(0.2)
        ending.cancel()  # the agent closing while the worker drains
        await asyncio.gather(ending, return_exceptions=True)
        assert ours.fileno() == -1 and page.closed
        worker.kill()
        await proc.wait()
        worker.close_lines()  # idempotent

    asyncio.run(scenario())
