"""One sequence's grammar state: the allowed-token mask before sampling, the token after."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from runtime.structured.errors import GrammarError


class Constraint:
    """Wraps one llguidance matcher (a copy of a cached, compiled grammar).

    :meth:`mask_logits` computes the grammar's allowed-token bitmask into a preallocated
    buffer (llguidance's CPU bitmask API, ~10 us for a 49k vocabulary), unpacks it with numpy
    and sets forbidden logits to ``-inf`` in place: no Python loop over the vocabulary. The
    masking runs in numpy on the float32 row (~30 us): torch's element-wise kernels hand even
    a 49k-element op to their thread pool, which costs milliseconds on a busy machine.
    """

    __slots__ = ("_forbidden", "_matcher", "_vocab", "_words")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._words = np.full((vocab_size + 31) // 32, -1, dtype=np.int32)
        self._forbidden = np.empty(vocab_size, dtype=np.bool_)

    def mask_logits(self, logits: torch.Tensor) -> None:
        """Set the logits of every token the grammar forbids next to ``-inf`` (in place).

        ``logits`` is one sequence's ``(vocab,)`` row; entries past the tokenizer's
        vocabulary (padding rows of the model's output) are always forbidden.
        """
        m = self._matcher
        if m.is_stopped():
            raise GrammarError("the grammar is complete; the sequence should have finished")
        m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if m.is_error():
            raise GrammarError(f"grammar matcher failed: {m.get_error()}")
        n = min(self._vocab, logits.shape[-1])
        allowed = np.unpackbits(self._words.view(np.uint8), count=n, bitorder="little").view(np.bool_)
        forbidden = np.logical_not(allowed, out=self._forbidden[:n])
        if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.is_contiguous():
            row = logits.numpy()  # shares the tensor's memory
            np.copyto(row[:n], -np.inf, where=forbidden)
        else:
            logits[:n].masked_fill_(torch.from_numpy(forbidden).to(logits.device), -math.inf)
        if logits.shape[-1] > n:
            logits[n:] = -math.inf

    def allowed(self) -> np.ndarray:
        """The ids the grammar allows next (tests and diagnostics; the engine uses the mask)."""
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), count=self._vocab, bitorder="little")
        return np.flatnonzero(bits)

    def accept(self, token: int) -> bool:
        """Advance past the sampled ``token``; False when the grammar does not allow it."""
        return bool(self._matcher.consume_token(token)) and not self._matcher.is_error()

    @property
    def terminated(self) -> bool:
        """The output is complete: the grammar allows no further token."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())
