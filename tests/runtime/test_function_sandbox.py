"""The function layer of the worker sandbox (issue 10): once assigned, a worker reads only its
own function's code under ``EMBER_HOME/functions``, from its async handlers (the event loop's
thread) and its sync ones (the thread pool, already used before the assignment) alike; and a
worker confined to one function refuses another. Real processes: a pool daemon and a
``python -m runtime --sandbox-home`` worker serving the tiny model."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.function_sandbox import ConfinedElsewhere, FunctionSandbox
from runtime.messages import AssignMessage
from runtime.registry import RegisteredModel, register
from runtime.sandbox import abi_version
from scheduler.spec import parse_function
from tests.conftest import PoolProcess
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf
from tests.runtime.worker_proc import Worker, running_worker

slow = pytest.mark.slow
needs_landlock = pytest.mark.skipif(abi_version() == 0, reason="this kernel has no Landlock")

PROBE = """
import os
from pathlib import Path


def _read(path):
    try:
        return Path(path).read_text()
    except OSError as exc:
        return type(exc).__name__


def _list(path):
    try:
        return sorted(os.listdir(path))
    except OSError as exc:
        return type(exc).__name__


def _probe(event):
    seen = {name: _read(path) for name, path in event["read"].items()}
    seen.update({f"list {name}": _list(path) for name, path in event["list"].items()})
    return seen


async def on_loop(event, context):
    return _probe(event)


def in_pool(event, context):
    return _probe(event)
"""


def write_module(home: Path, namespace: str, name: str, digest: str, module: str, text: str) -> Path:
    path = home / "functions" / namespace / name / digest / module
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def document(name: str, handler: str, namespace: str = "default") -> dict[str, Any]:
    spec = parse_function(
        {"apiVersion": "ember.dev/v1", "kind": "Function", "metadata": {"name": name, "namespace": namespace},
         "spec": {"model": {"source": "/models/tiny.gguf", "dtype": "float32"}, "handler": handler}}
    )  # fmt: skip
    return spec.to_document()


@pytest.fixture
def sandboxed(tmp_path: Path) -> Iterator[tuple[Worker, RegisteredModel, PoolProcess, Path]]:
    home = tmp_path / "home"
    (tmp_path / "elsewhere").mkdir()  # before the worker: later entries beside EMBER_HOME are out of reach
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(3))
    model = register(str(tmp_path / "tiny.gguf"), "float32", home=home)
    pool = PoolProcess(tmp_path / "pool.sock", "16MiB", store=(model.store_path,))
    try:
        with running_worker(home, "--sandbox-home", str(home), "--premap", pool.socket_path) as worker:
            yield worker, model, pool, home
    finally:
        pool.stop()


def assign(worker: Worker, model: RegisteredModel, pool: PoolProcess, spec: dict[str, Any]) -> httpx.Response:
    message = AssignMessage("1", spec, str(model.directory), pool.socket_path, None, time.time() + 60)
    return httpx.post(
        f"{worker.url}/_ember/assign", content=message.to_json(), headers=worker.headers, timeout=60
    )


@pytest.mark.parametrize("handler", ["on_loop", "in_pool"])
@slow
@needs_landlock
def test_an_assigned_worker_reads_only_its_own_functions_code(
    sandboxed: tuple[Worker, RegisteredModel, PoolProcess, Path], tmp_path: Path, handler: str
) -> None:
    worker, model, pool, home = sandboxed
    own = write_module(home, "default", "fa", "d1", "probe.py", PROBE)
    own_older = write_module(home, "default", "fa", "d0", "probe.py", "# the previous deploy")
    other = write_module(home, "default", "fb", "d2", "b.py", "SECRET = 'b'")
    other_ns = write_module(home, "team", "fa", "d3", "c.py", "SECRET = 'team/fa'")
    outside = tmp_path / "elsewhere" / "outside.txt"
    outside.write_text("outside")
    # Before the assignment the worker's thread pool already ran (a preload): its threads must
    # not be the ones that run the sync handler unconfined.
    preload = httpx.post(
        f"{worker.url}/_ember/preload", json={"model_dir": str(model.directory)}, headers=worker.headers,
        timeout=60,
    )  # fmt: skip
    assert preload.status_code == 200, preload.text
    assigned = assign(worker, model, pool, document("fa", f"{own}:{handler}"))
    assert assigned.status_code == 200, assigned.text
    event = {
        "read": {"own": own, "own older": own_older, "other": other, "other namespace": other_ns,
                 "model": model.directory / "config.json", "outside": outside},
        "list": {"functions": home / "functions", "own function": own.parent.parent},
    }  # fmt: skip
    event = {kind: {k: str(v) for k, v in paths.items()} for kind, paths in event.items()}
    seen = httpx.post(f"{worker.url}/invoke", json=event, headers=worker.headers, timeout=60).json()
    assert seen["other"] == seen["other namespace"] == "PermissionError", seen
    assert seen["list functions"] == "PermissionError", seen
    assert seen["own"] == PROBE and seen["own older"] == "# the previous deploy"
    assert seen["list own function"] == ["d0", "d1"]
    assert seen["outside"] == "outside" and seen["model"].startswith("{")


@slow
@needs_landlock
def test_a_worker_confined_to_one_function_refuses_another(
    sandboxed: tuple[Worker, RegisteredModel, PoolProcess, Path],
) -> None:
    """The agent never reuses a worker, but the worker does not rely on it: after an assignment
    that failed past its sandbox layer, only the same function may still be assigned."""
    worker, model, pool, home = sandboxed
    broken = write_module(home, "default", "fa", "d1", "broken.py", "raise ImportError('not yet')")
    fixed = write_module(home, "default", "fa", "d2", "probe.py", PROBE)
    other = write_module(home, "default", "fb", "d3", "probe.py", PROBE)
    failed = assign(worker, model, pool, document("fa", f"{broken}:on_loop"))
    assert failed.status_code == 400 and "not yet" in failed.text, failed.text
    refused = assign(worker, model, pool, document("fb", f"{other}:on_loop"))
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["type"] == "confined_to_another_function"
    refused = assign(worker, model, pool, document("fa", "default", namespace="team"))
    assert refused.status_code == 409, refused.text  # same name, another namespace: another function
    again = assign(worker, model, pool, document("fa", f"{fixed}:on_loop"))
    assert again.status_code == 200, again.text
    event = {"read": {"other": str(other), "own": str(fixed)}, "list": {}}
    seen = httpx.post(f"{worker.url}/invoke", json=event, headers=worker.headers, timeout=60).json()
    assert seen == {"other": "PermissionError", "own": PROBE}


def test_an_unsandboxed_worker_still_serves_one_function_only() -> None:
    """EMBER_WORKER_SANDBOX=off (no layer): the one-function rule holds all the same."""

    async def scenario() -> None:
        sandbox = FunctionSandbox(None)
        await sandbox.confine(document("fa", "default"))
        await sandbox.confine(document("fa", "default"))  # the same function again: fine
        for other in (document("fb", "default"), document("fa", "default", namespace="team")):
            with pytest.raises(ConfinedElsewhere, match="confined to function default/fa"):
                await sandbox.confine(other)
        assert sandbox.report is None  # nothing was stacked

    asyncio.run(scenario())
