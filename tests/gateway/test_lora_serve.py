"""Issue 16 (TIDAL, LoRA) end to end: two functions on one base with different adapters behind a
real ``ember serve``, each adapter selected per request as ``FUNCTION:ADAPTER`` over the OpenAI API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.lora_files import write_adapter
from gateway.spawn import ServeProcess
from runtime.models.lora import MODULES
from tests.runtime.tiny_gguf import HEADS, HIDDEN, INTER, KV_HEADS, LAYERS, hf_weights, write_tiny_gguf

pytestmark = pytest.mark.slow

CONFIG = {
    "hidden_size": HIDDEN,
    "intermediate_size": INTER,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
}


def spec(name: str, gguf: Path, adapters: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "apiVersion": "ember.dev/v1",
        "kind": "Function",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": f"gguf:{gguf}", "dtype": "float32", "adapters": adapters},
            "scaling": {"maxScale": 1, "keepAlive": "120s", "concurrency": 8},
        },
    }


def complete(http: httpx.Client, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "the cat", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return http.post("/v1/completions", json=body)


def test_two_functions_on_one_base_answer_with_their_own_adapters(
    server: ServeProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("lora-serve")
    gguf = root / "tiny.gguf"
    write_tiny_gguf(gguf, hf_weights(21))
    fr = write_adapter(root / "fr", CONFIG, seed=1, std=0.3)
    pirate = write_adapter(root / "pirate", CONFIG, seed=2, rank=4, targets=tuple(MODULES), std=0.3)
    with httpx.Client(base_url=server.url, timeout=180) as http:
        for name, adapters in (
            ("lora-one", [{"name": "fr", "source": f"safetensors:{fr}"}]),
            ("lora-two", [{"name": "pirate", "source": str(pirate)}]),
        ):
            resp = http.post("/v1/functions", json=spec(name, gguf, adapters))
            assert resp.status_code == 201, resp.text
        described = http.get("/v1/functions/lora-one").json()
        assert described["spec"]["model"]["adapters"] == [{"name": "fr", "source": f"safetensors:{fr}"}]

        texts = {}
        for model in ("lora-one", "lora-one:fr", "lora-two:pirate", "lora-two"):
            resp = complete(http, model)
            assert resp.status_code == 200, resp.text
            texts[model] = resp.json()["choices"][0]["text"]
        assert texts["lora-one"] == texts["lora-two"]  # one base, no adapter: the same answer
        assert len({texts["lora-one"], texts["lora-one:fr"], texts["lora-two:pirate"]}) == 3
        assert complete(http, "lora-one:fr").json()["choices"][0]["text"] == texts["lora-one:fr"]

        wrong = complete(http, "lora-one:pirate")  # another function's adapter
        assert wrong.status_code == 400 and "no adapter 'pirate'" in wrong.text
        missing = http.post(
            "/v1/functions", json=spec("lora-bad", gguf, [{"name": "x", "source": str(root / "none")}])
        )
        assert missing.status_code == 400 and "spec.model.adapters.0.source" in missing.text
        other_base = write_adapter(root / "other", {**CONFIG, "hidden_size": 2 * HIDDEN}, seed=3)
        unfit = http.post(
            "/v1/functions", json=spec("lora-unfit", gguf, [{"name": "x", "source": str(other_base)}])
        )  # every instance would fail to start: refused at deploy
        assert unfit.status_code == 400 and "this base needs" in unfit.text
