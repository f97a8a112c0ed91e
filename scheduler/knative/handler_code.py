"""A custom handler's module as a ConfigMap that the function's pods mount read-only.

The gateway keeps an uploaded handler module in a content-addressed directory,
``EMBER_HOME/functions/NAMESPACE/NAME/<digest>/module.py`` (:mod:`gateway.function_code`),
which no worker pod can see. In cluster mode the module travels the Kubernetes way:

- one ConfigMap per function and code digest, ``<service>-code-<digest>`` (at most 87
  characters: a DNS subdomain), ``immutable: true``, its one key the module's file name,
  labelled as the function's Service and token Secret and owned through the same
  ``ember.dev/function-id`` annotation;
- mounted read-only into the worker container at ``EMBER_HOME/functions/NAMESPACE/NAME/<digest>``
  of the pod (``EMBER_HOME`` is :data:`scheduler.cluster_keys.NODE_HOME` there), the directory
  layout the gateway uses, so the worker's handler loader (which refuses modules outside the
  functions root) and its function sandbox (which leaves only ``functions/NAMESPACE/NAME``
  readable) accept it;
- the worker finds it through ``EMBER_FUNCTION_HANDLER`` (``NAMESPACE/NAME/<digest>/module.py:
  function``, relative to the functions root): the revision's own code, even when the record
  in Redis already names a newer deploy's.

New code is a new digest, so a new ConfigMap and a new revision; a ConfigMap never changes
while a pod may mount it. The digest is :func:`code_digest`, the gateway's directory name.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from scheduler import cluster_keys, names
from scheduler.spec import SpecError

MAX_MODULE_BYTES = 256 << 10  # one handler module's UTF-8 source (a ConfigMap holds at most 1 MiB)
MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,99}\.py$")
MAX_FUNCTION_NAME = 100
DIGEST_CHARS = 24  # hex characters of the SHA-256 that name a version of the code
HANDLER_ENV = "EMBER_FUNCTION_HANDLER"  # the revision's handler, relative to the functions root
VOLUME = "ember-handler"
FILE_MODE = 0o444  # read-only for whichever user the image runs as
_DIGEST = re.compile(rf"^[0-9a-f]{{{DIGEST_CHARS}}}$")


def code_digest(module_name: str, encoded: bytes) -> str:
    """The content address of a handler module: its name and its UTF-8 source."""
    return hashlib.sha256(module_name.encode() + b"\0" + encoded).hexdigest()[:DIGEST_CHARS]


def split_ref(handler: str) -> tuple[str, str]:
    """``(module file name, function)`` of a ``[path/]module.py:function`` reference;
    :class:`SpecError` for anything else."""
    module_text, _, function = handler.rpartition(":")
    module = module_text.rpartition("/")[2]
    if not MODULE_NAME.match(module) or not function.isidentifier() or len(function) > MAX_FUNCTION_NAME:
        raise SpecError(f"spec.handler: {handler[:200]!r} is not module.py:function")
    return module, function


@dataclass(frozen=True, slots=True)
class HandlerCode:
    """A custom handler: its module's file name, its function and its source."""

    module: str
    function: str
    source: str

    def __post_init__(self) -> None:
        if split_ref(f"{self.module}:{self.function}")[0] != self.module:
            raise SpecError(f"spec.handler: {self.module[:200]!r} is not a plain module file name")
        if len(self.source.encode("utf-8", errors="surrogatepass")) > MAX_MODULE_BYTES:
            raise SpecError(f"files: {self.module} is larger than {MAX_MODULE_BYTES} bytes")

    @classmethod
    def stand_in(cls, handler: str) -> HandlerCode:
        """The handler's names without source: for checking a spec before its module is stored
        (the module itself is checked where it is stored)."""
        return cls(*split_ref(handler), "")

    @property
    def digest(self) -> str:
        return code_digest(self.module, self.source.encode("utf-8", errors="surrogatepass"))

    def matches(self, handler: str) -> bool:
        """Whether ``handler`` names this module and function (and, when it is a stored path,
        this version of the code: ``.../<digest>/module.py``)."""
        module_text, _, function = handler.rpartition(":")
        parts = module_text.split("/")
        if (parts[-1], function) != (self.module, self.function):
            return False
        stored = len(parts) >= 2 and _DIGEST.match(parts[-2]) is not None
        return not stored or not self.source or parts[-2] == self.digest  # a stand-in has no digest

    def relative_dir(self, function_id: str) -> str:
        """``NAMESPACE/NAME/<digest>``: where the code lies under a functions root."""
        namespace, name = names.split(function_id)
        return f"{namespace}/{name}/{self.digest}"

    def pod_handler(self, function_id: str) -> str:
        """``EMBER_FUNCTION_HANDLER``'s value: the module in the mounted directory."""
        return f"{self.relative_dir(function_id)}/{self.module}:{self.function}"

    def mount_path(self, function_id: str) -> str:
        """The directory the ConfigMap is mounted on in the worker container."""
        return f"{cluster_keys.NODE_HOME}/functions/{self.relative_dir(function_id)}"


def config_map_name(service: str, code: HandlerCode) -> str:
    """The ConfigMap of ``service``'s handler code at ``code``'s digest."""
    return f"{service}-code-{code.digest}"


def render_config_map(
    code: HandlerCode, service: str, namespace: str, labels: dict[str, str], annotations: dict[str, str]
) -> dict[str, Any]:
    """The immutable ConfigMap holding the module (key: its file name)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": config_map_name(service, code),
            "namespace": namespace,
            "labels": dict(labels),
            "annotations": dict(annotations),
        },
        "immutable": True,
        "data": {code.module: code.source},
    }


def volume(config_map: str) -> dict[str, Any]:
    """The pod volume of the ConfigMap (files read-only)."""
    return {"name": VOLUME, "configMap": {"name": config_map, "defaultMode": FILE_MODE}}


def volume_mount(code: HandlerCode, function_id: str) -> dict[str, Any]:
    return {"name": VOLUME, "mountPath": code.mount_path(function_id), "readOnly": True}
