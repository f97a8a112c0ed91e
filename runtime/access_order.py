"""A model's weight access order, traced once at registration (TIDAL §4.1, §5.2).

:func:`trace_access_order` runs one tiny forward pass (two tokens, the torch path) over the
real weight table under a :class:`~torch.overrides.TorchFunctionMode` that notes the first
operator each weight reaches, as TIDAL's tracer does: the order is what the forward actually
touches, not the order of the source file or of the weight table. A quantized projection's
planes (``.scales``, ``.mins``) are recorded where its dequantization reads them. Weights no
operator reaches (none in a Llama) follow in their table order. A plain floating-point
embedding table goes last: a progressive start reads its prompt's rows from the store file
(:mod:`runtime.models.embedding_rows`) and first needs the whole table in a tied LM head.

Registration stores the entry's tensors in this order (:mod:`gpu_pool.store.entry` lays the
file out the same way) and a progressive acquire loads them in it, so a layer's bytes arrive
before the next layer's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from runtime.models.embedding_rows import EMBED, PLAIN

# The ``access_order`` record in a store entry's metadata. 2: a plain embedding table last.
ACCESS_ORDER_VERSION = 2


class _Recorder(TorchFunctionMode):
    """Notes, per operator call, the weights among its arguments, first access only."""

    def __init__(self, names_by_ptr: dict[int, list[str]]) -> None:
        super().__init__()
        self._names = names_by_ptr
        self.order: list[str] = []
        self._seen: set[str] = set()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        for value in _tensors((args, kwargs or {})):
            for name in self._names.get(_ptr(value), ()):
                if name not in self._seen:
                    self._seen.add(name)
                    self.order.append(name)
        return func(*args, **(kwargs or {}))


def _ptr(t: torch.Tensor) -> int:
    # A view (a transpose, a slice from the start) shares its base's first byte.
    return int(t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size())


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif hasattr(value, "__dataclass_fields__"):  # QuantWeight and the like
        for field in value.__dataclass_fields__:
            yield from _tensors(getattr(value, field))


def trace_access_order(hf_config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of ``tensors`` in the order one forward of the model touches them."""
    from runtime.models.llama import Batch, LlamaConfig, LlamaModel

    cfg = LlamaConfig.from_hf(dict(hf_config))
    weights = dict(tensors)
    names_by_ptr: dict[int, list[str]] = {}
    for name, t in weights.items():
        if t.numel():
            names_by_ptr.setdefault(_ptr(t), []).append(name)
    model = LlamaModel(cfg, weights, use_cuda_kernels=False, cpu_kernels="off")
    n, block = 2, 16
    kv_dtype = model.dtype if model.dtype.is_floating_point else torch.bfloat16
    kv = torch.zeros(1, *cfg.kv_block_shape(block), dtype=kv_dtype)
    pos = torch.arange(n)
    batch = Batch(pos % cfg.vocab_size, pos, pos, [n], [n], torch.zeros(1, 1, dtype=torch.int64))
    recorder = _Recorder(names_by_ptr)
    with recorder:
        model.forward(batch, kv)
    seen = set(recorder.order)
    order = recorder.order + [name for name in weights if name not in seen]
    # A plain table's prompt rows are read from the store file while it loads
    # (runtime.models.embedding_rows): it goes last, where a tied LM head first needs it whole.
    embed = weights.get(EMBED)
    plain = embed is not None and embed.dim() == 2 and str(embed.dtype).removeprefix("torch.") in PLAIN
    if plain and not any(name.startswith(EMBED + ".") for name in weights):
        order = [name for name in order if name != EMBED] + [EMBED]
    return order


def ordered(tensors: Mapping[str, torch.Tensor], order: Iterable[str]) -> dict[str, torch.Tensor]:
    """``tensors`` as a dict in ``order`` (which must name each of them once)."""
    names = list(order)
    if sorted(names) != sorted(tensors):
        raise ValueError("an access order must name every tensor exactly once")
    return {name: tensors[name] for name in names}
