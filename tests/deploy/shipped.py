"""The documents deploy/knative ships, as kustomization.yaml lists them (read, not built)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

KNATIVE = Path(__file__).resolve().parents[2] / "deploy" / "knative"
Doc = dict[str, Any]


def kustomization() -> Doc:
    doc: Doc = yaml.safe_load((KNATIVE / "kustomization.yaml").read_text())
    return doc


def shipped() -> list[Doc]:
    """Every document of every resource file, in the kustomization's order."""
    files = kustomization()["resources"]
    return [d for f in files for d in yaml.safe_load_all((KNATIVE / f).read_text()) if d]


def one(kind: str, name: str) -> Doc:
    (doc,) = [d for d in shipped() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc
