"""A model's weights as registration stores them: each tensor converted to the registered dtype.

:class:`StoreWeights` takes a source's tensors one by one (in access order) and keeps what the
store entry will hold. For ``bfloat16`` / ``float32`` every tensor is cast. For ``int8`` / ``q4``
the decoder's projection weights become the :mod:`runtime.quant` planes (``<name>``,
``<name>.scales``, ``<name>.mins``), from GGML blocks of the method's own type carried over as
they are or else quantized from the float weights, and for ``int8`` the LM head becomes int8
planes too (:meth:`StoreWeights.quantize_head`, a tied one as a copy); every other tensor
(embeddings, norms, biases, and a projection whose ``in`` is not a multiple of 32) is bfloat16.
:meth:`StoreWeights.metadata` is what the store's manifest records about it.
"""

from __future__ import annotations

from typing import Any

import torch

from runtime import quant
from runtime.errors import RegistrationError
from runtime.gguf_import import GGMLBlocks
from runtime.models.quant_weight import MINS, SCALES

_GGML_NAMES = {quant.GGML_Q8_0: "Q8_0", quant.GGML_Q4_1: "Q4_1"}


class StoreWeights:
    """Tensors for the store in ``dtype``, with a record of what was quantized and how."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self.method = dtype if dtype in quant.METHODS else None
        self.float_dtype: torch.dtype = torch.bfloat16 if self.method else getattr(torch, dtype)
        self.tensors: dict[str, torch.Tensor] = {}
        self._quantized: dict[str, str] = {}  # name -> "carried Q4_1" | "quantized"
        self._kept: dict[str, str] = {}  # a projection left in bfloat16 -> why

    def carry(self, name: str, ggml_type: int) -> bool:
        """Whether GGUF tensor ``name`` of ``ggml_type`` should come as blocks, to be kept as they are."""
        return (
            self.method is not None
            and quant.GGML_SOURCE[self.method] == ggml_type
            and quant.is_linear_weight(name)
        )

    def add(self, name: str, value: torch.Tensor | GGMLBlocks) -> None:
        """Convert one source tensor (float, or GGML blocks :meth:`carry` asked for) and keep it."""
        if name.endswith((SCALES, MINS)):
            # A pre-quantized checkpoint (GPTQ and the like name planes so): its codes would be
            # cast as if they were weights. Say so instead of registering a broken model.
            raise RegistrationError(f"tensor {name!r}: quantized source checkpoints are not supported")
        if isinstance(value, GGMLBlocks):
            assert self.method is not None and self.carry(name, value.qtype)
            self._put(name, quant.from_ggml(value.rows, value.qtype, self.method))
            self._quantized[name] = f"carried {_GGML_NAMES[value.qtype]}"
            return
        if self.method is not None and quant.is_linear_weight(name):
            why = quant.quantizable(name, tuple(value.shape))
            if why is None:
                self._put(name, quant.quantize(value, self.method))
                self._quantized[name] = "quantized"
                return
            self._kept[name] = why
        self.tensors[name] = value.to(self.float_dtype)

    def quantize_head(self) -> None:
        """``int8``: the LM head as int8 planes (``lm_head.weight``), as llama.cpp's Q8_0 files
        hold their output tensor (``q4`` keeps a bfloat16 head). A decode step reads the whole head: SmolLM2's
        (49152 x 576) is 57 MB in bfloat16 and 30 MB in int8, 4.6 against 1.8 ms per token on
        two Zen 3 cores, a third of an int8 step. A tied head gets this copy beside the
        bfloat16 embedding, whose gathers read one row per token; an untied one is replaced.
        Call it once every tensor is in."""
        head = "lm_head.weight" if "lm_head.weight" in self.tensors else "model.embed_tokens.weight"
        weight = self.tensors.get(head)
        if self.method != "int8" or weight is None:
            return
        why = None if weight.dim() == 2 and weight.shape[1] % quant.GROUP == 0 else "not 2-D by 32s"
        if why is not None:
            self._kept["lm_head.weight"] = why
            return
        if head == "lm_head.weight":
            del self.tensors[head]
        self._put("lm_head.weight", quant.quantize(weight, "int8"))
        self._quantized["lm_head.weight"] = "quantized int8 (the LM head)"

    def metadata(self) -> dict[str, Any]:
        """The store entry's metadata: ``{"quantization": ...}`` (``None`` for a float dtype)."""
        if self.method is None:
            return {"quantization": None}
        return {
            "quantization": {
                "method": self.method,
                "group_size": quant.GROUP,
                "other_dtype": "bfloat16",
                "quantized": dict(self._quantized),
                "kept_bfloat16": dict(self._kept),
            }
        }

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def _put(self, name: str, planes: dict[str, torch.Tensor]) -> None:
        for suffix, tensor in planes.items():
            self.tensors[name + suffix] = tensor.contiguous()
