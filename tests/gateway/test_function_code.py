"""Custom handler modules: uploaded with the spec, stored 0600 in the function's own directory,
never read from an arbitrary server path (one message for missing and refused paths)."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gateway.app import GatewayConfig, create_app
from gateway.function_code import (
    MAX_MODULE_BYTES,
    FunctionCodeConfig,
    read_stored,
    store_handler,
    with_handler_module,
)
from scheduler.spec import SpecError
from scheduler.state import ClusterState
from tests.gateway.conftest import FUNCTIONS, chat_spec

MODULE = "async def handler(event, context):\n    return event\n"


def custom(name: str, handler: str) -> dict[str, Any]:
    document = chat_spec(name)
    document["spec"]["handler"] = handler
    return document


def upload(name: str, module: str, source: str, handler: str | None = None) -> dict[str, Any]:
    return {"function": custom(name, handler or f"{module}:handler"), "files": {module: source}}


def test_uploaded_modules_are_stored_owner_only_in_the_functions_directory(
    state: ClusterState, tmp_path: Path
) -> None:
    code = FunctionCodeConfig(tmp_path / "home" / "functions")
    with TestClient(create_app(state, GatewayConfig(code=code))) as http:
        created = http.post("/v1/functions", json=upload("echo", "echo.py", MODULE))
        assert created.status_code == 201, created.text
        path_text, _, function = created.json()["spec"]["handler"].rpartition(":")
        stored = Path(path_text)
        assert function == "handler" and stored.read_text() == MODULE
        assert stored.is_relative_to(code.function_dir("echo"))
        assert stat.S_IMODE(stored.stat().st_mode) == 0o600
        assert stat.S_IMODE(stored.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE((code.function_dir("echo")).stat().st_mode) == 0o700
        again = http.post("/v1/functions", json=created.json())  # describe's output redeploys as is
        assert again.status_code == 201 and again.json() == created.json()
        changed = http.post("/v1/functions", json=upload("echo", "echo.py", MODULE + "# v2\n"))
        assert changed.json()["spec"]["handler"] != created.json()["spec"]["handler"]
        assert stored.read_text() == MODULE  # the running version's module is never rewritten
        assert http.delete("/v1/functions/echo").status_code == 204
        assert not (code.function_dir("echo")).exists()


def test_handler_paths_outside_the_function_are_refused_uniformly(
    state: ClusterState, tmp_path: Path
) -> None:
    ops = tmp_path / "ops"  # an operator's handler root
    ops.mkdir()
    code = FunctionCodeConfig(tmp_path / "functions", handler_roots=(FUNCTIONS, ops))
    outside = tmp_path / "outside.py"
    outside.write_text(MODULE)
    (ops / "link_out.py").symlink_to(outside)
    with TestClient(create_app(state, GatewayConfig(code=code))) as http:
        for handler in (
            f"{outside}:handler",  # exists, outside every root
            f"{FUNCTIONS}/../tests/gateway/conftest.py:handler",  # `..` out of a handler root
            f"{json.__file__}:loads",  # a module of the server's Python
            f"{FUNCTIONS}/summarize/missing.py:handler",  # inside a root, missing: the same answer
            "summarize.py:handler",  # relative, nothing uploaded
            f"{ops}/../outside.py:handler",
            f"{ops}/link_out.py:handler",  # a symlink in a handler root that leads out of it
        ):
            bad = http.post("/v1/functions", json=custom("sneaky", handler))
            assert bad.status_code == 400, bad.text
            assert bad.json()["error"] == {
                "type": "invalid_function_spec",
                "code": "invalid_function_spec",
                "param": None,
                "message": f"spec.handler: handler module not found or not allowed: {handler} "
                "(upload it with the spec: `ember deploy -f FILE.yaml` sends the module beside the YAML)",
            }
        ok = http.post(
            "/v1/functions", json=custom("summarize", f"{FUNCTIONS}/summarize/summarize.py:handler")
        )
        assert ok.status_code == 201, ok.text  # an operator's handler root: copied into the function
        assert ok.json()["spec"]["handler"].startswith(f"{code.function_dir('summarize')}/")
        assert http.get("/v1/functions/sneaky").status_code == 404


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (upload("big", "big.py", "x = 1\n" + "#" * MAX_MODULE_BYTES), "larger than"),
        (upload("syntax", "bad.py", "def handler(:\n"), "not valid Python"),
        (upload("nul", "nul.py", "x = 1\0"), "NUL"),
        (upload("other", "a.py", MODULE, handler="b.py:handler"), "files"),
        (upload("dots", "../x.py", MODULE, handler="../x.py:handler"), "files"),
        ({"function": chat_spec("default-with-files"), "files": {"a.py": MODULE}}, "default handler"),
        ({"function": chat_spec("extra"), "extra": 1}, "unknown fields"),
        ({"function": chat_spec("notdict"), "files": ["a.py"]}, "files"),
    ],
)
def test_bad_uploads_are_400s_naming_the_problem(
    state: ClusterState, tmp_path: Path, body: dict[str, Any], named: str
) -> None:
    code = FunctionCodeConfig(tmp_path / "functions")
    with TestClient(create_app(state, GatewayConfig(code=code))) as http:
        bad = http.post("/v1/functions", json=body)
        assert bad.status_code == 400, bad.text
        assert (
            bad.json()["error"]["type"] == "invalid_function_spec" and named in bad.json()["error"]["message"]
        )
    assert not any(p.is_file() for p in code.root.rglob("*"))  # nothing was stored


def test_ember_deploy_uploads_the_module_beside_the_yaml(tmp_path: Path) -> None:
    import yaml

    spec_file = FUNCTIONS / "summarize" / "function.yaml"
    body = with_handler_module(yaml.safe_load(spec_file.read_text()), spec_file)
    assert body["function"]["spec"]["handler"] == "summarize.py:handler"
    assert body["files"] == {"summarize.py": (FUNCTIONS / "summarize" / "summarize.py").read_text()}
    default = yaml.safe_load((FUNCTIONS / "smollm2-chat" / "function.yaml").read_text())
    assert with_handler_module(default, spec_file) == default  # default handlers: the spec as today


def test_cluster_mode_reads_back_only_the_functions_own_stored_module(tmp_path: Path) -> None:
    """What the gateway renders as the function's ConfigMap (issue 11): the module it stored, in
    that function's directory, under the digest it was stored by."""
    config = FunctionCodeConfig(tmp_path / "functions")
    source = "def handler(event, context):\n    return event\n"
    handler = store_handler(config, "team/chat", "hello.py:handler", {"hello.py": source})
    code = read_stored(config, "team/chat", handler)
    assert (code.module, code.function, code.source) == ("hello.py", "handler", source)
    assert Path(handler.rpartition(":")[0]).parent.name == code.digest  # one content address
    other = store_handler(config, "team/other", "hello.py:handler", {"hello.py": source})
    for function_id, ref in (
        ("team/chat", other),
        ("team/chat", "/etc/passwd.py:handler"),
        ("chat", handler),
    ):
        with pytest.raises(SpecError, match="not found or not allowed"):
            read_stored(config, function_id, ref)
    with pytest.raises(SpecError, match="not found or not allowed"):
        read_stored(None, "team/chat", handler)
