"""Where a function's rendered Knative Service, token Secret and handler ConfigMap go.

:class:`BaseServiceBackend` creates or updates, deletes and reads back the objects of a
function. Two implementations, picked by ``EMBER_KNATIVE_APPLY`` (:func:`make_backend`):

- ``api`` (default): :class:`scheduler.knative.kube.KubernetesBackend`, the Kubernetes API
  through the official client (in-cluster config or kubeconfig).
- ``dir:/path``: :class:`DirectoryBackend` writes the objects as YAML files under ``/path`` for
  a GitOps tool (Argo CD, Flux) to apply: ``<service>.service.yaml``, ``<service>.secret.yaml``
  and, for a custom handler, ``<service>.code.yaml`` (the current code's ConfigMap) and
  ``<service>.code-previous.yaml`` (the one it replaced; older ones leave the directory, and
  the tool's pruning removes them from the cluster). The Secret file holds the function's
  worker token (mode 0600): keep it out of version control, or encrypt it (SOPS, sealed-
  secrets) in the pipeline that commits the directory. There is no cluster to ask, so readiness
  is ``Unknown`` (``NoCluster``).

A custom handler's ConfigMap is applied first (pods of the new revision mount it), and the
function's ConfigMaps of older code are removed once the new Service is applied, except the
previous code's: while the new revision rolls out, Knative may still start pods of the previous
one, which mount it (pods already running keep the files they mounted). Both refuse to
overwrite or delete an object that another function (or nobody Ember knows) owns: the
``ember.dev/function-id`` annotation must name the function (:class:`ServiceConflict`). Calls
block (the Kubernetes client is synchronous): the gateway runs them in threads.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from scheduler import cluster_keys
from scheduler.knative.config import KnativeConfig
from scheduler.knative.errors import KnativeError, ServiceConflict
from scheduler.knative.handler_code import MAX_MODULE_BYTES
from scheduler.knative.naming import token_secret_name
from scheduler.knative.status import ServiceStatus
from scheduler.spec import SpecError, load_yaml

# A manifest file read back: ours are ~2 KiB, but a handler ConfigMap's holds up to
# MAX_MODULE_BYTES of source, which YAML may escape four bytes to one (control characters).
MAX_MANIFEST_BYTES = 8 * MAX_MODULE_BYTES


def owner_of(obj: Mapping[str, Any]) -> str | None:
    """The qualified id an object's ``ember.dev/function-id`` annotation names (None: none)."""
    metadata = obj.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    owner = annotations.get(cluster_keys.ANNOTATION_FUNCTION_ID) if isinstance(annotations, Mapping) else None
    return owner if isinstance(owner, str) else None


def check_owner(obj: Mapping[str, Any], function_id: str, what: str) -> None:
    """:class:`ServiceConflict` unless ``obj`` belongs to ``function_id``."""
    owner = owner_of(obj)
    if owner != function_id:
        whose = f"function {owner!r}" if owner is not None else "no Ember function"
        raise ServiceConflict(f"{what} exists and belongs to {whose}, not {function_id!r}: left untouched")


class BaseServiceBackend(ABC):
    """See the module docstring."""

    namespace: str

    @abstractmethod
    def apply(
        self,
        function_id: str,
        service: Mapping[str, Any],
        secret: Mapping[str, Any],
        config_map: Mapping[str, Any] | None = None,
    ) -> None:
        """Create the function's handler ConfigMap (if any), create or update its token Secret,
        then its Service (pods that start find both), then remove its older ConfigMaps."""

    @abstractmethod
    def delete(self, function_id: str, service: str) -> bool:
        """Delete the function's Service, then its Secret and ConfigMaps; whether anything was there."""

    @abstractmethod
    def status(self, service: str) -> ServiceStatus:
        """The readiness of one Service."""

    def statuses(self, services: Sequence[str]) -> dict[str, ServiceStatus]:
        """The readiness of several Services, by name."""
        return {s: self.status(s) for s in services}

    def close(self) -> None:  # noqa: B027  (optional: most backends hold nothing)
        """Release connections."""


class DirectoryBackend(BaseServiceBackend):
    """Objects as YAML files under a directory (``EMBER_KNATIVE_APPLY=dir:/path``)."""

    def __init__(self, directory: Path, namespace: str) -> None:
        self.directory = directory
        self.namespace = namespace

    def paths(self, service: str) -> tuple[Path, Path, Path, Path]:
        """(Service file, Secret file, handler ConfigMap file, the previous code's) of ``service``."""
        return (
            self.directory / f"{service}.service.yaml",
            self.directory / f"{service}.secret.yaml",
            self.directory / f"{service}.code.yaml",
            self.directory / f"{service}.code-previous.yaml",
        )

    def apply(
        self,
        function_id: str,
        service: Mapping[str, Any],
        secret: Mapping[str, Any],
        config_map: Mapping[str, Any] | None = None,
    ) -> None:
        name = str(service["metadata"]["name"])
        service_path, secret_path, code_path, previous_path = self.paths(name)
        current = None
        for path, what in (
            (service_path, f"Service {name}"),
            (secret_path, f"Secret {token_secret_name(name)}"),
            (code_path, f"the handler ConfigMap file of {name}"),
            (previous_path, f"the previous handler ConfigMap file of {name}"),
        ):
            existing = self._read(path)
            if existing is not None:
                check_owner(existing, function_id, what)
            if path == code_path:
                current = existing
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            replaced = current is not None and (
                config_map is None or current["metadata"]["name"] != config_map["metadata"]["name"]
            )
            if replaced:  # kept one version: the previous revision may still start pods
                os.replace(code_path, previous_path)
            if config_map is not None:
                _write(code_path, config_map, 0o644)
            _write(secret_path, secret, 0o600)
            _write(service_path, service, 0o644)
        except OSError as exc:
            raise KnativeError(
                f"cannot write the manifests of {name} under {self.directory}: {exc}"
            ) from None

    def delete(self, function_id: str, service: str) -> bool:
        found = False
        for path in self.paths(service):
            existing = self._read(path)
            if existing is None:
                continue
            check_owner(existing, function_id, str(path))
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                raise KnativeError(f"cannot remove {path}: {exc}") from None
            found = True
        return found

    def status(self, service: str) -> ServiceStatus:
        path = self.paths(service)[0]
        if not path.is_file():
            return ServiceStatus.not_found(service, self.namespace)
        message = f"written to {path}; only a cluster reports readiness (EMBER_KNATIVE_APPLY=api)"
        return ServiceStatus.unknown(service, self.namespace, "NoCluster", message, found=True)

    def _read(self, path: Path) -> dict[str, Any] | None:
        """A manifest file's object (None: no file); the directory may be edited by others."""
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise KnativeError(f"cannot read {path}: {exc}") from None
        if len(raw) > MAX_MANIFEST_BYTES:
            raise KnativeError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes: not an Ember manifest")
        try:
            document = load_yaml(raw.decode("utf-8", errors="replace"))
        except SpecError as exc:
            raise KnativeError(f"{path}: {exc}") from None
        return document if isinstance(document, dict) else {}


def _write(path: Path, obj: Mapping[str, Any], mode: int) -> None:
    """Write ``obj`` as YAML to ``path`` atomically (a reader sees the old or the new file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(dict(obj), f, sort_keys=False)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)  # O_CREAT's mode is masked by the umask; a re-used tmp keeps its old mode
    os.replace(tmp, path)


def make_backend(config: KnativeConfig) -> BaseServiceBackend:
    """The backend ``config.apply_dir`` asks for (see the module docstring)."""
    if config.apply_dir is not None:
        return DirectoryBackend(config.apply_dir, config.namespace)
    from scheduler.knative.kube import KubernetesBackend

    return KubernetesBackend.connect(config.namespace)
