"""deploy/knative: every shipped document is valid (knative_rules.validate), and the pieces fit
together: names, labels, ports, paths, Secrets and RBAC that one manifest expects of another.

No cluster here: ``kubectl kustomize`` (offline) builds the kustomization where kubectl is
installed; everything else reads the files."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from gpu_pool.config import parse_size
from scheduler import cluster_keys
from tests.deploy.knative_rules import validate
from tests.deploy.shipped import KNATIVE, Doc, kustomization, one, shipped

SCHEDULER_NAME = "ember-scheduler"


def pod_spec(kind: str, name: str) -> Doc:
    spec: Doc = one(kind, name)["spec"]["template"]["spec"]
    return spec


def env(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def scheduler_config() -> tuple[Doc, Doc, str]:
    """The KubeSchedulerConfiguration, its generated ConfigMap's entry, and the file it is in."""
    (generator,) = kustomization()["configMapGenerator"]
    (entry,) = generator["files"]
    key, _, path = entry.partition("=")
    config: Doc = yaml.safe_load((KNATIVE / path).read_text())
    return config, {"name": generator["name"], "namespace": generator["namespace"], "key": key}, path


def quantity(text: str) -> int:
    """A Kubernetes memory quantity (binary suffixes: what the manifests use) in bytes."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", text)
    assert match, text
    return int(match.group(1)) << {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, None: 0}[match.group(2)]


def test_every_file_is_listed_and_every_listed_file_exists() -> None:
    listed = set(kustomization()["resources"]) | {scheduler_config()[2], "kustomization.yaml"}
    assert {p.name for p in KNATIVE.glob("*.yaml")} == listed
    assert all((KNATIVE / f).is_file() for f in listed)


@pytest.mark.parametrize("doc", shipped(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_shipped_document_is_valid(doc: Doc) -> None:
    assert validate(doc) == []


def test_the_namespaces() -> None:
    names = {d["metadata"]["name"] for d in shipped() if d["kind"] == "Namespace"}
    assert names == {"ember", "ember-fn"}
    namespaced = {d["metadata"].get("namespace") for d in shipped() if d["kind"] != "Namespace"}
    assert namespaced == {"ember", "ember-fn", "knative-serving", "kube-system", None}


def test_redis_has_a_password_persistence_and_a_network_policy() -> None:
    redis = one("StatefulSet", "ember-redis")
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    spec = redis["spec"]["template"]["spec"]
    (server,) = spec["containers"]
    assert {"name": "data", "mountPath": "/data"} in server["volumeMounts"]
    assert "--appendonly" in server["args"]
    (auth,) = [v for v in spec["volumes"] if "secret" in v]
    assert auth["secret"]["secretName"] == "ember-redis"
    (mount,) = [m for m in server["volumeMounts"] if m["name"] == auth["name"]]
    assert server["args"][0] == f"{mount['mountPath']}/redis.conf"  # requirepass from the Secret
    # redis-server runs as the image's redis user from the start (no root entrypoint dropping to
    # it), so it must read the root-owned Secret file through its group: fsGroup and mode g+r.
    security = spec["securityContext"]
    assert security["runAsUser"] != 0 and security["runAsNonRoot"] is True
    assert security["fsGroup"] == security["runAsGroup"] and auth["secret"]["defaultMode"] & 0o040
    assert one("Service", redis["spec"]["serviceName"])["spec"]["clusterIP"] == "None"
    # clients reach it under the name the Secret's URL holds (scripts/knative-secrets)
    service = one("Service", "ember-redis")
    assert service["spec"]["selector"] == redis["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["ports"][0]["port"] == 6379

    policy = one("NetworkPolicy", "ember-redis")["spec"]
    assert policy["podSelector"]["matchLabels"] == redis["spec"]["template"]["metadata"]["labels"]
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    same_namespace, functions = rule["from"]
    allowed = {"gateway": one("Deployment", "ember-gateway"), "pool": one("DaemonSet", "ember-pool")}
    (components,) = same_namespace["podSelector"]["matchExpressions"]
    assert components["operator"] == "In" and set(components["values"]) == set(allowed)
    for workload in allowed.values():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert same_namespace["podSelector"]["matchLabels"].items() <= labels.items()
        assert labels[components["key"]] in components["values"]
    assert functions["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ember-fn"}}
    assert functions["podSelector"]["matchExpressions"] == [
        {"key": cluster_keys.LABEL_FUNCTION, "operator": "Exists"}
    ]
    # nobody else: no other pod template carries the gateway's or the pool's component label
    others = [d for d in shipped() if "template" in d.get("spec", {}) and d not in allowed.values()]
    assert all(d["spec"]["template"]["metadata"]["labels"][components["key"]] not in allowed for d in others)


def test_the_gateway_runs_ember_gateway_with_its_secrets_and_rights_in_ember_fn_only() -> None:
    spec = pod_spec("Deployment", "ember-gateway")
    (gateway,) = spec["containers"]
    assert gateway["args"] == ["gateway"]
    variables = env(gateway)
    refs = {k: v["valueFrom"]["secretKeyRef"] for k, v in variables.items() if "valueFrom" in v}
    assert refs == {
        "EMBER_API_KEY": {"name": "ember-api-key", "key": "key"},
        "EMBER_CLUSTER_SECRET": {"name": "ember-cluster", "key": "secret"},
        "EMBER_REDIS_URL": {"name": "ember-redis", "key": "url"},
    }
    assert variables["EMBER_KNATIVE_NAMESPACE"]["value"] == "ember-fn"
    assert variables["EMBER_IMAGE"]["value"] == gateway["image"]
    port = gateway["ports"][0]
    assert variables["EMBER_PORT"]["value"] == str(port["containerPort"])
    service = one("Service", "ember-gateway")
    assert (
        service["spec"]["selector"] == one("Deployment", "ember-gateway")["spec"]["selector"]["matchLabels"]
    )
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]

    assert spec["serviceAccountName"] == "ember-gateway"
    (binding,) = [
        d
        for d in shipped()
        if d["kind"] in {"RoleBinding", "ClusterRoleBinding"}
        and {"kind": "ServiceAccount", "name": "ember-gateway", "namespace": "ember"} in d["subjects"]
    ]
    assert binding["kind"] == "RoleBinding" and binding["metadata"]["namespace"] == "ember-fn"
    role = one(binding["roleRef"]["kind"], binding["roleRef"]["name"])
    assert role["metadata"]["namespace"] == "ember-fn"
    assert {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]} == {
        ("serving.knative.dev", "services"),
        ("", "secrets"),
        ("", "configmaps"),  # custom handlers' code (issue 11)
    }
    (code_rule,) = [rule for rule in role["rules"] if "configmaps" in rule["resources"]]
    assert set(code_rule["verbs"]) == {"get", "list", "create", "delete"}  # immutable: never updated


def test_one_cpu_pool_per_node_on_the_host_socket_directory() -> None:
    pool = one("DaemonSet", "ember-pool")
    spec = pool["spec"]["template"]["spec"]
    (daemon,) = spec["containers"]
    assert daemon["args"] == ["node"]
    variables = env(daemon)
    assert variables[cluster_keys.NODE_NAME_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert variables[cluster_keys.POOL_DIR_ENV]["value"] == cluster_keys.DEFAULT_POOL_DIR
    (volume,) = [
        v for v in spec["volumes"] if v.get("hostPath", {}).get("path") == cluster_keys.DEFAULT_POOL_DIR
    ]
    (store,) = [v for v in spec["volumes"] if v.get("hostPath", {}).get("path") == cluster_keys.NODE_HOME]
    assert variables["EMBER_HOME"]["value"] == cluster_keys.NODE_HOME  # the node's model store
    (store_mount,) = [m for m in daemon["volumeMounts"] if m["name"] == store["name"]]
    assert store_mount["mountPath"] == cluster_keys.NODE_HOME and not store_mount.get("readOnly")
    (mount,) = [m for m in daemon["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["mountPath"] == cluster_keys.DEFAULT_POOL_DIR and not mount.get("readOnly")
    socket = f"{cluster_keys.DEFAULT_POOL_DIR}/{cluster_keys.CPU_SOCKET}"
    assert socket in " ".join(daemon["readinessProbe"]["exec"]["command"])
    arena = parse_size(variables["EMBER_POOL_ARENA"]["value"])
    assert quantity(daemon["resources"]["requests"]["memory"]) >= arena  # the arena's pages are its
    assert quantity(daemon["resources"]["limits"]["memory"]) >= quantity(
        daemon["resources"]["requests"]["memory"]
    )
    assert variables["EMBER_REDIS_URL"]["valueFrom"] == {
        "secretKeyRef": {"name": "ember-redis", "key": "url"}
    }
    # the socket directory belongs to the user the pool (and function pods) run as
    (init,) = spec["initContainers"]
    uid = daemon["securityContext"]["runAsUser"]
    assert init["command"] == ["chown", f"{uid}:{uid}", cluster_keys.DEFAULT_POOL_DIR, cluster_keys.NODE_HOME]
    assert f"--uid {uid}" in (KNATIVE / "Dockerfile").read_text()
    assert "nvidia.com/gpu" not in str(pool)  # GPU pools are the GPU issue's


def test_ember_scheduler_calls_the_gateways_extender() -> None:
    config, config_map, _ = scheduler_config()
    allowed = {
        "apiVersion", "kind", "leaderElection", "clientConnection", "parallelism", "percentageOfNodesToScore",
        "podInitialBackoffSeconds", "podMaxBackoffSeconds", "profiles", "extenders", "delayCacheUntilActive",
        "enableProfiling", "enableContentionProfiling",
    }  # fmt: skip
    assert set(config) <= allowed
    assert (config["apiVersion"], config["kind"]) == (
        "kubescheduler.config.k8s.io/v1",
        "KubeSchedulerConfiguration",
    )
    assert config["profiles"] == [{"schedulerName": SCHEDULER_NAME}]
    assert config["percentageOfNodesToScore"] == 100
    (extender,) = config["extenders"]
    assert set(extender) <= {
        "urlPrefix", "filterVerb", "preemptVerb", "prioritizeVerb", "weight", "bindVerb", "enableHTTPS",
        "tlsConfig", "httpTimeout", "nodeCacheCapable", "managedResources", "ignorable",
    }  # fmt: skip
    assert extender["nodeCacheCapable"] is True and extender["ignorable"] is True
    assert extender["weight"] >= 10
    url = urlsplit(extender["urlPrefix"])
    service = one("Service", "ember-gateway")
    assert url.hostname in {
        f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc",
        f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local",
    }
    assert (url.port or 80) == service["spec"]["ports"][0]["port"]
    assert f"{url.path}/{extender['filterVerb']}" == "/extender/filter"
    assert f"{url.path}/{extender['prioritizeVerb']}" == "/extender/prioritize"

    deployment = one("Deployment", "ember-scheduler")
    assert deployment["spec"]["replicas"] == 2
    spec = deployment["spec"]["template"]["spec"]
    (scheduler,) = spec["containers"]
    assert scheduler["image"].startswith("registry.k8s.io/kube-scheduler:v1.")
    (volume,) = spec["volumes"]
    assert volume["configMap"]["name"] == config_map["name"]
    (mount,) = scheduler["volumeMounts"]
    assert f"--config={mount['mountPath']}/{config_map['key']}" in scheduler["command"]

    election = config["leaderElection"]
    assert election["leaderElect"] is True
    account = {"kind": "ServiceAccount", "name": spec["serviceAccountName"], "namespace": "ember"}
    bindings = [d for d in shipped() if d["kind"].endswith("RoleBinding") and account in d["subjects"]]
    roles = {b["roleRef"]["name"] for b in bindings}
    assert {
        "system:kube-scheduler",
        "system:volume-scheduler",
        "extension-apiserver-authentication-reader",
    } <= roles
    (lease_binding,) = [
        b for b in bindings if b["roleRef"]["kind"] == "Role" and b["metadata"]["namespace"] == "ember"
    ]
    lease_role = one("Role", lease_binding["roleRef"]["name"])
    assert lease_role["metadata"]["namespace"] == election["resourceNamespace"]
    assert any(election["resourceName"] in r.get("resourceNames", []) for r in lease_role["rules"])


def test_config_features_enables_exactly_what_function_pods_use() -> None:
    features = one("ConfigMap", "config-features")
    assert features["metadata"]["namespace"] == "knative-serving"
    assert features["data"] == {
        "kubernetes.podspec-volumes-hostpath": "enabled",
        "kubernetes.podspec-schedulername": "enabled",
    }


@pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (for `kubectl kustomize`) is not installed"
)
def test_kustomize_builds_it_and_a_registry_image_reaches_the_function_pods(tmp_path: Path) -> None:
    # What `kustomize edit set image ember=registry.example/ember:v1` in deploy/knative does.
    copy = tmp_path / "knative"
    shutil.copytree(KNATIVE, copy)
    edited = kustomization()
    edited["images"] = [{"name": "ember", "newName": "registry.example/ember", "newTag": "v1"}]
    (copy / "kustomization.yaml").write_text(yaml.safe_dump(edited))
    for root, image in ((KNATIVE, "ember:latest"), (copy, "registry.example/ember:v1")):
        out = subprocess.run(
            ["kubectl", "kustomize", str(root)], capture_output=True, text=True, timeout=120, check=False
        )
        assert out.returncode == 0, out.stderr
        built = [d for d in yaml.safe_load_all(out.stdout) if d]
        assert [p for d in built for p in validate(d)] == []
        assert len(built) == len(shipped()) + 1  # + the scheduler's generated ConfigMap
        by_name = {(d["kind"], d["metadata"]["name"]): d for d in built}
        (config_map,) = [
            d for (k, n), d in by_name.items() if k == "ConfigMap" and n.startswith("ember-scheduler")
        ]
        scheduler = by_name["Deployment", SCHEDULER_NAME]["spec"]["template"]["spec"]
        assert scheduler["volumes"][0]["configMap"]["name"] == config_map["metadata"]["name"]
        gateway = by_name["Deployment", "ember-gateway"]["spec"]["template"]["spec"]["containers"][0]
        pool = by_name["DaemonSet", "ember-pool"]["spec"]["template"]["spec"]
        assert gateway["image"] == env(gateway)["EMBER_IMAGE"]["value"] == image
        assert {c["image"] for c in pool["containers"] + pool["initContainers"]} == {image}
