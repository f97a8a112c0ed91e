"""A worker's front door (issue 10): its credential, the body bound, prompts far beyond the
context, OpenAI fields Ember does not implement, and ``max_tokens`` capped by ``maxTokens``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from runtime.openai_api import RequestError, parse_request, sampling_params
from runtime.registry import RegisteredModel, register
from runtime.worker_guard import TOKEN_HEADER
from tests.conftest import PoolProcess
from tests.proc_memory import memory_kib
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf

pytestmark = pytest.mark.slow

MAX_BODY = 64 << 10  # the worker's bound in these tests (bytes)
CONTEXT = 256  # the tiny model's context (tokens)
MB = 1 << 20


class Worker(NamedTuple):
    url: str
    token: str  # its credential
    pid: int


CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """``ember worker`` serving the tiny model, as its readiness line names it."""
    root = tmp_path_factory.mktemp("tiny")
    write_tiny_gguf(root / "tiny.gguf", hf_weights(3))
    tiny: RegisteredModel = register(str(root / "tiny.gguf"), "float32", home=root / "home")
    pool = PoolProcess(root / "pool.sock", "8MiB", store=(tiny.store_path,))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "worker", "--name", "tiny", "--model-dir", str(tiny.directory),
         "--pool-socket", pool.socket_path, "--max-body-bytes", str(MAX_BODY)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        ready = json.loads(line)
        yield Worker(ready["url"], ready["token"], ready["pid"])
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
        pool.stop()


def test_every_route_but_healthz_needs_the_credential(worker: Worker) -> None:
    url, token = worker.url, worker.token
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/healthz").json()["status"] == "ok"
        routes = ["/invoke", "/v1/chat/completions", "/v1/completions", "/_ember/assign", "/_ember/preload",
                  "/_ember/threads"]  # fmt: skip
        for path in routes:
            for headers in ({}, {TOKEN_HEADER: "x" * len(token)}, {TOKEN_HEADER: token[:-1]}):
                resp = http.post(path, json={**CHAT, "num_threads": 1, "model_dir": "/"}, headers=headers)
                assert resp.status_code == 401, (path, resp.text)
                assert resp.json()["error"]["type"] == "unauthorized"
        ok = http.post("/v1/chat/completions", json=CHAT, headers={TOKEN_HEADER: token})
        assert ok.status_code == 200, ok.text


def test_healthz_tells_what_the_worker_serves_only_to_the_credentials_holder(worker: Worker) -> None:
    with httpx.Client(base_url=worker.url, timeout=60) as http:
        for headers in ({}, {TOKEN_HEADER: "x" * len(worker.token)}):
            assert http.get("/healthz", headers=headers).json() == {"status": "ok"}
        health = http.get("/healthz", headers={TOKEN_HEADER: worker.token}).json()
        assert health["status"] == "ok" and health["function"] == "tiny" and health["state"] == "serving"


def test_unknown_routes_and_methods_answer_embers_error_body(worker: Worker) -> None:
    with httpx.Client(base_url=worker.url, headers={TOKEN_HEADER: worker.token}, timeout=60) as http:
        for method, path, status, kind in (
            ("GET", "/nope", 404, "not_found"),
            ("GET", "/invoke", 405, "method_not_allowed"),
        ):
            resp = http.request(method, path)
            assert resp.status_code == status and resp.json()["error"]["type"] == kind, resp.text


def test_malformed_agent_messages_are_400(worker: Worker) -> None:
    url, token = worker.url, worker.token
    with httpx.Client(base_url=url, headers={TOKEN_HEADER: token}, timeout=60) as http:
        for body in ({"num_threads": True}, {"num_threads": 2, "extra": 1}, {"num_threads": 10**9}):
            resp = http.post("/_ember/threads", json=body)
            assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
        resp = http.post("/_ember/preload", json={"model_dir": ["/"]})
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "preload_failed"
        assert http.post("/_ember/threads", json={"num_threads": 1}).json() == {"num_threads": 1}


def test_oversized_bodies_are_413_before_buffering(worker: Worker) -> None:
    url, token = worker.url, worker.token
    big = json.dumps({"prompt": "a" * (MAX_BODY + 1)}).encode()
    with httpx.Client(base_url=url, headers={TOKEN_HEADER: token}, timeout=60) as http:
        resp = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert resp.status_code == 413 and resp.json()["error"]["type"] == "request_too_large"

        def chunks() -> Iterator[bytes]:  # no Content-Length: the worker counts as it reads
            for i in range(0, len(big), 4096):
                yield big[i : i + 4096]

        chunked = http.post("/invoke", content=chunks(), headers={"content-type": "application/json"})
        assert chunked.status_code == 413
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200  # still serving


def test_50mb_bodies_leave_the_workers_memory_as_it_was(worker: Worker) -> None:
    """Twenty 50 MB bodies, half declared and half chunked: each is refused at the bound, and
    the worker's peak RSS does not grow by more than noise (none of the bodies is buffered)."""
    body = b"[" * (50 * MB)
    before = memory_kib(worker.pid)
    with httpx.Client(base_url=worker.url, headers={TOKEN_HEADER: worker.token}, timeout=60) as http:
        for i in range(20):

            def chunks() -> Iterator[bytes]:
                for start in range(0, len(body), MB):
                    yield body[start : start + MB]

            content = body if i % 2 else chunks()
            resp = http.post(
                "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
            )
            assert resp.status_code == 413 and resp.json()["error"]["type"] == "request_too_large"
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200  # still serving
    after = memory_kib(worker.pid)
    assert after["VmHWM"] - before["VmHWM"] < 24 << 10, (before, after)
    assert after["VmRSS"] - before["VmRSS"] < 24 << 10, (before, after)


def test_an_integer_of_5000_digits_is_a_400(worker: Worker) -> None:
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}"
    with httpx.Client(base_url=worker.url, headers={TOKEN_HEADER: worker.token}, timeout=60) as http:
        for path in ("/v1/chat/completions", "/v1/completions", "/invoke"):
            resp = http.post(path, content=body, headers={"content-type": "application/json"})
            assert resp.status_code == 400, (path, resp.text)
            assert resp.json()["error"]["type"] == "invalid_request_error"
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200  # the same connection


def test_prompts_far_beyond_the_context_are_rejected_before_tokenizing(worker: Worker) -> None:
    url, token = worker.url, worker.token
    prompt = "word " * (CONTEXT * 32 // 5 + 1)  # under the body bound, over 32 characters a token
    with httpx.Client(base_url=url, headers={TOKEN_HEADER: token}, timeout=60) as http:
        t0 = time.perf_counter()
        resp = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert resp.status_code == 400
        message = resp.json()["error"]["message"]
        assert "characters" in message and f"context of {CONTEXT} tokens" in message
        assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize(
    ("field", "raw"),
    [("max_tokens", '"5"'), ("max_tokens", "true"), ("max_tokens", "5.5"), ("max_completion_tokens", '"5"'),
     ("temperature", '"0.5"'), ("temperature", "false"), ("temperature", "NaN"), ("top_p", "Infinity"),
     ("seed", '"7"'), ("presence_penalty", '"1"'), ("logit_bias", '{"5": "10"}')],
)  # fmt: skip
def test_wrong_types_are_400s_naming_the_field(worker: Worker, field: str, raw: str) -> None:
    """As OpenAI checks them: no string-to-number or bool-to-number conversion, no NaN."""
    chat = {key: value for key, value in CHAT.items() if key != field}
    body = json.dumps(chat)[:-1] + f', "{field}": {raw}}}'
    with httpx.Client(base_url=worker.url, headers={TOKEN_HEADER: worker.token}, timeout=60) as http:
        resp = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"].split(".")[0] == field, resp.text  # logit_bias.5: its key


@pytest.mark.parametrize(
    ("field", "value"),
    [("n", 17), ("logprobs", 1), ("top_logprobs", 3), ("tools", "none"),
     ("tool_choice", "auto"), ("response_format", "json"), ("logit_bias", {"99999": 5}),
     ("functions", [{"name": "f"}]), ("function_call", "auto"), ("echo", True), ("best_of", 3),
     ("suffix", "!"), ("reasoning_effort", "low"), ("service_tier", "flex"), ("store", True),
     ("verbosity", "high"), ("web_search_options", {}), ("top_k", -2),
     ("stream_options", {"include_usage": True})],  # without stream: true
)  # fmt: skip
def test_unimplemented_and_unknown_openai_fields_are_400s_naming_the_field(
    worker: Worker, field: str, value: object
) -> None:
    url, token = worker.url, worker.token
    with httpx.Client(base_url=url, headers={TOKEN_HEADER: token}, timeout=60) as http:
        resp = http.post("/v1/chat/completions", json={**CHAT, field: value})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["message"].startswith(f"{field}:")
        # OpenAI's error object: the field at fault is its param.
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["param"] == field
        harmless = {"n": 1, "user": "u", "metadata": {"k": "v"}, "store": False, "logprobs": False,
                    "service_tier": "auto", "prompt_cache_key": "c", "safety_identifier": "s"}  # fmt: skip
        assert http.post("/v1/chat/completions", json={**CHAT, **harmless}).status_code == 200


def test_ignore_eos_decodes_exactly_max_tokens(worker: Worker) -> None:
    """vLLM's ``ignore_eos`` over HTTP: the benchmark's fixed-length decode (it was a 400)."""
    url, token = worker.url, worker.token
    with httpx.Client(base_url=url, headers={TOKEN_HEADER: token}, timeout=60) as http:
        resp = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 24, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["completion_tokens"] == 24
        assert body["choices"][0]["finish_reason"] == "length"


def test_max_completion_tokens_is_max_tokens_and_wins() -> None:
    both = parse_request({"prompt": "x", "max_tokens": 50, "max_completion_tokens": 3}, chat=False)
    assert both.max_tokens == 3
    with pytest.raises(RequestError, match="max_completion_tokens"):
        parse_request({"prompt": "x", "max_completion_tokens": 0}, chat=False)


def test_max_tokens_is_capped_by_the_functions_max_tokens() -> None:
    request = parse_request({"prompt": "x", "max_tokens": 500}, chat=False)
    params = sampling_params(request, prompt_len=10, max_context=1000, default_max=64)
    assert params.max_tokens == 64
    with pytest.raises(RequestError, match="context"):  # beyond the context is still an error
        sampling_params(parse_request({"prompt": "x", "max_tokens": 5000}, chat=False), 10, 1000, 64)
