"""The Knative backend's settings: a frozen dataclass read from ``EMBER_*`` variables, validated.

=================================== ============================== ===============================
variable                            field                          default
=================================== ============================== ===============================
``EMBER_IMAGE``                     ``image``                      ``ember:<version>``
``EMBER_KNATIVE_NAMESPACE``         ``namespace``                  ``ember-fn``
``EMBER_KNATIVE_GPU_RUNTIME_CLASS`` ``gpu_runtime_class``          ``nvidia`` (empty: none)
``EMBER_KNATIVE_TARGET_PERCENT``    ``target_percent``             ``70``
``EMBER_KNATIVE_MAX_TIMEOUT``       ``max_timeout_s``              ``600``
``EMBER_KNATIVE_TIMEOUT_SLACK``     ``timeout_slack``              ``2``
``EMBER_KNATIVE_URL``               ``url_template``               ``http://{service}.{namespace}.svc.cluster.local``
``EMBER_KNATIVE_APPLY``             ``apply_dir``                  ``api`` (``dir:/path``: files)
=================================== ============================== ===============================

``max_timeout_s`` must equal (or stay below) the cluster's ``max-revision-timeout-seconds``
in Knative's ``config-defaults`` (600 as shipped): Knative's webhook rejects a revision whose
``timeoutSeconds`` exceeds it. ``url_template`` is where the gateway sends a function's
invocations; ``{service}`` and ``{namespace}`` are the Knative Service's name and Kubernetes
namespace (a test points it at a local worker). ``EMBER_KNATIVE_APPLY=dir:/path`` writes the
objects as YAML files under ``/path`` instead of calling the Kubernetes API (GitOps: a tool
such as Argo CD or Flux applies them), see :class:`scheduler.knative.backend.DirectoryBackend`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_IMAGE = "ember:0.1.0"  # the project's version (pyproject.toml); deploy/knative builds it
DEFAULT_NAMESPACE = "ember-fn"
DEFAULT_URL_TEMPLATE = "http://{service}.{namespace}.svc.cluster.local"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_IMAGE = re.compile(r"^[^\s]{1,512}$")
_PLACEHOLDERS = re.compile(r"\{([^{}]*)\}")
MAX_TIMEOUT_LIMIT = 24 * 3600  # a sanity bound on EMBER_KNATIVE_MAX_TIMEOUT (seconds)


class KnativeConfigError(ValueError):
    """A Knative setting is malformed (the message names the variable)."""


@dataclass(frozen=True, slots=True)
class KnativeConfig:
    image: str = DEFAULT_IMAGE
    namespace: str = DEFAULT_NAMESPACE  # the Kubernetes namespace of every function's Service
    gpu_runtime_class: str | None = "nvidia"  # runtimeClassName of device: cuda pods (None: none)
    target_percent: int = 70  # autoscaling target as a percentage of containerConcurrency
    max_timeout_s: int = 600  # Knative's max-revision-timeout-seconds (config-defaults)
    timeout_slack: float = 2.0  # timeoutSeconds = slack x the SLO's time for maxTokens (capped)
    url_template: str = DEFAULT_URL_TEMPLATE
    apply_dir: Path | None = None  # None: the Kubernetes API; else YAML files under this directory
    scheduler_name: str = "ember-scheduler"  # the kube-scheduler profile that calls the extender

    def __post_init__(self) -> None:
        if not _IMAGE.match(self.image):
            raise KnativeConfigError(f"EMBER_IMAGE {self.image!r} must be 1-512 characters, no spaces")
        if len(self.namespace) > 63 or not _DNS_LABEL.match(self.namespace):
            raise KnativeConfigError(f"EMBER_KNATIVE_NAMESPACE {self.namespace!r} must be a DNS-1123 label")
        runtime_class = self.gpu_runtime_class
        if runtime_class is not None and (
            len(runtime_class) > 253 or not _DNS_SUBDOMAIN.match(runtime_class)
        ):
            raise KnativeConfigError(
                f"EMBER_KNATIVE_GPU_RUNTIME_CLASS {runtime_class!r} must be a DNS-1123 subdomain (or empty)"
            )
        if not 1 <= self.target_percent <= 100:
            raise KnativeConfigError("EMBER_KNATIVE_TARGET_PERCENT must be in 1..100")
        if not 1 <= self.max_timeout_s <= MAX_TIMEOUT_LIMIT:
            raise KnativeConfigError(f"EMBER_KNATIVE_MAX_TIMEOUT must be in 1..{MAX_TIMEOUT_LIMIT} seconds")
        if not 1.0 <= self.timeout_slack <= 100.0:
            raise KnativeConfigError("EMBER_KNATIVE_TIMEOUT_SLACK must be in 1..100")
        check_url_template(self.url_template)
        if self.apply_dir is not None and not self.apply_dir.is_absolute():
            raise KnativeConfigError(f"EMBER_KNATIVE_APPLY=dir:{self.apply_dir} needs an absolute path")
        if len(self.scheduler_name) > 253 or not _DNS_SUBDOMAIN.match(self.scheduler_name):
            raise KnativeConfigError(f"scheduler name {self.scheduler_name!r} must be a DNS-1123 subdomain")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KnativeConfig:
        """The settings in ``environ`` (default: the process's); :class:`KnativeConfigError`
        names the first malformed variable."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        if env.get("EMBER_IMAGE"):
            values["image"] = env["EMBER_IMAGE"]
        if env.get("EMBER_KNATIVE_NAMESPACE"):
            values["namespace"] = env["EMBER_KNATIVE_NAMESPACE"]
        if "EMBER_KNATIVE_GPU_RUNTIME_CLASS" in env:
            values["gpu_runtime_class"] = env["EMBER_KNATIVE_GPU_RUNTIME_CLASS"] or None
        if env.get("EMBER_KNATIVE_TARGET_PERCENT"):
            values["target_percent"] = _int(env, "EMBER_KNATIVE_TARGET_PERCENT")
        if env.get("EMBER_KNATIVE_MAX_TIMEOUT"):
            values["max_timeout_s"] = _int(env, "EMBER_KNATIVE_MAX_TIMEOUT")
        if env.get("EMBER_KNATIVE_TIMEOUT_SLACK"):
            raw = env["EMBER_KNATIVE_TIMEOUT_SLACK"]
            try:
                values["timeout_slack"] = float(raw)
            except ValueError:
                raise KnativeConfigError(f"EMBER_KNATIVE_TIMEOUT_SLACK={raw!r} is not a number") from None
        if env.get("EMBER_KNATIVE_URL"):
            values["url_template"] = env["EMBER_KNATIVE_URL"].rstrip("/")
        values["apply_dir"] = parse_apply(env.get("EMBER_KNATIVE_APPLY") or "api")
        return cls(**values)  # type: ignore[arg-type]

    def url(self, service: str) -> str:
        """The base URL the gateway sends ``service``'s invocations to."""
        return self.url_template.format(service=service, namespace=self.namespace)


def parse_apply(value: str) -> Path | None:
    """``EMBER_KNATIVE_APPLY``: ``api`` (the Kubernetes API: None) or ``dir:/absolute/path``."""
    if value == "api":
        return None
    if value.startswith("dir:") and len(value) > len("dir:"):
        return Path(value[len("dir:") :])
    raise KnativeConfigError(f"EMBER_KNATIVE_APPLY={value!r} must be 'api' or 'dir:/absolute/path'")


def check_url_template(template: str) -> None:
    """A template whose only placeholders are ``{service}`` and ``{namespace}`` and that gives an
    http(s) URL with a host and no path, query or fragment (the gateway appends the path)."""
    if len(template) > 1024:
        raise KnativeConfigError("EMBER_KNATIVE_URL must be at most 1024 characters")
    unknown = {p for p in _PLACEHOLDERS.findall(template) if p not in ("service", "namespace")}
    if unknown:
        raise KnativeConfigError(
            f"EMBER_KNATIVE_URL may use only {{service}} and {{namespace}}, not {sorted(unknown)}"
        )
    try:
        parts = urlsplit(template.format(service="svc", namespace="ns"))
        _ = parts.port  # ValueError for a malformed port
    except (ValueError, IndexError) as exc:  # a bad port, stray braces
        raise KnativeConfigError(f"EMBER_KNATIVE_URL {template!r} is not a URL template: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise KnativeConfigError(f"EMBER_KNATIVE_URL {template!r} must be http(s)://HOST[:PORT], no path")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise KnativeConfigError(f"EMBER_KNATIVE_URL {template!r} must carry no query, fragment or user")


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise KnativeConfigError(f"{name}={env[name]!r} is not an integer") from None
