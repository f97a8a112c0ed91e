"""How a model sees a quantized linear weight: :class:`QuantWeight`, bound from the weight table.

A quantized weight ``<name>`` sits in the pool as up to three tensors (layouts in
:mod:`runtime.quant`): the codes ``<name>``, ``<name>.scales`` and, for ``q4``, ``<name>.mins``.
:func:`bind_weight` turns such a group of pool views into one :class:`QuantWeight` (no copy),
and any other weight into its plain tensor, so the model code branches on one ``isinstance``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SCALES = ".scales"
MINS = ".mins"


class QuantWeight(NamedTuple):
    """A weight-only quantized (out, in) linear weight, groups of 32 along ``in``.

    ``int8``: ``q`` int8 (out, in), w = q * s. ``q4``: ``q`` uint8 (out, in/2), low nibble the
    even index, w = q * s + m. ``scales`` and ``mins`` are float16 (out, in/32).
    """

    method: str  # "int8" | "q4"
    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def out_features(self) -> int:
        return int(self.q.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.q.shape[1]) * (2 if self.method == "q4" else 1)


def bind_weight(table: dict[str, torch.Tensor], name: str) -> torch.Tensor | QuantWeight:
    """``table[name]``, as a :class:`QuantWeight` when the table holds its scales."""
    q = table[name]
    scales = table.get(name + SCALES)
    if scales is None:
        return q
    mins = table.get(name + MINS)
    if q.dtype == torch.int8 and mins is None:
        return QuantWeight("int8", q, scales, None)
    if q.dtype == torch.uint8 and mins is not None:
        return QuantWeight("q4", q, scales, mins)
    raise ValueError(f"weight {name!r}: {q.dtype} codes with scales{' and mins' * (mins is not None)}")
