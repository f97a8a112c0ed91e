"""``ember deploy -f F.yaml --target knative`` prints the function's Knative Service, token
Secret and (custom handlers) code ConfigMap without a gateway or a cluster (as ``func`` and
``kn`` do): the spec is validated locally, the model's annotations come from the local model
store when it holds the model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from runtime.registry import register
from runtime.sources import SourceRoots
from scheduler import cluster_keys
from scheduler.knative.config import KnativeConfig
from scheduler.knative.handler_code import HandlerCode
from scheduler.knative.render import render_record
from scheduler.records import FunctionRecord, ModelRef
from scheduler.spec import parse_function
from tests.deploy.knative_rules import validate
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]


def deploy(spec_file: Path, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    # A gateway URL where nothing listens: the verb must not need (or try) one.
    environ.update(EMBER_HOME=str(home), EMBER_URL="http://127.0.0.1:9", **env)
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "deploy", "-f", str(spec_file), "--target", "knative"],
        capture_output=True, text=True, env=environ, cwd=ROOT, timeout=120, check=False,
    )  # fmt: skip


def spec_file(tmp_path: Path, source: str, **body: Any) -> Path:
    document = {
        "apiVersion": "ember.dev/v1",
        "kind": "Function",
        "metadata": {"name": "tiny-chat", "namespace": "team-a"},
        "spec": {"model": {"source": source, "dtype": "float32"}, **body},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "models" / "tiny.gguf"
    path.parent.mkdir()
    write_tiny_gguf(path, hf_weights(5))
    return path


def test_an_unregistered_model_renders_without_its_annotations_and_warns(
    tmp_path: Path, tiny_gguf: Path
) -> None:
    path = spec_file(tmp_path, f"gguf:{tiny_gguf}", scaling={"keepAlive": "2s"})
    done = deploy(path, tmp_path / "home", EMBER_IMAGE="registry.example/ember:1")
    assert done.returncode == 0, done.stderr
    service, secret = yaml.safe_load_all(done.stdout)
    document = parse_function(yaml.safe_load(path.read_text())).to_document()
    expected = render_record(
        FunctionRecord.create("team-a/tiny-chat", document), KnativeConfig(image="registry.example/ember:1")
    )
    assert service == expected.service
    assert secret == expected.secret and "stringData" not in secret
    assert "# stringData.token is left out" in done.stdout  # said in the YAML itself
    assert "warning:" in done.stderr and "cannot score residency" in done.stderr
    assert "note:" in done.stderr and "keepAlive 2s" in done.stderr


def test_a_registered_model_gives_the_annotations_the_extender_reads(
    tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    roots = SourceRoots((Path(os.path.realpath(tiny_gguf.parent)),))
    model = register(f"gguf:{tiny_gguf}", "float32", home=home, roots=roots)
    done = deploy(spec_file(tmp_path, f"gguf:{tiny_gguf}", device="cpu"), home)
    assert done.returncode == 0, done.stderr
    service, _ = yaml.safe_load_all(done.stdout)
    annotations = service["spec"]["template"]["metadata"]["annotations"]
    ref = ModelRef(model.model_id, str(model.directory), int(model.manifest().nbytes))
    assert annotations[cluster_keys.ANNOTATION_MODEL] == ref.model_id
    assert annotations[cluster_keys.ANNOTATION_WEIGHT_BYTES] == str(ref.weight_bytes) != "0"
    assert done.stderr == ""  # nothing to warn about or note


def test_a_custom_handler_prints_its_code_as_a_configmap_before_the_service(
    tmp_path: Path, tiny_gguf: Path
) -> None:
    """Issue 11: a custom handler runs in cluster mode; its module (read from beside the YAML)
    is an immutable ConfigMap that the Service's pods mount read-only."""
    source = "def handler(event, context):\n    return {'echo': event}\n"
    (tmp_path / "hello.py").write_text(source)
    path = spec_file(tmp_path, f"gguf:{tiny_gguf}", handler="hello.py:handler")
    done = deploy(path, tmp_path / "home")
    assert done.returncode == 0, done.stderr
    config_map, service, secret = yaml.safe_load_all(done.stdout)
    assert done.stdout.index("kind: ConfigMap") < done.stdout.index("kind: Service")
    code = HandlerCode("hello.py", "handler", source)
    document = parse_function(yaml.safe_load(path.read_text())).to_document()
    expected = render_record(FunctionRecord.create("team-a/tiny-chat", document), KnativeConfig(), code)
    assert (config_map, service, secret) == (expected.config_map, expected.service, expected.secret)
    assert config_map["data"] == {"hello.py": source} and config_map["immutable"] is True
    assert config_map["metadata"]["name"] == f"team-a--tiny-chat-code-{code.digest}"
    container = service["spec"]["template"]["spec"]["containers"][0]
    env = {"name": "EMBER_FUNCTION_HANDLER", "value": f"team-a/tiny-chat/{code.digest}/hello.py:handler"}
    assert env in container["env"]
    for doc in (config_map, service, secret):
        assert validate(doc) == [], doc["kind"]


@pytest.mark.parametrize(
    ("body", "env", "message"),
    [
        ({"scaling": {"concurrency": 1001}}, {}, "spec.scaling.concurrency"),
        ({"maxTokens": 8192}, {}, "spec.maxTokens"),
        ({"handler": "hello.py:handler"}, {}, "spec.handler"),  # no hello.py beside the YAML
        ({"scaling": {"keepAlive": "soon"}}, {}, "spec.scaling.keepAlive"),
        ({}, {"EMBER_KNATIVE_TARGET_PERCENT": "0"}, "EMBER_KNATIVE_TARGET_PERCENT"),
    ],
)
def test_what_cannot_be_rendered_fails_naming_the_field(
    tmp_path: Path, tiny_gguf: Path, body: dict[str, Any], env: dict[str, str], message: str
) -> None:
    done = deploy(spec_file(tmp_path, f"gguf:{tiny_gguf}", **body), tmp_path / "home", **env)
    assert done.returncode == 2
    assert message in done.stderr and done.stdout == ""
