"""Tenants: API keys scoped to a namespace, and who a request acts as.

The gateway's own key (``EMBER_API_KEY``) is the *admin* key: every namespace, the
cluster-wide routes (devices, unfiltered ``/metrics``) and tenant management. An admin
creates *tenant keys*, each scoped to one namespace: a tenant deploys, lists, describes,
invokes, deletes and reads logs and metrics of its own namespace's functions only, and
another namespace's function is indistinguishable from a missing one (404). A gateway
without a key serves everyone as the admin (loopback, single user), as before tenants.

Keys are stored in Redis by their SHA-256 only (``{p}tenant_keys``: hash ``sha256 hex ->
{"v": 1, "namespace", "created"}``), never the key itself: reading Redis (a backup, an AOF)
gives no usable key. A request's key is hashed and looked up (a hash-table lookup does not
compare the secret byte by byte; the admin key is compared with ``hmac.compare_digest``).
Lookups are cached for ``cache_ttl_s`` (the invocation path must not wait on Redis per
request), so a revoked key stops working at once on the gateway that revoked it and within
``cache_ttl_s`` on the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request

from gateway.proxy import BadRequest
from scheduler import names
from scheduler.errors import FunctionNotFound, SchedulerError, StateConflict, StoredNotDurable
from scheduler.spec import FunctionSpec
from scheduler.state import ClusterState

ENCODING_VERSION = 1
RECORD = "tenant_keys"  # the hash {p}tenant_keys
KEY_PREFIX = "ember_"  # tenant keys look like ember_<43 url-safe characters> (256 random bits)
MAX_KEYS_PER_NAMESPACE = 16  # enough to rotate; bounds what one namespace can make an admin store
MAX_KEYS = 10_000
_CACHE_ENTRIES = 4096


class Forbidden(SchedulerError):
    """The caller's key does not allow this (HTTP 403): a tenant on an admin route, or deploying
    into / listing another namespace."""

    code = "permission_denied"


class InvalidNamespace(BadRequest):
    """A namespace that is not a DNS-1123 label (HTTP 400)."""


class TenantsDisabled(BadRequest):
    """Tenant keys on a gateway without an admin key (HTTP 400): every request is the admin there."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request acts as: the admin (``namespace`` None) or the tenant of one namespace."""

    namespace: str | None

    @property
    def admin(self) -> bool:
        return self.namespace is None

    def require_admin(self) -> None:
        if self.namespace is not None:
            raise Forbidden("this route needs the admin key")

    def scope(self, requested: str | None) -> str:
        """The namespace a collection route (list, models, cluster) acts in: a tenant's own, or
        the admin's ``requested`` one (``default`` when none); a tenant asking another: 403."""
        if requested is not None and not names.is_label(requested):
            raise InvalidNamespace(f"namespace {requested!r} is not a DNS-1123 label")
        if self.namespace is None:
            return requested or names.DEFAULT_NAMESPACE
        if requested is not None and requested != self.namespace:
            raise Forbidden("a tenant key lists only its own namespace")
        return self.namespace

    def function(self, name: str, requested: str | None = None) -> str:
        """The qualified id of function ``name`` (in namespace ``requested``, the admin's choice);
        a tenant naming another namespace gets the same 404 as for a missing function."""
        if requested is not None and not names.is_label(requested):
            raise InvalidNamespace(f"namespace {requested!r} is not a DNS-1123 label")
        namespace = requested or self.namespace or names.DEFAULT_NAMESPACE
        function_id = names.qualified(namespace, name)
        if self.namespace is not None and namespace != self.namespace:
            raise FunctionNotFound(f"function {function_id!r} is not deployed")
        return function_id

    def model(self, model: str) -> str:
        """The qualified id an OpenAI ``model`` names: ``NAME`` in the caller's namespace (the
        admin's: ``default``) or ``NAMESPACE/NAME``."""
        namespace, _, name = model.rpartition("/")
        if namespace and not names.is_label(namespace):  # names no function: the usual 404
            raise FunctionNotFound(f"function {model!r} is not deployed")
        return self.function(name, namespace or None)

    def place(self, spec: FunctionSpec) -> FunctionSpec:
        """``spec`` in the namespace it deploys into: a tenant's own when it names none; a tenant
        naming another: 403. The admin deploys where the spec says (``default`` if nowhere)."""
        if self.namespace is None:
            return spec
        if "namespace" not in spec.metadata.model_fields_set:
            metadata = spec.metadata.model_copy(update={"namespace": self.namespace})
            return spec.model_copy(update={"metadata": metadata})
        if spec.metadata.namespace != self.namespace:
            raise Forbidden(
                f"metadata.namespace: a key of namespace {self.namespace!r} cannot deploy into "
                f"{spec.metadata.namespace!r}"
            )
        return spec

    def sees(self, function_id: str) -> bool:
        """Whether the caller may see function ``function_id`` (in cluster-wide listings)."""
        return self.namespace is None or names.split(function_id)[0] == self.namespace

    def shown(self, function_id: str) -> str:
        """How the caller sees ``function_id``: the plain name within a tenant's namespace."""
        return function_id if self.namespace is None else names.split(function_id)[1]


ADMIN = Principal(None)


def digest(key: str) -> str:
    """The stored form of a key (SHA-256, hex)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


class TenantKeys:
    """Tenant keys in the cluster state (see module docstring)."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.key = f"{state.p}{RECORD}"

    def _all(self) -> dict[str, dict[str, Any]]:
        raw: dict[str, str] = self.state._call(lambda: self.state.r.hgetall(self.key))
        return {h: _decode(v) for h, v in raw.items()}

    def create(self, namespace: str) -> tuple[str, str]:
        """A new key for ``namespace``: (key, key id). The key is returned only here."""
        if not names.is_label(namespace):
            raise InvalidNamespace(f"namespace {namespace!r} is not a DNS-1123 label")
        records = self._all()
        if len(records) >= MAX_KEYS:
            raise StateConflict(f"there are already {MAX_KEYS} tenant keys; revoke some first")
        if sum(r["namespace"] == namespace for r in records.values()) >= MAX_KEYS_PER_NAMESPACE:
            raise StateConflict(
                f"namespace {namespace!r} has {MAX_KEYS_PER_NAMESPACE} keys already; revoke one first"
            )
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        hashed = digest(key)
        value = json.dumps({"v": ENCODING_VERSION, "namespace": namespace, "created": time.time()})
        try:
            self.state.put_record_field(RECORD, hashed, value)  # durable before the key is handed out
        except StoredNotDurable:
            # Stored, never handed out: take it back (best effort) so that it does not count
            # against the namespace's keys; the client repeats the request for a new one.
            with contextlib.suppress(SchedulerError):
                self.state.delete_record_fields(RECORD, [hashed])
            raise
        return key, key_id(hashed)

    def namespace_of(self, hashed: str) -> str | None:
        """The namespace of the key whose SHA-256 is ``hashed``, or None (no such key)."""
        raw: str | None = self.state._call(lambda: self.state.r.hget(self.key, hashed))
        return None if raw is None else str(_decode(raw)["namespace"])

    def list(self) -> dict[str, list[dict[str, Any]]]:
        """namespace -> its keys' ids and creation times (never the keys)."""
        out: dict[str, list[dict[str, Any]]] = {}
        for hashed, record in sorted(self._all().items(), key=lambda kv: kv[1]["created"]):
            out.setdefault(record["namespace"], []).append(
                {"id": key_id(hashed), "created": record["created"]}
            )
        return dict(sorted(out.items()))

    def revoke(self, namespace: str, kid: str | None = None) -> int:
        """Delete the keys of ``namespace`` (only the one with id ``kid`` when given); how many."""
        doomed = [
            h
            for h, r in self._all().items()
            if r["namespace"] == namespace and (kid is None or key_id(h) == kid)
        ]
        self.state.delete_record_fields(RECORD, doomed)  # durable: a revoked key stays revoked
        return len(doomed)


def key_id(hashed: str) -> str:
    """A key's public id: the first 12 hex digits of its SHA-256 (names it, reveals nothing)."""
    return hashed[:12]


def _decode(raw: str) -> dict[str, Any]:
    data = json.loads(raw)
    if not isinstance(data, dict) or data.get("v") != ENCODING_VERSION:
        raise StateConflict("tenant key record has an unsupported encoding version")
    return data


class Authenticator:
    """Maps a request's ``Authorization`` header to its :class:`Principal`."""

    def __init__(self, admin_key: str | None, keys: TenantKeys, cache_ttl_s: float = 1.0) -> None:
        self.admin_key = admin_key.encode() if admin_key is not None else None
        self.keys = keys
        self.cache_ttl_s = cache_ttl_s
        self._cache: dict[str, tuple[float, str]] = {}  # key sha256 -> (looked up at, namespace)

    @property
    def enabled(self) -> bool:
        """Whether keys are checked at all (the gateway has an admin key)."""
        return self.admin_key is not None

    async def principal(self, authorization: str) -> Principal | None:
        """The caller, or None when the header carries no valid key."""
        if self.admin_key is None:
            return ADMIN
        token = authorization[7:] if authorization[:7].lower() == "bearer " else ""
        if hmac.compare_digest(token.encode("utf-8", "surrogatepass"), self.admin_key):
            return ADMIN
        if not token.startswith(KEY_PREFIX) or len(token) > 256:
            return None
        hashed = digest(token)
        now = time.monotonic()
        hit = self._cache.get(hashed)
        if hit is not None and now - hit[0] < self.cache_ttl_s:
            return Principal(hit[1])
        namespace = await asyncio.to_thread(self.keys.namespace_of, hashed)
        if namespace is None:
            self._cache.pop(hashed, None)
            return None
        if len(self._cache) >= _CACHE_ENTRIES:
            self._cache.clear()
        self._cache[hashed] = (now, namespace)
        return Principal(namespace)

    def forget(self) -> None:
        """Drop cached lookups (after a revocation on this gateway)."""
        self._cache.clear()


_MAX_BODY = 4096  # bytes of a POST /v1/tenants body ({"namespace": LABEL})


async def _new_namespace(request: Request) -> str:
    """The ``namespace`` of a ``POST /v1/tenants`` body (read here: FastAPI's own body parsing
    would answer malformed JSON with its ``detail`` error instead of Ember's)."""
    body = await request.body()
    try:
        document = json.loads(body) if len(body) <= _MAX_BODY else None
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, an integer over 4300 digits
        document = None
    if not isinstance(document, dict) or set(document) != {"namespace"}:
        raise BadRequest(f'the body must be {{"namespace": NAME}} as JSON (at most {_MAX_BODY} bytes)')
    namespace = document["namespace"]
    if not isinstance(namespace, str) or not names.is_label(namespace):
        raise InvalidNamespace(f"namespace {namespace!r} is not a DNS-1123 label")
    return namespace


def tenant_routes(auth: Authenticator, caller: Callable[..., Awaitable[Principal]]) -> APIRouter:
    """``/v1/tenants``: create a key (shown once), list keys, revoke keys; admin only."""
    router = APIRouter()
    keys = auth.keys
    dep = Depends(caller)

    def admin(who: Principal) -> None:
        who.require_admin()
        if not auth.enabled:
            raise TenantsDisabled("tenant keys need an admin key on the gateway (EMBER_API_KEY)")

    @router.post("/v1/tenants", status_code=201)
    async def create(request: Request, who: Principal = dep) -> dict[str, str]:
        admin(who)
        namespace = await _new_namespace(request)
        key, kid = await asyncio.to_thread(keys.create, namespace)  # (see TenantKeys.create)
        return {"namespace": namespace, "key": key, "id": kid}

    @router.get("/v1/tenants")
    async def listing(who: Principal = dep) -> dict[str, Any]:
        admin(who)
        tenants = await asyncio.to_thread(keys.list)
        return {"tenants": [{"namespace": ns, "keys": k} for ns, k in tenants.items()]}

    async def revoke(who: Principal, namespace: str, kid: str | None) -> dict[str, Any]:
        """Idempotent: revoking what is not there revokes nothing (``revoked: 0``)."""
        admin(who)
        try:
            revoked = await asyncio.to_thread(keys.revoke, namespace, kid)
        finally:  # revoked in Redis even when not confirmed on disk (a 503): forgotten here at once
            auth.forget()
        return {"namespace": namespace, "revoked": revoked}

    @router.delete("/v1/tenants/{namespace}")
    async def revoke_all(namespace: str, who: Principal = dep) -> dict[str, Any]:
        return await revoke(who, namespace, None)

    @router.delete("/v1/tenants/{namespace}/keys/{kid}")
    async def revoke_one(namespace: str, kid: str, who: Principal = dep) -> dict[str, Any]:
        return await revoke(who, namespace, kid)

    return router
