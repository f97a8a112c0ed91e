"""A progressive load that fails after the instance started (TIDAL §5.2) behind a real
``ember serve``: the instance is replaced, not left failing every request."""

from __future__ import annotations

import os

import httpx
import pytest

from gateway.spawn import ServeProcess
from tests.conftest import wait_until
from tests.gateway.test_lora_serve import complete, spec
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf

pytestmark = pytest.mark.slow


def test_an_instance_whose_weights_failed_to_load_is_replaced(
    server: ServeProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("failed-load")
    write_tiny_gguf(root / "tiny.gguf", hf_weights(31))
    with httpx.Client(base_url=server.url, timeout=120) as http:
        resp = http.post("/v1/functions", json=spec("half-loaded", root / "tiny.gguf", []))
        assert resp.status_code == 201, resp.text
        data = max(
            (p for p in (server.home / "models").rglob("store/*.safetensors") if "tiny" in str(p)),
            key=lambda p: p.stat().st_size,
        )
        saved = data.read_bytes()
        os.truncate(data, len(saved) // 2)  # the later layers' bytes are gone: the load fails mid-way
        try:
            failed = complete(http, "half-loaded")
            assert failed.status_code >= 500, failed.text
        finally:
            data.write_bytes(saved)  # the trouble was transient

        def instances() -> list[object]:
            return list(http.get("/v1/cluster").json()["functions"]["half-loaded"]["instances"])

        wait_until(lambda: not instances(), 20, 0.2)  # it drained and exited
        again = complete(http, "half-loaded")  # a new instance, a new acquire
        assert again.status_code == 200, again.text
