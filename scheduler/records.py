"""The cluster state's records as typed values: decoded once where they are read from Redis.

Each record has an explicit, versioned encoding (``{"v": 1, ...}``, JSON in Redis): ``decode``
checks the version and the types of the fields the scheduler uses, and parses them once
(``keepAlive`` into seconds, the scaling bounds into ints), so routing never re-parses a
spec. What users are shown (``describe``, ``/v1/cluster``) is the document as stored, kept
alongside the parsed fields, so the HTTP API's JSON is unchanged.

- :class:`FunctionRecord`: a deployed function: its spec document, its registered model.
- :class:`ModelRef`: a registered model (id, directory in the model store, weight bytes).
- :class:`Instance`: one instance's hash (state, device, URL, in-flight count, ...).
- :class:`DeviceReport`: a device's pool report, as the node agent publishes it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from scheduler import names
from scheduler.errors import StateConflict
from scheduler.spec import MAX_ADAPTERS, ScalingSpec

ENCODING_VERSION = 1
DEFAULT_MAX_TOKENS = 2048  # scheduler.spec.FunctionBody.max_tokens's default


class RecordError(StateConflict):
    """A stored record has an unsupported version or malformed fields."""


def _document(raw: str | Mapping[str, Any]) -> dict[str, Any]:
    try:
        data = json.loads(raw) if isinstance(raw, str) else dict(raw)
    except ValueError:  # not JSON (a record written by something else): malformed, not a bug
        raise RecordError("state record is not a JSON document") from None
    if not isinstance(data, dict) or data.get("v") != ENCODING_VERSION:
        version = data.get("v") if isinstance(data, dict) else "?"
        raise RecordError(f"state record has unsupported encoding version {version}")
    return data


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str | float):
        raise RecordError(f"{what} must be an integer")
    try:
        return int(value)
    except (ValueError, OverflowError):  # OverflowError: JSON's Infinity / 1e999
        raise RecordError(f"{what} must be an integer") from None


def _float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | str | float):
        raise RecordError(f"{what} must be a number")
    try:
        number = float(value)
    except ValueError:
        raise RecordError(f"{what} must be a number") from None
    if math.isnan(number):
        raise RecordError(f"{what} must be a number")
    return number


@dataclass(frozen=True, slots=True)
class ModelRef:
    """A model registered in the node's model store."""

    model_id: str
    dir: str  # its directory in the model store (the agent's launch and preload take it)
    weight_bytes: int
    # The function's LoRA adapters, registered: (name, directory) pairs (spec.model.adapters).
    adapters: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.model_id or not self.dir or self.weight_bytes < 0:
            raise RecordError("a model reference needs an id, a directory and weight_bytes >= 0")
        if len(self.adapters) > MAX_ADAPTERS:
            raise RecordError(f"a model reference has at most {MAX_ADAPTERS} adapters")

    def encode(self) -> dict[str, Any]:
        """The reference as stored and shown (``/v1/cluster``) and as the launcher takes it."""
        out: dict[str, Any] = {"id": self.model_id, "dir": self.dir, "weight_bytes": self.weight_bytes}
        if self.adapters:
            out["adapters"] = dict(self.adapters)
        return out

    @classmethod
    def decode(cls, data: Any) -> ModelRef:
        """A reference from its encoding (what the agent's ``register`` returns)."""
        if not isinstance(data, Mapping) or not isinstance(data.get("id"), str):
            raise RecordError("a model reference must be a mapping with id, dir and weight_bytes")
        if not isinstance(data.get("dir"), str):
            raise RecordError("a model reference's dir must be a string")
        adapters = data.get("adapters") or {}
        if not isinstance(adapters, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in adapters.items()
        ):
            raise RecordError("a model reference's adapters must map names to directories")
        return cls(
            data["id"], data["dir"], _int(data.get("weight_bytes"), "weight_bytes"), tuple(adapters.items())
        )


@dataclass(frozen=True, slots=True)
class Scaling:
    """A function's scaling, parsed once from ``spec.scaling`` (defaults filled in)."""

    min_scale: int
    max_scale: int
    concurrency: int
    keep_alive_s: float

    @classmethod
    def parse(cls, document: Any) -> Scaling:
        """Scaling from a ``spec.scaling`` mapping (absent: every default)."""
        try:
            s = ScalingSpec.model_validate(document if document is not None else {})
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            raise RecordError(f"stored spec.scaling is malformed: {exc}") from None
        return cls(s.min_scale, s.max_scale, s.concurrency, s.keep_alive)


@dataclass(frozen=True, slots=True)
class FunctionRecord:
    """A deployed function. ``spec`` is the document as stored (never mutate it: ``describe``
    returns it); the rest is parsed from it once."""

    function_id: str  # the qualified id (scheduler.names)
    spec: dict[str, Any]
    model: ModelRef | None  # None until the model is registered
    updated: float
    scaling: Scaling
    max_tokens: int
    handler: str  # spec.handler: "default" or the stored module's "path:function"
    model_source: str  # spec.model.source and spec.model.dtype, as deployed
    model_dtype: str

    @property
    def namespace(self) -> str:
        return names.split(self.function_id)[0]

    @property
    def name(self) -> str:
        return names.split(self.function_id)[1]

    @classmethod
    def create(
        cls,
        function_id: str,
        spec: dict[str, Any],
        model: ModelRef | None = None,
        updated: float | None = None,
    ) -> FunctionRecord:
        """A record of ``spec`` (a validated spec document, see :mod:`scheduler.spec`)."""
        body = spec.get("spec")
        body = body if isinstance(body, Mapping) else {}
        max_tokens = _int(body.get("maxTokens", DEFAULT_MAX_TOKENS), "spec.maxTokens")
        source = body.get("model")
        source = source if isinstance(source, Mapping) else {}
        return cls(
            function_id,
            spec,
            model,
            time.time() if updated is None else updated,
            Scaling.parse(body.get("scaling")),
            max_tokens,
            str(body.get("handler", "default")),
            str(source.get("source", "")),
            str(source.get("dtype", "bfloat16")),
        )

    def encode(self) -> dict[str, Any]:
        """The versioned document stored in Redis."""
        model = self.model.encode() if self.model is not None else None
        return {"v": ENCODING_VERSION, "spec": self.spec, "model": model, "updated": self.updated}

    def to_json(self) -> str:
        return json.dumps(self.encode())

    @classmethod
    def decode(cls, function_id: str, raw: str | Mapping[str, Any]) -> FunctionRecord:
        """A record from its stored encoding; :class:`RecordError` if it is not one."""
        data = _document(raw)
        spec = data.get("spec")
        if not isinstance(spec, dict):
            raise RecordError(f"function {function_id!r}: stored spec is not a mapping")
        model = ModelRef.decode(data["model"]) if data.get("model") is not None else None
        return cls.create(function_id, spec, model, _float(data.get("updated", 0.0), "updated"))


# The instance hash's fields that Instance has attributes for; the rest are the start's details.
# "token" is the worker's credential: routing returns it, it is never shown (not in details).
INSTANCE_FIELDS = frozenset(
    {"v", "function", "state", "device", "url", "token", "in_flight", "deadline", "created"}
)


@dataclass(frozen=True, slots=True)
class Instance:
    """One instance of a function (its Redis hash)."""

    instance_id: str
    function: str
    state: str
    device: str
    url: str
    in_flight: int
    deadline: float
    created: float
    details: dict[str, str]  # what the start measured: pid, bytes_loaded, bytes_reused, start_ms, log

    @classmethod
    def decode(cls, instance_id: str, h: Mapping[str, str]) -> Instance:
        """An instance from its hash (written by the state's Lua scripts and transitions)."""
        if h.get("v", "1") != str(ENCODING_VERSION):
            raise RecordError(f"instance {instance_id} has unsupported encoding version {h.get('v')}")
        try:
            return cls(
                instance_id, h["function"], h["state"], h["device"], h["url"],
                int(h["in_flight"]), float(h["deadline"]), float(h["created"]),
                {k: v for k, v in h.items() if k not in INSTANCE_FIELDS},
            )  # fmt: skip
        except (KeyError, ValueError) as exc:
            raise RecordError(f"instance {instance_id} has a malformed record: {exc!r}") from None


@dataclass(frozen=True, slots=True)
class DeviceReport:
    """A device's pool report. ``document`` is the report as published (``/v1/cluster`` and
    ``/metrics`` show it; the agent may add fields), the placement inputs are parsed from it."""

    device_id: str
    document: dict[str, Any] = field(repr=False)
    free_bytes: int
    evictable_bytes: int
    resident_bytes: dict[str, int]  # model id -> bytes of its tensors resident in the pool
    load_bandwidth: float  # bytes/s the pool measured loading from disk (0: not measured yet)
    capacity_bytes: int = 0  # the pool's arena (0: not reported)
    kv_bytes: int = 0  # KV blocks its sessions hold (neither free nor evictable until they end)

    @staticmethod
    def encode(report: Mapping[str, Any], updated: float | None = None) -> dict[str, Any]:
        """The versioned document stored for a report the agent published."""
        return {"v": ENCODING_VERSION, **report, "updated": time.time() if updated is None else updated}

    @classmethod
    def decode(cls, device_id: str, raw: str | Mapping[str, Any]) -> DeviceReport:
        """A report from its stored encoding; :class:`RecordError` if it is not one."""
        data = _document(raw)
        models = data.get("models")
        resident = (
            {str(m): int(b) for m, b in models.items() if isinstance(b, int) and not isinstance(b, bool)}
            if isinstance(models, Mapping)
            else {}
        )  # entries in another shape (a newer agent's) are not placement inputs
        return cls(
            device_id,
            data,
            _int(data.get("free_bytes", 0), "free_bytes"),
            _int(data.get("evictable_bytes", 0), "evictable_bytes"),
            resident,
            _float(data.get("load_bandwidth") or 0.0, "load_bandwidth"),
            _int(data.get("capacity_bytes", 0), "capacity_bytes"),
            _int(data.get("kv_bytes", 0), "kv_bytes"),
        )
