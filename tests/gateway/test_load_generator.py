"""An external OpenAI load generator (guidellm) against a real ``ember serve``.

guidellm runs with its default request payloads: synthetic prompts of a set token count, each
request asking for a set number of output tokens the way it asks every server (``ignore_eos``
plus ``max_completion_tokens`` for chat, ``max_tokens`` for completions, streamed with
``stream_options.include_usage`` and vLLM's ``continuous_usage_stats``, chat content as a list of
text parts). Every request must complete and produce exactly the tokens it asked for: issue 13
saw a generator asking for 32 tokens get up to 97.

guidellm needs a tokenizer to build prompts of a given token count; no model hub is reachable,
so the tokenizer is written from the served model's own GGUF into a directory it loads.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.spawn import ServeProcess
from runtime.gguf_import import read_gguf, write_hf_metadata
from runtime.sources import resolve
from tests.gateway.conftest import SMOLLM2, chat_spec, wait_for

pytestmark = pytest.mark.slow

FUNCTION = "bench-chat"
REQUESTS = 8
CONCURRENCY = 2
PROMPT_TOKENS = 48
OUTPUT_TOKENS = 16


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config.json, tokenizer.json and tokenizer_config.json of SmolLM2, from its GGUF."""
    directory = tmp_path_factory.mktemp("smollm2-tokenizer")
    write_hf_metadata(read_gguf(resolve(SMOLLM2).path), directory)
    return directory


@pytest.fixture(scope="module")
def deployed(server: ServeProcess) -> str:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        answer = http.post(
            "/v1/functions", json=chat_spec(FUNCTION, keep_alive="120s", concurrency=CONCURRENCY)
        )
        assert answer.status_code == 201, answer.text
        # One request first: the runs measure a started instance, not its cold start.
        warm = http.post("/v1/completions", json={"model": FUNCTION, "prompt": "Hello", "max_tokens": 1})
        assert warm.status_code == 200, warm.text
    return FUNCTION


def served(server: ServeProcess, route: str) -> float:
    """``ember_requests_total`` of the function on ``route`` answered 200 (the gateway's count)."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    pattern = rf'^ember_requests_total{{function="{FUNCTION}",route="{route}",status="200"}} (\S+)$'
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def run_guidellm(tmp_path: Path, target: str, model: str, tokenizer: Path, request_format: str) -> Any:
    """One short concurrent guidellm run; its JSON report."""
    report = tmp_path / "guidellm.json"
    scenario = {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": target,
                "model": model,
                "request_format": request_format,
                "timeout": 120,
            },
            "profile": {"kind": "concurrent", "streams": [CONCURRENCY]},
            "constraints": [{"kind": "max_requests", "count": REQUESTS}],
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
            "data": [
                {"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS}
            ],
            "outputs": [{"kind": "json", "path": str(report)}],
        }
    }
    scenario_path = tmp_path / "scenario.json"
    scenario_path.write_text(json.dumps(scenario))
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",  # nothing outside the machine: fail fast rather than retry a hub
        TRANSFORMERS_OFFLINE="1",
        GUIDELLM__MAX_WORKER_PROCESSES="1",  # the machine is small; two streams need one process
    )
    done = subprocess.run(
        [sys.executable, "-m", "guidellm", "run", "-c", str(scenario_path), "--disable-console"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(report.read_text())


@pytest.mark.parametrize(
    ("request_format", "route"), [("/v1/chat/completions", "chat"), ("/v1/completions", "completions")]
)
def test_guidellm_default_payloads_complete_with_exact_output_lengths(
    server: ServeProcess, deployed: str, tokenizer_dir: Path, tmp_path: Path, request_format: str, route: str
) -> None:
    before = served(server, route)
    report = run_guidellm(tmp_path, server.url, deployed, tokenizer_dir, request_format)
    (benchmark,) = report["benchmarks"]
    requests = benchmark["requests"]
    errors = [r["info"].get("error") for r in requests["errored"]]
    assert errors == [] and requests["incomplete"] == [], errors[:2]
    done = requests["successful"]
    # guidellm's own record of each request (its scheduler state says where one went missing).
    assert len(done) == REQUESTS, benchmark["scheduler_state"]
    # Every request answered 200 by Ember (a stream is counted once its last chunk is sent).
    wait_for(lambda: served(server, route) - before >= REQUESTS, timeout=10)
    assert served(server, route) - before == REQUESTS
    for record in done:
        body = json.loads(record["request_args"])["body"]  # what guidellm sent
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        assert asked == OUTPUT_TOKENS and body["ignore_eos"] is True and body["stream"] is True
        # The output length guidellm recorded (the usage Ember reported) is what it asked for.
        assert record["output_tokens"] == asked, record["output_metrics"]
        assert record["output_metrics"]["text_tokens"] == asked
        assert record["output"]  # and text came with it
        assert record["prompt_tokens"] >= PROMPT_TOKENS  # its synthetic prompt, plus a chat template
