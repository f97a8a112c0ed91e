"""End to end: `ember serve` confines model sources and handler modules, and every file it
writes under EMBER_HOME is owner-only."""

from __future__ import annotations

import stat
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.function_code import with_handler_module
from gateway.spawn import ServeProcess
from tests.gateway.conftest import FUNCTIONS, chat_spec

pytestmark = pytest.mark.slow


def test_sources_outside_the_roots_get_the_missing_answer(http: httpx.Client, tmp_path: Path) -> None:
    """A file that exists outside EMBER_MODEL_ROOTS and one that does not exist get the same
    400 (the message differs only by the source quoted back)."""
    messages = {}
    for source in (
        "gguf:/etc/passwd",
        "/etc/passwd",
        f"gguf:{tmp_path}/../../../../etc/passwd",
        "gguf:/nope",
    ):
        document = chat_spec("sneaky")
        document["spec"]["model"]["source"] = source
        bad = http.post("/v1/functions", json=document)
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["type"] == "invalid_model_source"
        messages[source] = bad.json()["error"]["message"].replace(source, "SOURCE")
    assert len(set(messages.values())) == 1, messages
    assert "not found or not allowed" in messages["gguf:/nope"]


def test_uploaded_handler_runs_and_files_are_owner_only(server: ServeProcess, http: httpx.Client) -> None:
    spec_file = FUNCTIONS / "summarize" / "function.yaml"
    body = with_handler_module(yaml.safe_load(spec_file.read_text()), spec_file)  # as `ember deploy -f`
    created = http.post("/v1/functions", json=body)
    assert created.status_code == 201, created.text
    assert created.json()["spec"]["handler"].startswith(
        f"{server.home.resolve() / 'functions' / 'default' / 'summarize'}/"
    )
    out = http.post("/v1/functions/summarize/invoke", json={"text": "Cats sleep most of the day."})
    assert out.status_code == 200, out.text
    assert out.json()["summary"]
    exposed = [
        f"{oct(stat.S_IMODE(p.lstat().st_mode))} {p}"
        for p in server.home.rglob("*")
        if not p.is_symlink() and p.lstat().st_mode & 0o077
    ]
    assert exposed == []  # logs, serve.json, the Redis AOF, the model store, function code
    assert any((server.home / "redis").rglob("*.aof"))  # the AOF was among those checked
