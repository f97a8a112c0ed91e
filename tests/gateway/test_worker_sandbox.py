"""End to end (issue 10): handler code in a real ``ember serve`` cannot read ``serve.json``, the
embedded Redis's files or another function's log, while the handler itself works (its model,
its temporary files)."""

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
