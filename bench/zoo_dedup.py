"""Issue 15's acceptance item, measured: a fine-tuned variant costs only its differing tensors.

For each base model of a :class:`bench.zoo.Zoo` that has fine-tuned variants, a real pool daemon
(its own process, CPU arena big enough for all of them, trusting ``zoo.home/models``) is asked to
acquire the base and then each variant, each in its own session (kept open, so nothing is
evicted). After every acquire the daemon's own ``resident_bytes`` is read and compared with the
expectation from the registered manifests: the base's unique tensors plus, per variant, the
tensors whose fingerprint the base does not have. Bytes are pool-aligned (each tensor region
rounded up to the store alignment the daemon reports), the units of ``resident_bytes``.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpu_pool.client import PoolClient
from gpu_pool.spawn import running_pool

if TYPE_CHECKING:
    from bench.zoo import Zoo, ZooModel

_SLACK = 16 << 20  # arena bytes beyond the expectation (the daemon needs no more; a margin)


@dataclass(frozen=True, slots=True)
class DedupStep:
    """One acquire: the model, what it adds over the base, and the pool's resident bytes after it."""

    model: str
    differing_tensors: int
    differing_bytes: int  # aligned bytes of its tensors the base does not have (0 for the base)
    resident_bytes: int  # measured: the daemon's stats
    expected_bytes: int  # base + the differing bytes of every variant acquired so far

    @property
    def equal(self) -> bool:
        return self.resident_bytes == self.expected_bytes


@dataclass(frozen=True, slots=True)
class DedupReport:
    base: str
    base_bytes: int  # the base's unique tensors, aligned
    alignment: int  # the daemon's store alignment
    steps: tuple[DedupStep, ...]  # the base's acquire first, then each variant's

    @property
    def equal(self) -> bool:
        return all(s.equal for s in self.steps)

    def to_json(self) -> dict[str, Any]:
        last = self.steps[-1]
        return {
            "base": self.base,
            "base_bytes": self.base_bytes,
            "alignment": self.alignment,
            "variants": [
                {
                    "model": s.model,
                    "differing_tensors": s.differing_tensors,
                    "differing_bytes": s.differing_bytes,
                    "resident_bytes": s.resident_bytes,
                    "expected_bytes": s.expected_bytes,
                }
                for s in self.steps[1:]
            ],
            "resident_bytes": last.resident_bytes,
            "expected_bytes": last.expected_bytes,
            "separate_bytes": self.base_bytes * len(self.steps),  # had nothing been shared
            "equal": self.equal,
        }


def measure_dedup(zoo: Zoo) -> tuple[DedupReport, ...]:
    """One report per base model with fine-tuned variants (in the zoo's order)."""
    bases = [m for m in zoo.models if any(v.base == m.name for v in zoo.models)]
    return tuple(measure_base(zoo, b, [v for v in zoo.models if v.base == b.name]) for b in bases)


def measure_base(zoo: Zoo, base: ZooModel, variants: list[ZooModel]) -> DedupReport:
    """Acquire ``base`` then each of ``variants`` in a fresh pool daemon and compare."""
    from bench.zoo import unique_tensors
    from runtime.registry import load

    base_tensors = unique_tensors(zoo, [base])
    base_bytes = sum(base_tensors.values())
    differing = {}
    for v in variants:
        mine = unique_tensors(zoo, [v])
        differing[v.name] = {fp: n for fp, n in mine.items() if fp not in base_tensors}
    expected_total = base_bytes + sum(sum(d.values()) for d in differing.values())
    arena = -(-(expected_total + _SLACK) // (1 << 20)) * (1 << 20)
    steps: list[DedupStep] = []
    clients: list[PoolClient] = []
    with tempfile.TemporaryDirectory(prefix="ember-zoo-dedup-") as tmp:
        sock = str(Path(tmp) / "pool.sock")
        with running_pool(
            sock, arena, env={"EMBER_POOL_PREFAULT": "false"}, store_roots=(zoo.home / "models",)
        ) as _pool:
            try:
                expected = base_bytes
                alignment = 0
                for model in (base, *variants):
                    client = PoolClient(sock)
                    clients.append(client)
                    alignment = client.alignment
                    client.acquire_placements(load(zoo.model_dir(model)).manifest())
                    extra = differing.get(model.name, {})
                    expected += sum(extra.values())
                    resident = int(client.stats()["resident_bytes"])
                    steps.append(DedupStep(model.name, len(extra), sum(extra.values()), resident, expected))
            finally:
                for client in clients:
                    client.close()
    return DedupReport(base.name, base_bytes, alignment, tuple(steps))
