"""A real ``python -m runtime`` worker for tests: started as the agent starts one (credential
over stdin, ``TMPDIR`` under ``EMBER_HOME``), stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from runtime.sandbox import temp_dir
from runtime.worker_guard import TOKEN_HEADER
from runtime.worker_spawn import new_token

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Worker:
    url: str
    pid: int
    headers: dict[str, str]  # the worker's credential
    log: Path


@contextmanager
def running_worker(home: Path, *args: str) -> Iterator[Worker]:
    """A worker with ``EMBER_HOME=home`` and extra command-line ``args`` (``--sandbox-home``...)."""
    log = home.parent / f"worker-{os.getpid()}-{len(list(home.parent.glob('worker-*.log')))}.log"
    env = dict(os.environ, EMBER_HOME=str(home), TMPDIR=str(temp_dir(home)))
    with open(log, "ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runtime", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, cwd=REPO,
        )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    token = new_token()
    try:
        proc.stdin.write(f"{token}\n".encode())
        proc.stdin.close()
        line = proc.stdout.readline()
        assert line, log.read_text()[-3000:]
        ready = json.loads(line)
        yield Worker(ready["url"], proc.pid, {TOKEN_HEADER: token}, log)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
