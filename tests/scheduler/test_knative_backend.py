"""The Knative backends without a cluster (there is no kube-apiserver here).

The Kubernetes backend's pure part is tested on real-shaped API objects: the request each
apply would send (:func:`plan`) and how API failures map to Ember's errors (with the
client's own exception types). Its calls are exercised only as far as a machine without a
cluster allows: credentials missing, and an API address where nothing listens. The manifest
directory backend (``EMBER_KNATIVE_APPLY=dir:``) is tested in full, through
:class:`KnativeDeployments` as the gateway calls it.
"""

from __future__ import annotations

import json
import socket
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import MaxRetryError, NewConnectionError

from scheduler import cluster_keys
from scheduler.knative.backend import DirectoryBackend, make_backend
from scheduler.knative.config import KnativeConfig
from scheduler.knative.deployments import KnativeDeployments
from scheduler.knative.errors import KnativeError, KnativeUnavailable, ServiceConflict
from scheduler.knative.handler_code import MAX_MODULE_BYTES, HandlerCode
from scheduler.knative.kube import KubernetesBackend, api_error, plan
from scheduler.knative.kube_code import code_selector, plan_code, stale_code
from scheduler.knative.render import render_record
from scheduler.knative.tokens import WorkerTokens
from scheduler.records import FunctionRecord, ModelRef
from scheduler.spec import SpecError
from tests.scheduler.test_knative_render import record
from tests.scheduler.test_knative_status import READY_SERVICE

TOKENS = WorkerTokens(b"k" * 48)
FUNCTION_ID = "smollm2-chat"


def desired() -> dict[str, Any]:
    return render_record(record(), KnativeConfig()).service


def live(**metadata: Any) -> dict[str, Any]:
    """The Service as the API returns it (Knative's annotations, a resourceVersion, status)."""
    obj = json.loads(json.dumps(READY_SERVICE))
    obj["metadata"].update(metadata)
    return obj


def test_a_new_object_is_created_as_rendered() -> None:
    step = plan(None, desired(), FUNCTION_ID, "Service smollm2-chat")
    assert (step.verb, step.body) == ("create", desired())


def test_an_update_replaces_the_spec_and_keeps_knative_metadata() -> None:
    existing = live()
    existing["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"] = "{}"
    existing["metadata"]["labels"]["team.example/owner"] = "ml"
    existing["metadata"]["labels"]["ember.dev/retired"] = "x"  # an Ember key the rendering dropped
    step = plan(existing, desired(), FUNCTION_ID, "Service smollm2-chat")
    assert step.verb == "replace"
    meta = step.body["metadata"]
    assert meta["resourceVersion"] == "184467"  # a concurrent writer makes the replace a 409
    # Knative's webhook rejects an update that changes serving.knative.dev/creator.
    assert meta["annotations"]["serving.knative.dev/creator"] == "system:serviceaccount:ember:ember-gateway"
    assert meta["annotations"]["kubectl.kubernetes.io/last-applied-configuration"] == "{}"
    assert meta["labels"]["team.example/owner"] == "ml"
    assert "ember.dev/retired" not in meta["labels"]
    ours = {k: v for k, v in meta["labels"].items() if k != "team.example/owner"}
    assert ours == desired()["metadata"]["labels"]
    assert step.body["spec"] == desired()["spec"]  # Ember's, whole
    assert "status" not in step.body


@pytest.mark.parametrize("owner", ["team-a/other", None])
def test_an_object_of_another_function_or_of_nobody_is_never_replaced(owner: str | None) -> None:
    existing = live()
    if owner is None:
        del existing["metadata"]["annotations"][cluster_keys.ANNOTATION_FUNCTION_ID]
    else:
        existing["metadata"]["annotations"][cluster_keys.ANNOTATION_FUNCTION_ID] = owner
    with pytest.raises(ServiceConflict, match="left untouched"):
        plan(existing, desired(), FUNCTION_ID, "Service smollm2-chat")


def api_exception(status: int, body: dict[str, Any] | None = None, reason: str = "") -> ApiException:
    exc = ApiException(status=status, reason=reason)
    exc.body = json.dumps(body) if body is not None else None
    return exc


def test_api_failures_map_to_ember_errors() -> None:
    webhook = (
        'admission webhook "validation.webhook.serving.knative.dev" denied the request: validation failed: '
        "expected 0 <= 900 <= 600: spec.template.spec.timeoutSeconds"
    )
    status_body = {"kind": "Status", "message": webhook}
    denied = api_error(api_exception(400, status_body, "Bad Request"), "create Service x")
    assert type(denied) is KnativeError and webhook in str(denied)
    forbidden = api_error(api_exception(403, {"message": "services.serving.knative.dev is forbidden"}), "get")
    assert type(forbidden) is KnativeError and "credentials" in str(forbidden)
    assert isinstance(api_error(api_exception(409, reason="Conflict"), "replace"), ServiceConflict)
    assert isinstance(api_error(api_exception(503, reason="Service Unavailable"), "get"), KnativeUnavailable)
    assert isinstance(api_error(ApiException(status=0, reason="connection reset"), "get"), KnativeUnavailable)
    refused = MaxRetryError(None, "/apis", NewConnectionError(None, "Connection refused"))  # type: ignore[arg-type]
    assert isinstance(api_error(refused, "get"), KnativeUnavailable)
    huge = api_error(api_exception(422, {"message": "m" * 100_000}), "create")
    assert len(str(huge)) < 2000


def test_without_credentials_the_kubernetes_backend_fails_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    with pytest.raises(KnativeUnavailable, match="no Kubernetes credentials"):
        make_backend(KnativeConfig())


def test_an_api_where_nothing_listens_is_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "none", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "none", "user": "u"}}],
        "current-context": "c",
    }
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    backend = make_backend(KnativeConfig())
    assert isinstance(backend, KubernetesBackend)
    deployments = KnativeDeployments(KnativeConfig(), TOKENS, backend)
    try:
        with pytest.raises(KnativeUnavailable, match="cannot be reached"):
            deployments.apply(record())
        with pytest.raises(KnativeUnavailable):
            deployments.remove(FUNCTION_ID)
        shown = deployments.status(FUNCTION_ID)  # describe still answers
        assert (shown["ready"], shown["reason"]) == ("Unknown", "StatusUnavailable")
    finally:
        deployments.close()


def directory(tmp_path: Path) -> tuple[KnativeDeployments, DirectoryBackend]:
    config = KnativeConfig(apply_dir=tmp_path / "manifests")
    backend = make_backend(config)
    assert isinstance(backend, DirectoryBackend)
    return KnativeDeployments(config, TOKENS, backend), backend


def test_the_directory_backend_writes_what_a_gitops_tool_applies(tmp_path: Path) -> None:
    deployments, backend = directory(tmp_path)
    deployments.apply(record())
    service_path, secret_path, *_ = backend.paths("smollm2-chat")
    assert yaml.safe_load(service_path.read_text()) == desired()
    secret = yaml.safe_load(secret_path.read_text())
    assert secret["stringData"] == {"token": TOKENS.token(FUNCTION_ID)}
    assert stat.S_IMODE(secret_path.stat().st_mode) == 0o600  # the token
    assert not list(service_path.parent.glob(".*.tmp"))
    shown = deployments.status(FUNCTION_ID)
    assert (shown["found"], shown["ready"], shown["reason"]) == (True, "Unknown", "NoCluster")

    model = ModelRef("other-model", "/m", 7)
    deployments.apply(FunctionRecord.create(FUNCTION_ID, record().spec, model))  # a redeploy updates
    annotations = yaml.safe_load(service_path.read_text())["spec"]["template"]["metadata"]["annotations"]
    assert annotations[cluster_keys.ANNOTATION_MODEL] == "other-model"

    assert deployments.remove(FUNCTION_ID) is True
    assert not service_path.exists() and not secret_path.exists()
    assert deployments.remove(FUNCTION_ID) is False
    assert deployments.status(FUNCTION_ID)["reason"] == "NotFound"


def test_the_directory_backend_leaves_other_owners_files_alone(tmp_path: Path) -> None:
    deployments, backend = directory(tmp_path)
    theirs = render_record(record(name="chat", namespace="team"), KnativeConfig()).service
    theirs["metadata"]["annotations"][cluster_keys.ANNOTATION_FUNCTION_ID] = "someone-else"
    backend.directory.mkdir()
    path = backend.paths("team--chat")[0]
    path.write_text(yaml.safe_dump(theirs))
    with pytest.raises(ServiceConflict, match="someone-else"):
        deployments.apply(record(name="chat", namespace="team"))
    with pytest.raises(ServiceConflict):
        deployments.remove("team/chat")
    assert yaml.safe_load(path.read_text()) == theirs
    assert not backend.paths("team--chat")[1].exists()  # no Secret written either
    path.write_bytes(b"x" * (8 * MAX_MODULE_BYTES + 1))
    with pytest.raises(KnativeError, match="larger than"):
        deployments.apply(record(name="chat", namespace="team"))


def test_statuses_of_many_functions_at_once(tmp_path: Path) -> None:
    deployments, _ = directory(tmp_path)
    deployments.apply(record(name="a"))
    shown = deployments.statuses(["a", "b", "x--y"])
    assert shown["a"]["reason"] == "NoCluster"
    assert shown["b"]["reason"] == "NotFound"
    assert shown["x--y"]["reason"] == "NotRenderable"  # deployed before cluster mode, say


# ----- custom handlers' ConfigMaps (issue 11) --------------------------------------------------------

HELLO = "def handler(event, context):\n    return event\n"


def custom(source: str = HELLO) -> tuple[FunctionRecord, HandlerCode]:
    return record(handler="hello.py:handler"), HandlerCode("hello.py", "handler", source)


def test_the_directory_backend_keeps_the_current_and_previous_code_and_drops_them_with_the_function(
    tmp_path: Path,
) -> None:
    codes: list[HandlerCode] = []
    config = KnativeConfig(apply_dir=tmp_path / "manifests")
    backend = make_backend(config)
    assert isinstance(backend, DirectoryBackend)
    deployments = KnativeDeployments(config, TOKENS, backend, lambda _: codes[-1])
    service_path, _, code_path, previous_path = backend.paths("smollm2-chat")
    maps = []
    for source in (HELLO, HELLO + "# v2\n", HELLO + "# v3\n"):  # a deploy, then two with new code
        rec, code = custom(source)
        codes.append(code)
        rendered = deployments.apply(rec)
        maps.append(rendered.config_map)
        assert yaml.safe_load(code_path.read_text()) == rendered.config_map
        assert rendered.config_map is not None and rendered.config_map["data"] == {"hello.py": source}
        volumes = yaml.safe_load(service_path.read_text())["spec"]["template"]["spec"]["volumes"]
        assert {"name": "ember-handler", "configMap": {"name": f"smollm2-chat-code-{code.digest}",
                                                       "defaultMode": 0o444}} in volumes  # fmt: skip
        # The previous revision may still start pods while this one rolls out: its code stays.
        assert (yaml.safe_load(previous_path.read_text()) if len(maps) > 1 else None) == (
            maps[-2] if len(maps) > 1 else None
        ) or (len(maps) == 1 and not previous_path.exists())
    deployments.apply(custom(HELLO + "# v3\n")[0])  # the same code again: nothing moves
    assert yaml.safe_load(previous_path.read_text()) == maps[1]
    deployments.apply(record())  # back to the default handler: the last code becomes the previous
    assert not code_path.exists() and yaml.safe_load(previous_path.read_text()) == maps[2]
    deployments.apply(custom()[0])
    assert deployments.remove(FUNCTION_ID) is True
    assert not list((tmp_path / "manifests").glob("smollm2-chat.*"))


def test_the_largest_module_yaml_escapes_most_is_read_back(tmp_path: Path) -> None:
    # A control character is 4 bytes of YAML: the file must not pass the bound on reading back,
    # or the function could be neither redeployed nor removed.
    source = HELLO + "#" + "\x01" * (MAX_MODULE_BYTES - len(HELLO) - 1)
    config = KnativeConfig(apply_dir=tmp_path / "manifests")
    deployments = KnativeDeployments(config, TOKENS, make_backend(config), lambda _: custom(source)[1])
    deployments.apply(custom(source)[0])
    deployments.apply(custom(source)[0])
    assert deployments.remove(FUNCTION_ID) is True


def test_a_custom_handler_without_a_code_reader_is_a_spec_error(tmp_path: Path) -> None:
    deployments, _ = directory(tmp_path)
    deployments.check(custom()[0])  # before the module is stored: its names only
    with pytest.raises(SpecError, match=r"spec\.handler"):
        deployments.apply(custom()[0])


def configmap(
    name: str, owner: str | None, data: dict[str, str] | None = None, uid: str = "u", created: str = ""
) -> dict[str, Any]:
    """A ConfigMap as the API returns it."""
    annotations = {cluster_keys.ANNOTATION_FUNCTION_ID: owner} if owner else {}
    metadata = {"name": name, "uid": uid, "resourceVersion": "7", "annotations": annotations}
    if created:
        metadata["creationTimestamp"] = created
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data or {}}


def test_a_handler_configmap_is_created_once_and_never_replaced() -> None:
    rendered = render_record(custom()[0], KnativeConfig(), custom()[1])
    desired_map = rendered.config_map
    assert desired_map is not None
    name = desired_map["metadata"]["name"]
    assert plan_code(None, desired_map, FUNCTION_ID) is True
    assert plan_code(configmap(name, FUNCTION_ID, {"hello.py": HELLO}), desired_map, FUNCTION_ID) is False
    with pytest.raises(ServiceConflict, match="other contents"):
        plan_code(configmap(name, FUNCTION_ID, {"hello.py": "tampered"}), desired_map, FUNCTION_ID)
    with pytest.raises(ServiceConflict, match="someone-else"):
        plan_code(configmap(name, "someone-else", {"hello.py": HELLO}), desired_map, FUNCTION_ID)


def test_only_the_functions_own_older_configmaps_are_cleaned_up() -> None:
    listed = [
        configmap("smollm2-chat-code-new", FUNCTION_ID, uid="1", created="2026-11-23T10:00:02Z"),
        configmap("smollm2-chat-code-old", FUNCTION_ID, uid="2", created="2026-11-23T10:00:00Z"),
        configmap("smollm2-chat-code-prev", FUNCTION_ID, uid="5", created="2026-11-23T10:00:01Z"),
        configmap("smollm2-chat-code-theirs", "someone-else", uid="3"),  # its labels, not its owner
        configmap("smollm2-chat-code-nobody", None, uid="4"),
    ]
    # The newest older one stays: the previous revision may still start pods during a rollout.
    assert stale_code(listed, "smollm2-chat-code-new", FUNCTION_ID, previous=True) == [
        ("smollm2-chat-code-old", "2")
    ]
    # Back to the default handler: the last code's revision may still start pods, so it stays.
    assert sorted(stale_code(listed, None, FUNCTION_ID, previous=True)) == [
        ("smollm2-chat-code-old", "2"),
        ("smollm2-chat-code-prev", "5"),
    ]
    assert sorted(stale_code(listed, None, FUNCTION_ID, previous=False)) == [  # the function is deleted
        ("smollm2-chat-code-new", "1"),
        ("smollm2-chat-code-old", "2"),
        ("smollm2-chat-code-prev", "5"),
    ]
    assert code_selector("team-a/chat") == (
        "ember.dev/function=chat,ember.dev/namespace=team-a,app.kubernetes.io/managed-by=ember"
    )
