"""The function spec (DESIGN.md "Function spec (YAML)"): parsing, validation, defaults.

Unknown fields, bad units, bad names and malformed sources are rejected with a message
naming the field; defaults are filled in so ``ember describe`` can show them. Durations
accept ``ms``, ``s``, ``m`` and ``h`` (``250ms``, ``10s``, ``1.5m``) and are kept in seconds.
"""

from __future__ import annotations

import decimal
import math
import re
import sys
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*$")
_UNIT_SECONDS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_SOURCE = re.compile(r"^(gguf:|safetensors:|pkg:[A-Za-z_][\w.]*/.+|/).+")
MAX_DURATION_S = 7 * 24 * 3600.0
_HANDLER = re.compile(r"^(default|[\w./-]+\.py:[A-Za-z_]\w*)$")
# Upper bounds: a spec is input from outside, and the scheduler sizes work by these.
MAX_SCALE = 256  # instances of one function (minScale, maxScale)
MAX_CONCURRENCY = 1024  # requests in flight per instance
MAX_TOKENS = 131072  # tokens per request (maxTokens)
MAX_TEXT = 4096  # characters in a model source or handler reference
MAX_YAML_DEPTH = 32  # nesting of a spec document (a valid spec needs 4)
MAX_ADAPTERS = 16  # LoRA adapters of one function (model.adapters)
_ADAPTER_SOURCE = re.compile(r"^(safetensors:|pkg:[A-Za-z_][\w.]*/|/).+")
MAX_YAML_NODES = 10_000  # scalars, lists and mappings, aliases expanded (a spec has < 100)


class SpecError(ValueError):
    """A function spec is invalid; the message names the field."""

    code = "invalid_function_spec"


def parse_duration(value: Any) -> float:
    """Seconds in a duration (``250ms``, ``10s``, ``1.5m``, ``1h`` or a number of seconds)."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 10s or 250ms")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if m is None:
            raise ValueError(f"{value!r} is not a duration (examples: 250ms, 10s, 1.5m, 1h)")
        seconds = float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError("a duration must be a finite, non-negative number of seconds")
    if seconds > MAX_DURATION_S:
        raise ValueError(f"a duration must be at most {MAX_DURATION_S:g} s (one week)")
    return seconds


def _format_duration(seconds: float) -> str:
    if seconds < 1 and seconds * 1000 == int(seconds * 1000):
        return f"{int(seconds * 1000)}ms"
    # The shortest digits that read back as the same float, positional: "{:g}" wrote 1e-07s
    # (which parse_duration, and so the stored document's next reader, refuses) and kept
    # only six significant digits.
    text = format(decimal.Decimal(repr(seconds)), "f")
    return (text.rstrip("0").rstrip(".") if "." in text else text) + "s"


Duration = Annotated[
    float, BeforeValidator(parse_duration), PlainSerializer(_format_duration, return_type=str)
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


def _check_name(name: str, field: str) -> str:
    if len(name) > 63 or not _DNS_LABEL.match(name):
        raise ValueError(
            f"{field} {name!r} must be a DNS-1123 label: lowercase letters, digits and "
            f"'-', starting and ending with a letter or digit, at most 63 characters"
        )
    return name


class AdapterSpec(_Strict):
    """A LoRA adapter of the function's model (a PEFT directory), selected per request as
    ``<function>:<name>`` in the request's ``model`` field."""

    name: str
    source: str

    @field_validator("name")
    @classmethod
    def _check_adapter_name(cls, name: str) -> str:
        return _check_name(name, "name")

    @field_validator("source")
    @classmethod
    def _check_adapter_source(cls, source: str) -> str:
        if len(source) > MAX_TEXT:
            raise ValueError(f"source must be at most {MAX_TEXT} characters")
        if not _ADAPTER_SOURCE.match(source):
            raise ValueError(
                f"source {source!r} must be a PEFT LoRA directory: safetensors:/dir, pkg:PACKAGE/DIR "
                "or an absolute path"
            )
        return source


class ModelSpec(_Strict):
    source: str
    dtype: Literal["bfloat16", "float32", "int8", "q4"] = "bfloat16"  # runtime.registry.DTYPES
    adapters: tuple[AdapterSpec, ...] = Field((), max_length=MAX_ADAPTERS)

    @field_validator("adapters")
    @classmethod
    def _check_adapters(cls, adapters: tuple[AdapterSpec, ...]) -> tuple[AdapterSpec, ...]:
        names = [a.name for a in adapters]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"adapter names must be unique; repeated: {', '.join(duplicates)}")
        return adapters

    @field_validator("source")
    @classmethod
    def _check_source(cls, source: str) -> str:
        # Here, not Field(max_length=...): pydantic-core then rejects a lone surrogate as
        # "not a valid string" before the gateway can name the unregistrable source.
        if len(source) > MAX_TEXT:
            raise ValueError(f"source must be at most {MAX_TEXT} characters")
        if not _SOURCE.match(source):
            forms = "gguf:/path, safetensors:/dir, pkg:PACKAGE/RESOURCE or an absolute path"
            raise ValueError(f"source {source!r} must be {forms}")
        return source


class ScalingSpec(_Strict):
    min_scale: int = Field(0, alias="minScale", ge=0, le=MAX_SCALE)
    max_scale: int = Field(4, alias="maxScale", ge=1, le=MAX_SCALE)
    keep_alive: Duration = Field(10.0, alias="keepAlive")
    concurrency: int = Field(8, ge=1, le=MAX_CONCURRENCY)

    @model_validator(mode="after")
    def _check_bounds(self) -> ScalingSpec:
        if self.min_scale > self.max_scale:
            raise ValueError(f"minScale ({self.min_scale}) must not exceed maxScale ({self.max_scale})")
        return self


class SloSpec(_Strict):
    ttft: Duration = 2.0  # LLM-Mesh default: max(2 s, input_len / 512 s), applied per request
    tpot: Duration = 0.25


class FunctionBody(_Strict):
    model: ModelSpec
    handler: str = "default"
    init: Literal["static", "dynamic"] = "static"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    slo: SloSpec = Field(default_factory=SloSpec)
    latency_sensitivity: float = Field(1.0, alias="latencySensitivity", gt=0, le=1000, allow_inf_nan=False)
    max_tokens: int = Field(2048, alias="maxTokens", ge=1, le=MAX_TOKENS)

    @field_validator("handler")
    @classmethod
    def _check_handler(cls, handler: str) -> str:
        if len(handler) > MAX_TEXT:
            raise ValueError(f"handler must be at most {MAX_TEXT} characters")
        if not _HANDLER.match(handler):
            raise ValueError(f"handler {handler!r} must be 'default' or 'module.py:function'")
        return handler


class Metadata(_Strict):
    name: str
    namespace: str = "default"  # scheduler.names.DEFAULT_NAMESPACE; a tenant key's own when left out

    @field_validator("name", "namespace")
    @classmethod
    def _check_name(cls, name: str, info: ValidationInfo) -> str:
        return _check_name(name, str(info.field_name))


class FunctionSpec(_Strict):
    api_version: Literal["ember.dev/v1"] = Field(alias="apiVersion")
    kind: Literal["Function"]
    metadata: Metadata
    spec: FunctionBody

    @property
    def name(self) -> str:
        return self.metadata.name

    def to_document(self) -> dict[str, Any]:
        """The spec with every default filled in, in the YAML's own field names."""
        return self.model_dump(by_alias=True, mode="json")


def parse_function(document: Any) -> FunctionSpec:
    """Validate a parsed YAML/JSON document; :class:`SpecError` names every bad field."""
    if not isinstance(document, dict):
        raise SpecError("a function spec must be a mapping (apiVersion, kind, metadata, spec)")
    try:
        return FunctionSpec.model_validate(document)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(document)"
            message = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            problems.append(f"{where}: {message}")
        raise SpecError("; ".join(problems)) from None


def parse_function_yaml(text: str) -> FunctionSpec:
    """Parse a YAML (or JSON) function spec, bounded in nesting (``MAX_YAML_DEPTH``) and in
    nodes, aliases expanded (``MAX_YAML_NODES``: no "billion laughs"). CPU-bound for large
    texts: call it off the event loop."""
    return parse_function(load_yaml(text))


def load_yaml(text: str, max_depth: int = MAX_YAML_DEPTH, max_nodes: int = MAX_YAML_NODES) -> Any:
    """``yaml.safe_load`` with bounds; :class:`SpecError` for malformed or oversized documents."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when built with it
    try:
        # Events first, one at a time: the composer recurses per level (a deep document would
        # exhaust the stack), and libyaml's composer holds the GIL for the whole document
        # (0.3 s for 256 KiB: every other thread, the event loop's included, would wait).
        depth = nodes = 0
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.NodeEvent):
                nodes += 1
                if nodes > max_nodes:
                    raise SpecError(f"malformed YAML: more than {max_nodes} nodes")
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > max_depth:
                    raise SpecError(f"malformed YAML: nested deeper than {max_depth} levels")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
        document = yaml.load(text, Loader=loader)  # CSafeLoader or SafeLoader: safe
    except yaml.YAMLError as exc:
        if "maximum nesting depth" in str(exc):
            # libyaml >= 0.2.5's own bound (1000 levels) can fire before the parser hands our
            # loop the 33rd start event (it scans ahead): the same error, in one wording.
            raise SpecError(f"malformed YAML: nested deeper than {max_depth} levels") from None
        raise SpecError(f"malformed YAML: {exc}") from None
    except SpecError:
        raise
    except ValueError:  # int() refuses more digits than sys.get_int_max_str_digits()
        raise SpecError(
            f"malformed YAML: a number has more than {sys.get_int_max_str_digits()} digits"
        ) from None
    _check_nodes(document, max_nodes)
    return document


def _check_nodes(document: Any, max_nodes: int) -> None:
    """SpecError if ``document`` has more than ``max_nodes`` nodes, aliases counted per use
    (iterative, and stops at the bound: an alias bomb costs ``max_nodes`` steps at most)."""
    stack, seen = [document], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > max_nodes:
            raise SpecError(f"malformed YAML: more than {max_nodes} nodes once aliases are expanded")
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
