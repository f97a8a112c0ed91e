"""The Kubernetes API backend: Knative Services, token Secrets and handler ConfigMaps
(:mod:`scheduler.knative.kube_code`) through the official client.

NOT RUN AGAINST A CLUSTER. There is no kube-apiserver where Ember is developed and tested:
what the tests cover is the pure part, :func:`plan` (the request each apply sends: create,
or replace with the live object's ``resourceVersion`` and Knative's own metadata kept, or a
refusal when another function owns the name) and :func:`api_error` (how API failures map to
Ember's errors). The calls themselves (:class:`KubernetesBackend`) are a thin layer over
``kubernetes.client`` whose shapes follow the client's documented signatures; the first real
cluster to run them is their first test.

Apply is get, then create (404) or replace (carrying ``metadata.resourceVersion``, so a
concurrent writer makes it fail with 409, and it is retried from a fresh get). A replace keeps
the live object's labels and annotations that Ember does not own (Knative's webhook rejects an
update that drops ``serving.knative.dev/creator``; ``kubectl`` and other tools add theirs) and
drops ``ember.dev/*`` keys the new rendering no longer has. The ``spec`` is Ember's, replaced
whole. Delete is get (ownership), then delete with the object's ``uid`` as a precondition.
Credentials: in-cluster (the pod's service account, see deploy/knative's RBAC) when
``KUBERNETES_SERVICE_HOST`` is set, else the kubeconfig (``KUBECONFIG`` or ``~/.kube/config``).
The ``kubernetes`` package is imported only here, and only when a backend is built.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from scheduler.knative.backend import BaseServiceBackend, check_owner
from scheduler.knative.errors import KnativeError, KnativeUnavailable, ServiceConflict
from scheduler.knative.kube_code import CodeMaps
from scheduler.knative.naming import token_secret_name
from scheduler.knative.render import MANAGED_BY
from scheduler.knative.status import MAX_TEXT, ServiceStatus

GROUP, VERSION, PLURAL = "serving.knative.dev", "v1", "services"
OWNED_PREFIX = "ember.dev/"  # label and annotation keys Ember owns on the objects it applies
REQUEST_TIMEOUT = (5.0, 20.0)  # (connect, read) seconds of one API call
CONFLICT_RETRIES = 3  # re-gets after a 409 (another writer got in between)
LIST_PAGE = 500  # Services per list call (status of many functions)
MAX_PAGES = 20


@dataclass(frozen=True, slots=True)
class Plan:
    """The request an apply sends for one object."""

    verb: Literal["create", "replace"]
    body: dict[str, Any]


def plan(existing: Mapping[str, Any] | None, desired: Mapping[str, Any], function_id: str, what: str) -> Plan:
    """Create ``desired``, or replace ``existing`` with it (see the module docstring);
    :class:`ServiceConflict` if ``existing`` belongs to another function or to none."""
    if existing is None:
        return Plan("create", dict(desired))
    check_owner(existing, function_id, what)
    live = existing.get("metadata") or {}
    metadata = dict(desired["metadata"])
    for key in ("labels", "annotations"):
        kept = {k: v for k, v in (live.get(key) or {}).items() if not k.startswith(OWNED_PREFIX)}
        metadata[key] = {**kept, **(desired["metadata"].get(key) or {})}
    metadata["resourceVersion"] = live.get("resourceVersion")
    if metadata["resourceVersion"] is None:
        raise KnativeError(f"{what}: the API returned it without a resourceVersion")
    return Plan("replace", {**desired, "metadata": metadata})


def api_error(exc: BaseException, doing: str) -> KnativeError:
    """The Ember error for a failed API call (``exc``: the client's ``ApiException``, or a
    connection error from urllib3 or the socket layer)."""
    status = getattr(exc, "status", None)
    if not isinstance(status, int) or status == 0:
        return KnativeUnavailable(f"{doing}: the Kubernetes API cannot be reached: {str(exc)[:MAX_TEXT]}")
    message = str(getattr(exc, "reason", "") or "")
    body = getattr(exc, "body", None)
    try:
        decoded = json.loads(body) if isinstance(body, str | bytes) else None
        if isinstance(decoded, dict) and isinstance(decoded.get("message"), str):
            message = decoded["message"]  # the API server's (or Knative's webhook's) own words
    except ValueError:
        pass
    message = message[:MAX_TEXT]
    if status in (401, 403):
        return KnativeError(
            f"{doing}: the Kubernetes API refused the gateway's credentials ({status}): {message}"
        )
    if status == 409:
        return ServiceConflict(f"{doing}: {message}")
    if status in (429, 500, 502, 503, 504):
        return KnativeUnavailable(f"{doing}: the Kubernetes API answered {status}: {message}")
    return KnativeError(f"{doing}: the Kubernetes API answered {status}: {message}")


class KubernetesBackend(BaseServiceBackend):
    """Services and Secrets in ``namespace`` through ``api_client`` (a ``kubernetes.client.ApiClient``)."""

    def __init__(self, api_client: Any, namespace: str) -> None:
        from kubernetes import client

        self.namespace = namespace
        self._client = api_client
        self._custom = client.CustomObjectsApi(api_client)
        self._core = client.CoreV1Api(api_client)
        as_dict = api_client.sanitize_for_serialization
        self._code = CodeMaps(self._core, namespace, as_dict, _only, self._translate, REQUEST_TIMEOUT)

    @classmethod
    def connect(cls, namespace: str) -> KubernetesBackend:
        """A backend with in-cluster credentials, or the kubeconfig's (see the module docstring)."""
        from kubernetes import client, config

        configuration = client.Configuration()
        try:
            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            else:
                # KUBECONFIG read now: the client reads it once, when first imported.
                config.load_kube_config(  # type: ignore[no-untyped-call]
                    config_file=os.environ.get("KUBECONFIG") or None,
                    client_configuration=configuration,
                    persist_config=False,
                )
        except (config.ConfigException, OSError, ValueError) as exc:
            raise KnativeUnavailable(f"no Kubernetes credentials (in-cluster or kubeconfig): {exc}") from None
        return cls(client.ApiClient(configuration), namespace)

    def close(self) -> None:
        self._client.close()

    # ----- the API calls ---------------------------------------------------------------------

    def _service_ops(self) -> _Ops:
        c, ns, t, only = self._custom, self.namespace, REQUEST_TIMEOUT, _only
        return _Ops(
            get=lambda name: c.get_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, name, _request_timeout=t
            ),
            create=lambda body: c.create_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, body, _request_timeout=t
            ),
            replace=lambda name, body: c.replace_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, name, body, _request_timeout=t
            ),
            delete=lambda name, uid: c.delete_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, name, body=only(uid), _request_timeout=t
            ),
        )

    def _secret_ops(self) -> _Ops:
        c, ns, t, only = self._core, self.namespace, REQUEST_TIMEOUT, _only
        as_dict = self._client.sanitize_for_serialization  # V1Secret -> its JSON mapping
        # The client sends a mapping body as it is (sanitize_for_serialization passes dicts
        # through); its annotations ask for a V1Secret, which would need a camelCase round trip.
        return _Ops(
            get=lambda name: as_dict(c.read_namespaced_secret(name, ns, _request_timeout=t)),
            create=lambda body: c.create_namespaced_secret(ns, cast(Any, body), _request_timeout=t),
            replace=lambda name, body: c.replace_namespaced_secret(
                name, ns, cast(Any, body), _request_timeout=t
            ),
            delete=lambda name, uid: c.delete_namespaced_secret(name, ns, body=only(uid), _request_timeout=t),
        )

    def apply(
        self,
        function_id: str,
        service: Mapping[str, Any],
        secret: Mapping[str, Any],
        config_map: Mapping[str, Any] | None = None,
    ) -> None:
        name = str(service["metadata"]["name"])
        if config_map is not None:
            self._code.apply(function_id, config_map)
        self._apply_one(self._secret_ops(), secret, function_id, f"Secret {token_secret_name(name)}")
        self._apply_one(self._service_ops(), service, function_id, f"Service {name}")
        current = None if config_map is None else str(config_map["metadata"]["name"])
        # Only once the Service no longer names them (its previous revision still may).
        self._code.prune(function_id, keep=current, previous=True)

    def _apply_one(self, ops: _Ops, desired: Mapping[str, Any], function_id: str, what: str) -> None:
        name = str(desired["metadata"]["name"])
        for attempt in range(CONFLICT_RETRIES + 1):
            existing = self._get(ops, name, what)
            step = plan(existing, desired, function_id, what)
            try:
                if step.verb == "create":
                    ops.create(step.body)
                else:
                    ops.replace(name, step.body)
                return
            except Exception as exc:
                error = self._translate(exc, f"{step.verb} {what}")
                if not (isinstance(error, ServiceConflict) and attempt < CONFLICT_RETRIES):
                    raise error from None  # a 409 past the retries, or any other failure

    def delete(self, function_id: str, service: str) -> bool:
        found = False
        for ops, name, what in (
            (self._service_ops(), service, f"Service {service}"),
            (self._secret_ops(), token_secret_name(service), f"Secret {token_secret_name(service)}"),
        ):
            existing = self._get(ops, name, what)
            if existing is None:
                continue
            check_owner(existing, function_id, what)
            uid = (existing.get("metadata") or {}).get("uid")
            try:
                ops.delete(name, uid)
                found = True
            except Exception as exc:
                error = self._translate(exc, f"delete {what}")
                if getattr(exc, "status", None) != 404:  # gone meanwhile: what was asked
                    raise error from None
        return self._code.prune(function_id, keep=None, previous=False) or found

    def status(self, service: str) -> ServiceStatus:
        existing = self._get(self._service_ops(), service, f"Service {service}")
        if existing is None:
            return ServiceStatus.not_found(service, self.namespace)
        return ServiceStatus.from_object(existing)

    def statuses(self, services: Sequence[str]) -> dict[str, ServiceStatus]:
        """One list call per page of Ember's Services (label ``app.kubernetes.io/managed-by``);
        one get for a single Service (``describe``)."""
        if len(services) == 1:
            return {services[0]: self.status(services[0])}
        found: dict[str, Mapping[str, Any]] = {}
        token: str | None = None
        for _ in range(MAX_PAGES):
            kwargs: dict[str, Any] = {"label_selector": "=".join(MANAGED_BY), "limit": LIST_PAGE}
            if token:
                kwargs["_continue"] = token
            try:
                page: Any = self._custom.list_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, _request_timeout=REQUEST_TIMEOUT, **kwargs
                )
            except Exception as exc:
                raise self._translate(exc, "list Services") from None
            if not isinstance(page, Mapping):
                raise KnativeError(f"list Services: the API returned a {type(page).__name__}, not a list")
            for item in page.get("items") or []:
                found[str((item.get("metadata") or {}).get("name"))] = item
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                break
        return {
            s: ServiceStatus.from_object(found[s])
            if s in found
            else ServiceStatus.not_found(s, self.namespace)
            for s in services
        }

    def _get(self, ops: _Ops, name: str, what: str) -> dict[str, Any] | None:
        try:
            obj = ops.get(name)
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                return None
            raise self._translate(exc, f"get {what}") from None
        return dict(obj) if isinstance(obj, Mapping) else None

    @staticmethod
    def _translate(exc: Exception, doing: str) -> KnativeError:
        """:func:`api_error` for the client's errors; anything else is a bug and re-raised."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        if isinstance(exc, ApiException | HTTPError | OSError):
            return api_error(exc, doing)
        raise exc


def _only(uid: str | None) -> Any:
    """Delete options that delete the object with ``uid`` only (not a successor of its name)."""
    from kubernetes import client

    return client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid))


@dataclass(frozen=True, slots=True)
class _Ops:
    """The four calls of one kind of object (get, create, replace, delete)."""

    get: Callable[[str], Any]
    create: Callable[[dict[str, Any]], Any]
    replace: Callable[[str, dict[str, Any]], Any]
    delete: Callable[[str, Any], Any]
