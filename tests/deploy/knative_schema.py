"""The Knative Serving CRDs' ``openAPIV3Schema`` as strict JSON Schema, and the feature flags
that gate pod-spec fields, both read from the copied reference data in ``knative_reference/``.

Strict means what the API server does with ``kubectl apply --validate=strict``: an object whose
schema does not say ``x-kubernetes-preserve-unknown-fields`` keeps only the fields it lists, so
any other field is an error (``additionalProperties: false``). The feature-gated pod-spec fields
are exactly those whose schema description says "accessible behind a feature flag - FLAG"; the
ones Knative preserves whole (hostPath, tolerations, ...) pass the schema unchecked, which is
why ``knative_rules`` checks them against the Kubernetes PodSpec and the shipped flags.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator

REFERENCE = Path(__file__).resolve().with_name("knative_reference")
GROUP = "serving.knative.dev"
KINDS = ("Service", "Configuration", "Revision", "Route")
ITEM = "[]"  # a path step meaning "each element of the list"
_GATE = re.compile(r"behind a feature flag - ([a-z0-9.-]+)")


@dataclass(frozen=True)
class FeatureGate:
    """A pod-spec field (path relative to the RevisionSpec) that only ``flag`` admits."""

    path: tuple[str, ...]
    flag: str

    def __post_init__(self) -> None:
        if not self.path or not self.flag:
            raise ValueError("a feature gate needs a path and a flag")


@dataclass(frozen=True)
class Reference:
    """The parsed reference data: one validator per Knative kind, the gates, the defaults."""

    validators: Mapping[str, Draft202012Validator]  # by kind
    gates: tuple[FeatureGate, ...]
    features: Mapping[str, str]  # config-features defaults
    defaults: Mapping[str, str]  # config-defaults defaults


def strict(schema: Any) -> Any:
    """A copy of an OpenAPI v3 (structural) schema that rejects fields it does not list."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if out.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if (
        out.get("type") == "object"
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _walk_gates(schema: Mapping[str, Any], path: tuple[str, ...]) -> Iterator[FeatureGate]:
    match = _GATE.search(str(schema.get("description", "")))
    if match and path:
        yield FeatureGate(path, match.group(1))
        return  # the outermost gated field is what a manifest must not carry without the flag
    for name, sub in schema.get("properties", {}).items():
        yield from _walk_gates(sub, (*path, name))
    if isinstance(schema.get("items"), dict):
        yield from _walk_gates(schema["items"], (*path, ITEM))


def _crd_schema(kind: str) -> dict[str, Any]:
    crd = yaml.safe_load((REFERENCE / "crds" / f"{kind.lower()}.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def _example(name: str) -> dict[str, str]:
    """A Knative config map's defaults: its ``_example`` block is YAML with the default values."""
    config_map = yaml.safe_load((REFERENCE / "config-maps" / f"{name}.yaml").read_text())
    values = yaml.safe_load(config_map["data"]["_example"]) or {}
    return {str(k): str(v) for k, v in values.items()}


@functools.cache  # immutable files, ~1 s to parse: read once per test process
def reference() -> Reference:
    schemas = {kind: _crd_schema(kind) for kind in KINDS}
    validators = {}
    for kind, schema in schemas.items():
        checked = strict(schema)
        # The API server validates ObjectMeta itself (knative_rules checks it as ObjectMeta).
        checked["properties"]["metadata"] = {"type": "object"}
        Draft202012Validator.check_schema(checked)
        validators[kind] = Draft202012Validator(checked)
    revision_spec = schemas["Revision"]["properties"]["spec"]
    return Reference(
        validators=validators,
        gates=tuple(_walk_gates(revision_spec, ())),
        features=_example("features"),
        defaults=_example("defaults"),
    )


def schema_problems(doc: Mapping[str, Any]) -> list[str]:
    """Where ``doc`` breaks its kind's strict CRD schema, as ``path: message`` lines."""
    validator = reference().validators.get(str(doc.get("kind")))
    if validator is None:
        return [f"kind {doc.get('kind')!r} is not one of the Knative Serving kinds {', '.join(KINDS)}"]
    errors = sorted(validator.iter_errors(doc), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{dotted(e.absolute_path) or '(root)'}: {e.message}" for e in errors]


def dotted(path: Any) -> str:
    """A jsonschema path as `a.b[0].c`."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
