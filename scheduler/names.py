"""Qualified function ids: a function's namespace and name as one string.

Functions live in namespaces (DNS-1123 labels, ``default`` unless the spec names one). The
cluster state keys a function by its *qualified id* everywhere (the Redis function hash,
the instance sets, the instance records' ``function`` field, the logs directory
``functions/<id>``, the metrics ``function`` label): ``NAMESPACE/NAME``, except in the
``default`` namespace, whose ids are the plain name. So a single-user cluster keeps the
layout (and the Redis data) it had before namespaces existed, and an id without ``/`` is
always in ``default``. Names and namespaces are DNS labels (no ``/``, ``:``, ``.`` or
``..``), so an id is safe in Redis keys (``fn:team-a/chat:instances``), as two path
components, and as a Prometheus label value.
"""

from __future__ import annotations

import re
from typing import Any

DEFAULT_NAMESPACE = "default"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_LABEL = 63  # characters of a DNS-1123 label


def is_label(value: str) -> bool:
    """Whether ``value`` is a DNS-1123 label (a valid function name or namespace)."""
    return len(value) <= MAX_LABEL and _DNS_LABEL.match(value) is not None


def qualified(namespace: str, name: str) -> str:
    """The id of function ``name`` in ``namespace`` (the plain name in ``default``)."""
    return name if namespace == DEFAULT_NAMESPACE else f"{namespace}/{name}"


def split(function_id: str) -> tuple[str, str]:
    """(namespace, name) of a qualified id."""
    namespace, _, name = function_id.rpartition("/")
    return (namespace or DEFAULT_NAMESPACE), name


def of_document(spec_document: dict[str, Any]) -> str:
    """The qualified id of a function spec document (``metadata.name``, ``metadata.namespace``)."""
    metadata = spec_document["metadata"]
    return qualified(str(metadata.get("namespace", DEFAULT_NAMESPACE)), str(metadata["name"]))
