"""Per-layer waits of a model whose weights are still loading (TIDAL §5.2).

A progressive pool acquire (:meth:`gpu_pool.client.PoolClient.acquire_progressive`) returns
placements before the bytes are in, with a :class:`gpu_pool.readiness.Readiness` over the
manifest's tensors in access order. :class:`LayerGate` turns that into the forward pass's
stages: stage 0 the embeddings, stage ``i + 1`` decoder layer ``i``, the last stage the final
norm and LM head. :meth:`LayerGate.wait` blocks until every tensor of a stage is in, so the
prefill of the first layers runs while later layers load. Once everything is in, ``done``
is set and the model drops the gate: a warm forward pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from gpu_pool.errors import LoadError

if TYPE_CHECKING:
    import torch

    from runtime.models.embedding_rows import EmbeddingRows

LAYER_PREFIX = "model.layers."


class TensorReadiness(Protocol):
    """What the gate needs of a readiness (:class:`gpu_pool.readiness.Readiness`)."""

    @property
    def done(self) -> bool: ...
    def ready(self, index: int) -> bool: ...

    def wait(self, index: int, timeout: float | None = None) -> None: ...


def stage_of(name: str, num_layers: int) -> int:
    """The forward stage that reads weight ``name``."""
    if name.startswith("model.embed_tokens."):
        return 0
    if name.startswith(LAYER_PREFIX):
        return int(name[len(LAYER_PREFIX) :].split(".", 1)[0]) + 1
    return num_layers + 1  # the final norm, the LM head


class LayerGate:
    """Waits, stage by stage, for the tensors a forward stage reads."""

    def __init__(
        self,
        readiness: TensorReadiness,
        names: Sequence[str],
        num_layers: int,
        on_failed: Callable[[], None] | None = None,
        embedding: EmbeddingRows | None = None,
        tied: bool = False,
    ) -> None:
        """``names``: the manifest's tensor names, in the order ``readiness`` indexes them;
        ``on_failed``: called once when the load fails (the weights will never be in: the
        instance must be replaced, not go on failing every request); ``embedding``: the
        embedding table's rows in its store file (:meth:`embed`); ``tied``: the LM head is the
        embedding table, so the last stage needs it too."""
        self.readiness = readiness
        self.num_layers = num_layers
        self.on_failed = on_failed
        self.failed = False
        self.embedding = embedding
        # The last manifest index each stage needs (-1: nothing): waiting for it waits for the
        # stage's every tensor, since groups come in manifest order.
        self.needs = [-1] * (num_layers + 2)
        for i, name in enumerate(names):
            stage = stage_of(name, num_layers)
            self.needs[stage] = max(self.needs[stage], i)
        if tied:
            self.needs[-1] = max(self.needs[-1], self.needs[0])
        self.rows_read = 0  # embedding rows read from the store file instead of waiting
        self.rows_fallbacks = 0  # forwards that waited for the table instead (see embed)
        self.waited_s = 0.0  # time the forward spent waiting for bytes

    @property
    def done(self) -> bool:
        return self.readiness.done

    def embed(self, ids: torch.Tensor) -> torch.Tensor | None:
        """``ids``' embedding rows (N, E) read from the store file while the table is still
        loading (:mod:`runtime.models.embedding_rows`); None once it is in, or when its rows
        cannot be read that way: then :meth:`wait` for stage 0 and look them up."""
        embedding = self.embedding
        if embedding is None or self.readiness.done:
            return None
        try:
            if self.readiness.ready(self.needs[0]):
                return None
            rows = embedding.rows(ids)
        except (LoadError, OSError, IndexError):  # a failed load, an unreadable file, a bad id:
            self.rows_fallbacks += 1  # wait(0) and the lookup say so
            return None
        self.rows_read += int(rows.shape[0])
        return rows

    def wait(self, stage: int, timeout: float | None = None) -> None:
        """Block until stage ``stage``'s tensors are in (LoadError if their load failed)."""
        index = self.needs[stage]
        if index >= 0 and not self.readiness.done:
            import time

            t0 = time.perf_counter()
            try:
                self.readiness.wait(index, timeout)
            except TimeoutError:
                raise
            except Exception:  # LoadError: the pool dropped the tensors, they will not come
                if not self.failed and self.on_failed is not None:
                    self.on_failed()
                self.failed = True
                raise
            finally:
                self.waited_s += time.perf_counter() - t0


def stage_groups(names: Sequence[str], num_layers: int, max_groups: int) -> list[int] | None:
    """Readiness group ends for a manifest of ``names``: a group ends where the forward stage
    changes (one group per layer for a manifest in access order); None when that makes more
    than ``max_groups`` groups (a manifest in another order: the pool's default groups)."""
    ends = [
        i
        for i in range(1, len(names))
        if stage_of(names[i], num_layers) != stage_of(names[i - 1], num_layers)
    ]
    ends.append(len(names))
    return ends if len(ends) <= max_groups else None
