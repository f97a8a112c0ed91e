"""End to end (issue 10): handler code in a real ``ember serve`` cannot read ``serve.json``, the
embedded Redis's files, another function's log or another function's code, while the handler
itself works (its model, its temporary files, its own code)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gateway.spawn import ServeProcess
from tests.gateway.conftest import chat_spec

pytestmark = pytest.mark.slow

PROBING_HANDLER = """
import os
import tempfile
from pathlib import Path


def _read(path):
    try:
        return "read %d bytes" % len(Path(path).read_bytes())
    except OSError as exc:
        return type(exc).__name__


async def handler(event, context):
    home = Path(os.environ["EMBER_HOME"])
    seen = {name: _read(path) for name, path in event["paths"].items()}
    try:
        seen["list home"] = sorted(os.listdir(home))
    except OSError as exc:
        seen["list home"] = type(exc).__name__
    with tempfile.NamedTemporaryFile("w+") as f:
        f.write("scratch")
        f.flush()
        seen["tempfile"] = Path(f.name).read_text()
    done = await context.model.acomplete("1, 2, 3,", max_tokens=2, temperature=0)
    seen["tokens"] = done.completion_tokens
    return seen
"""


def test_handler_cannot_read_home_secrets(server: ServeProcess, http: httpx.Client, tmp_path: Path) -> None:
    other = http.post("/v1/functions", json=chat_spec("other-fn"))
    assert other.status_code == 201, other.text
    said = http.post("/v1/functions/other-fn/invoke", json={"prompt": "Hi", "max_tokens": 2})
    assert said.status_code == 200, said.text
    module = tmp_path / "probe.py"
    module.write_text(PROBING_HANDLER)
    document = chat_spec("probe")
    document["spec"]["handler"] = f"{module}:handler"
    assert http.post("/v1/functions", json=document).status_code == 201
    home = server.home
    paths = {
        "serve.json": home / "serve.json",
        "serve.log": home / "serve.log",
        "other log": next((home / "logs" / "functions" / "other-fn").glob("instance-*.log")),
        **{f"redis {p.name}": p for p in (home / "redis").rglob("*") if p.is_file()},
    }
    assert any(name.startswith("redis ") and name.endswith(".aof") for name in paths)
    for path in paths.values():
        path.read_bytes()  # readable to this (unconfined) process
    assert b"url" in paths["serve.json"].read_bytes()
    out = http.post("/v1/functions/probe/invoke", json={"paths": {k: str(v) for k, v in paths.items()}})
    assert out.status_code == 200, out.text
    seen = out.json()
    assert {seen[name] for name in paths} == {"PermissionError"}, seen
    assert seen["list home"] == "PermissionError"
    assert seen["tempfile"] == "scratch" and seen["tokens"] == 2


KV_HOG_HANDLER = """
import os
from pathlib import Path

from gpu_pool.client import PoolClient, RemotePoolError


def handler(event, context):
    socket_path = str(Path(os.environ["EMBER_HOME"]) / "run" / "pool-cpu.sock")
    seen = {}
    with PoolClient(socket_path, timeout=10) as pool:  # a session of its own, without a ticket
        attempts = {
            "kv_alloc": lambda: pool.kv_alloc(event["blocks"], 1 << 20),
            "evict": pool.evict,
            "grant": lambda: pool.grant(1 << 30),
        }
        for op, attempt in attempts.items():
            try:
                attempt()
                seen[op] = "allowed"
            except RemotePoolError as exc:
                seen[op] = exc.code
    return seen
"""


def test_a_handler_cannot_hog_kv_evict_or_grant_itself_a_quota(
    server: ServeProcess, http: httpx.Client, tmp_path: Path
) -> None:
    """A KV hog: handler code opening its own pool session gets no KV (only the instance's
    granted session has a quota), and the admin operations are refused."""
    module = tmp_path / "hog.py"
    module.write_text(KV_HOG_HANDLER)
    document = chat_spec("hog")
    document["spec"]["handler"] = f"{module}:handler"
    assert http.post("/v1/functions", json=document).status_code == 201
    out = http.post("/v1/functions/hog/invoke", json={"blocks": 64})
    assert out.status_code == 200, out.text
    assert out.json() == {"kv_alloc": "kv_quota_exceeded", "evict": "forbidden", "grant": "forbidden"}
    # The instance itself still serves (its own session kept its quota).
    chat = http.post("/v1/functions", json=chat_spec("after-hog"))
    assert chat.status_code == 201
    said = http.post("/v1/functions/after-hog/invoke", json={"prompt": "Hi", "max_tokens": 2})
    assert said.status_code == 200, said.text


READING_HANDLER = """
from pathlib import Path


def handler(event, context):
    seen = {}
    for name, path in event["paths"].items():
        try:
            seen[name] = Path(path).read_text()
        except OSError as exc:
            seen[name] = type(exc).__name__
    return seen
"""


def test_a_handler_reads_only_its_own_functions_code(
    server: ServeProcess, http: httpx.Client, tmp_path: Path
) -> None:
    """Every function's code is under EMBER_HOME/functions: an instance reads its own (it
    imports it), not another function's, whichever namespace either lives in."""
    module = tmp_path / "reader.py"
    module.write_text(READING_HANDLER)
    stored = {}
    for name, namespace in (("reader", "team-a"), ("victim", "default"), ("victim", "team-a")):
        document = chat_spec(name)
        document["metadata"]["namespace"] = namespace
        document["spec"]["handler"] = f"{module}:handler"
        created = http.post("/v1/functions", json=document)
        assert created.status_code == 201, created.text
        stored[f"{namespace}/{name}"] = created.json()["spec"]["handler"].rpartition(":")[0]
    assert stored["team-a/reader"].startswith(str(server.home.resolve() / "functions" / "team-a" / "reader"))
    out = http.post("/v1/functions/reader/invoke?namespace=team-a", json={"paths": stored})
    assert out.status_code == 200, out.text
    assert out.json() == {
        "team-a/reader": READING_HANDLER,
        "default/victim": "PermissionError",
        "team-a/victim": "PermissionError",
    }
    for name in ("reader", "victim"):
        assert http.delete(f"/v1/functions/{name}", params={"namespace": "team-a"}).status_code == 204
    assert http.delete("/v1/functions/victim").status_code == 204
