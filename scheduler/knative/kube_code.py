"""Handler ConfigMaps through the Kubernetes API (:mod:`scheduler.knative.handler_code`).

NOT RUN AGAINST A CLUSTER (see :mod:`scheduler.knative.kube`): the tests cover the pure part,
:func:`plan_code` (create, keep, or refuse) and :func:`stale_code` (which of a function's
listed ConfigMaps go), on real-shaped API objects. :class:`CodeMaps` is the thin layer of calls.

A handler ConfigMap is immutable and named by its code's digest, so it is never replaced:
applying creates it when missing and keeps it when it is there with the same data (a redeploy
of the same code). One with the same name but other data, or owned by another function, is a
:class:`ServiceConflict`. Cleaning up lists the function's ConfigMaps by its labels and deletes
those it owns (``ember.dev/function-id``), with the object's ``uid`` as a precondition; one
that carries its labels but belongs to another function is left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from scheduler import cluster_keys, names
from scheduler.knative.backend import check_owner, owner_of
from scheduler.knative.errors import KnativeError, ServiceConflict
from scheduler.knative.render import MANAGED_BY

LIST_LIMIT = 100  # ConfigMaps of one function listed (one per code version not yet cleaned up)

Translate = Callable[[Exception, str], KnativeError]


def code_selector(function_id: str) -> str:
    """The label selector of ``function_id``'s objects (its handler ConfigMaps among them)."""
    namespace, name = names.split(function_id)
    labels = {cluster_keys.LABEL_FUNCTION: name, cluster_keys.LABEL_NAMESPACE: namespace}
    labels[MANAGED_BY[0]] = MANAGED_BY[1]
    return ",".join(f"{k}={v}" for k, v in labels.items())


def plan_code(existing: Mapping[str, Any] | None, desired: Mapping[str, Any], function_id: str) -> bool:
    """Whether to create ``desired`` (False: it is there already, as rendered);
    :class:`ServiceConflict` when the name holds another function's or other code."""
    if existing is None:
        return True
    what = f"ConfigMap {desired['metadata']['name']}"
    check_owner(existing, function_id, what)
    if existing.get("data") != desired.get("data"):
        raise ServiceConflict(f"{what} exists with other contents (it is immutable): left untouched")
    return False


def stale_code(
    items: Sequence[Mapping[str, Any]], keep: str | None, function_id: str, previous: bool
) -> list[tuple[str, str]]:
    """``(name, uid)`` of the listed ConfigMaps to delete: ``function_id``'s own but ``keep``
    and, with ``previous`` (an apply, not a delete), the newest other one (by
    ``creationTimestamp``): the previous revision may still start pods while the new one rolls
    out, and they mount their code; so too when the new revision has the default handler."""
    owned = []
    for item in items:
        metadata = item.get("metadata") or {}
        name, uid = metadata.get("name"), metadata.get("uid")
        if name != keep and isinstance(name, str) and isinstance(uid, str) and owner_of(item) == function_id:
            owned.append((str(metadata.get("creationTimestamp") or ""), name, uid))
    owned.sort(reverse=True)  # RFC 3339 UTC timestamps sort as text; newest first
    return [(name, uid) for _, name, uid in owned[1 if previous else 0 :]]


class CodeMaps:
    """The ConfigMap calls of :class:`scheduler.knative.kube.KubernetesBackend` (``core``: a
    ``CoreV1Api``; ``as_dict``: the client's serializer; ``only``: uid delete options)."""

    def __init__(
        self,
        core: Any,
        namespace: str,
        as_dict: Callable[[Any], Any],
        only: Callable[[str], Any],
        translate: Translate,
        timeout: tuple[float, float],
    ) -> None:
        self._core = core
        self._namespace = namespace
        self._as_dict = as_dict
        self._only = only
        self._translate = translate
        self._timeout = timeout

    def apply(self, function_id: str, config_map: Mapping[str, Any]) -> None:
        name = str(config_map["metadata"]["name"])
        if not plan_code(self._get(name), config_map, function_id):
            return
        try:
            body = dict(config_map)
            self._core.create_namespaced_config_map(self._namespace, body, _request_timeout=self._timeout)
        except Exception as exc:
            if getattr(exc, "status", None) != 409:
                raise self._translate(exc, f"create ConfigMap {name}") from None
            # Created meanwhile (a concurrent deploy of the same code): fine if it is the same.
            if plan_code(self._get(name), config_map, function_id):
                raise self._translate(exc, f"create ConfigMap {name}") from None

    def _get(self, name: str) -> dict[str, Any] | None:
        try:
            obj = self._core.read_namespaced_config_map(name, self._namespace, _request_timeout=self._timeout)
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                return None
            raise self._translate(exc, f"get ConfigMap {name}") from None
        found = self._as_dict(obj)
        return dict(found) if isinstance(found, Mapping) else None

    def prune(self, function_id: str, keep: str | None, previous: bool) -> bool:
        """Delete ``function_id``'s handler ConfigMaps but ``keep`` (and, with ``previous``, the
        newest other one: see :func:`stale_code`); whether any was deleted."""
        try:
            selector = code_selector(function_id)
            page = self._core.list_namespaced_config_map(
                self._namespace, label_selector=selector, limit=LIST_LIMIT, _request_timeout=self._timeout
            )
            listed = self._as_dict(page)
        except Exception as exc:
            raise self._translate(exc, f"list the ConfigMaps of {function_id}") from None
        items = (listed.get("items") or []) if isinstance(listed, Mapping) else []
        deleted = False
        for name, uid in stale_code(items, keep, function_id, previous):
            try:
                self._core.delete_namespaced_config_map(
                    name, self._namespace, body=self._only(uid), _request_timeout=self._timeout
                )
                deleted = True
            except Exception as exc:
                if getattr(exc, "status", None) != 404:  # gone meanwhile: what was asked
                    raise self._translate(exc, f"delete ConfigMap {name}") from None
        return deleted
