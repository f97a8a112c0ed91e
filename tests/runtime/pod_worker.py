"""Helpers for tests of workers in someone else's container: a Knative function pod
(``ember worker --function``) and an OpenWhisk action (``ember worker --openwhisk``).

A tiny registered model, a handler module in ``EMBER_HOME/functions``, its function record in a
real Redis, and the worker as a real process of ``python -m gateway.cli``.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from runtime.registry import RegisteredModel, register
from scheduler.records import ModelRef
from scheduler.spec import parse_function
from scheduler.state import ClusterState
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]

# A custom handler streaming `n` events, `pause` seconds apart, each with a short completion.
STREAMING_HANDLER = """
import asyncio


async def handler(event, context):
    async def events():
        for i in range(int(event.get("n", 3))):
            await asyncio.sleep(float(event.get("pause", 0)))
            done = await context.model.acomplete("hi", max_tokens=2, temperature=0)
            yield {"i": i, "text": done.text}

    return events()
"""


@dataclass(frozen=True)
class Home:
    """An ``EMBER_HOME`` with the tiny model registered and the streaming handler in it."""

    path: Path
    model: RegisteredModel
    handler: str  # "/abs/path/module.py:function"


def make_home(root: Path) -> Home:
    """Write the tiny GGUF under ``root`` and register it in ``root/home``."""
    root.mkdir(parents=True, exist_ok=True)
    write_tiny_gguf(root / "tiny.gguf", hf_weights(3))
    home = root / "home"
    model = register(str(root / "tiny.gguf"), "float32", home=home)
    functions = home / "functions"
    functions.mkdir(parents=True, exist_ok=True)
    (functions / "streaming.py").write_text(STREAMING_HANDLER)
    return Home(home, model, f"{functions / 'streaming.py'}:handler")


def put_function(state: ClusterState, home: Home, name: str = "tiny") -> None:
    """Deploy ``name`` (the streaming handler over the tiny model) straight into the cluster state."""
    document = parse_function(
        {"apiVersion": "ember.dev/v1", "kind": "Function", "metadata": {"name": name},
         "spec": {"model": {"source": home.model.record["source"], "dtype": "float32"},
                  "handler": home.handler, "maxTokens": 64}}
    ).to_document()  # fmt: skip
    weights = home.model.manifest().nbytes
    state.put_function(name, document, ModelRef(home.model.model_id, str(home.model.directory), weights))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pod_environment(home: Home, redis_url: str, pool_dir: Path, port: int, **extra: str) -> dict[str, str]:
    """What a rendered function pod's container gets (plus the test's own environment)."""
    return {
        **os.environ,
        "EMBER_HOME": str(home.path),
        "EMBER_REDIS_URL": redis_url,
        "EMBER_WORKER_TOKEN": secrets.token_urlsafe(32),
        "EMBER_POOL_DIR": str(pool_dir),
        "EMBER_NODE_NAME": "node-a",
        "PORT": str(port),
        "POD_IP": "127.0.0.1",
        "K_SERVICE": "tiny",
        "K_REVISION": "tiny-00001",
        "K_CONFIGURATION": "tiny",
        **extra,
    }


def start_worker(
    args: Sequence[str], env: Mapping[str, str], logs: Path, prefix: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """``[*prefix, python -m gateway.cli worker *args]`` with stdout and stderr in ``logs/``."""
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "stdout", "wb") as out, open(logs / "stderr", "wb") as err:
        return subprocess.Popen(
            [*prefix, sys.executable, "-m", "gateway.cli", "worker", *args],
            stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=dict(env), cwd=ROOT,
        )  # fmt: skip


def get_status(url: str) -> int | None:
    """``GET url``'s status, or None when nothing answers."""
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.TransportError:
        return None


def wait_status(url: str, status: int, proc: subprocess.Popen[bytes], logs: Path, timeout: float) -> None:
    """Until ``GET url`` answers ``status`` (the worker's stderr in the failure message)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if get_status(url) == status:
            return
        if proc.poll() is not None:
            raise AssertionError(f"worker exited {proc.returncode}: {read(logs / 'stderr')[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"{url} did not answer {status} in {timeout} s: {read(logs / 'stderr')[-3000:]}")


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
