"""The trace's cold starts replayed on the pool alone: every policy under one acquire sequence.

``bench.trace`` replays a trace on a real ``ember serve``; there, when instances start depends
on the machine (a 2-core box queues requests and worker starts for seconds), so two policies see
different sequences of cold starts and their hit ratios differ by timing as much as by
decision. This benchmark fixes the sequence. From the same trace and keep-alive it derives
each function's instances (:func:`instance_timeline`: an instance starts at a request that
finds none alive, and ends a keep-alive after its last request, counting ``service_s`` per
request), then replays those starts and ends on a real pool daemon per policy and capacity:
a start is an acquire of the model's real manifest (the zoo's registered models: real bytes
copied, fine-tunes sharing tensors), an end closes the session. When the arena cannot hold a
start beside what live instances pin, the instance idle longest is ended first, as the
router does (:meth:`scheduler.router.Router._reclaim`). Time runs ``--speedup`` times faster
than the trace (the pool's rate estimates and IAM's updates see the compressed clock).

Per policy and capacity: ``hit_ratio`` (starts that loaded 0 bytes), ``byte_hit_ratio``,
``bytes_loaded``, ``load_s`` (the pool's copy time), starts, reclaims. Prints one JSON line
(``--out`` appends it too); ``bench.plots`` draws it with the end-to-end run.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.json_line import emit
from bench.trace import CAPACITIES, KEEP_ALIVE_S, POLICIES, arena_bytes, function_order, trace_config
from bench.workload import Trace, generate
from bench.zoo import Zoo, build, default_root
from gpu_pool.client import PoolClient, RemotePoolError
from gpu_pool.errors import OutOfMemory
from gpu_pool.manifest import Manifest
from gpu_pool.spawn import running_pool
from runtime.registry import load


@dataclass(frozen=True, slots=True)
class Event:
    t_s: float
    start: bool  # an instance starts (acquire) or ends (close)
    function: int
    instance: int


def instance_timeline(trace: Trace, keep_alive_s: float, service_s: float) -> list[Event]:
    """Instance starts and ends of ``trace`` under a fixed keep-alive (one instance per
    function at a time; at one time, an instance's end sorts before the next one's start)."""
    events: list[Event] = []
    alive: dict[int, tuple[int, float]] = {}  # function -> (instance, when it would end)
    next_id = 0
    for a in trace.arrivals:
        current = alive.get(a.function)
        if current is not None and a.t_s > current[1]:
            events.append(Event(current[1], False, a.function, current[0]))
            current = None
        if current is None:
            current = (next_id, 0.0)
            events.append(Event(a.t_s, True, a.function, next_id))
            next_id += 1
        alive[a.function] = (current[0], a.t_s + service_s + keep_alive_s)
    events += [Event(end, False, f, i) for f, (i, end) in alive.items()]
    began = {e.instance: e.t_s for e in events if e.start}

    def order(e: Event) -> tuple[float, int, int]:
        # At one time: ends of earlier instances, then starts, then ends of instances that
        # began at that very time (no keep-alive, no service time).
        rank = 1 if e.start else (2 if began[e.instance] == e.t_s else 0)
        return (e.t_s, rank, e.instance)

    return sorted(events, key=order)


def _start(
    sock: str, manifest: Manifest, live: dict[int, tuple[PoolClient, float]]
) -> tuple[PoolClient | None, int]:
    """A session holding ``manifest``, ending live instances idle longest while the arena has
    no room (None when even an empty pool of others cannot hold it); and how many it ended."""
    client = PoolClient(sock)
    ended = 0
    while True:
        try:
            client.acquire_placements(manifest)
            return client, ended
        except RemotePoolError as exc:
            if exc.kind is not OutOfMemory or not live:
                client.close()
                return None, ended
            oldest = min(live, key=lambda i: live[i][1])
            _end(live.pop(oldest)[0])
            ended += 1


def _end(client: PoolClient) -> None:
    """End an instance's session: unpin at once (a round trip), then hang up."""
    client.release()
    client.close()


def replay(
    zoo: Zoo, manifests: list[Manifest], events: list[Event], policy: str, capacity: float, speedup: float
) -> dict[str, Any]:
    """One policy at one capacity on a fresh pool daemon (see the module docstring)."""
    arena = arena_bytes(zoo, capacity)
    starts, hits, reclaims, refused = 0, 0, 0, 0
    loaded = reused = 0
    load_s = 0.0
    with tempfile.TemporaryDirectory(prefix="ember-trace-pool-") as tmp:
        sock = str(Path(tmp) / "pool.sock")
        env = {"EMBER_POOL_IMPORTANCE": policy, "EMBER_POOL_PREFAULT": "false"}
        with running_pool(sock, arena, env=env, store_roots=(zoo.home / "models",)):
            live: dict[int, tuple[PoolClient, float]] = {}  # instance -> (session, last start)
            t0 = time.monotonic()
            try:
                for e in events:
                    time.sleep(max(0.0, t0 + e.t_s / speedup - time.monotonic()))
                    if not e.start:
                        session = live.pop(e.instance, None)
                        if session is not None:
                            _end(session[0])
                        continue
                    client, ended = _start(sock, manifests[e.function], live)
                    reclaims += ended
                    if client is None:
                        refused += 1
                        continue
                    report = client.last_acquire
                    assert report is not None
                    starts += 1
                    hits += report.bytes_loaded == 0
                    loaded += report.bytes_loaded
                    reused += report.bytes_reused
                    load_s += report.load_seconds
                    live[e.instance] = (client, time.monotonic())
            finally:
                for client, _ in live.values():
                    client.close()
    return {
        "policy": policy,
        "capacity": capacity,
        "arena_bytes": arena,
        "starts": starts,
        "hit_ratio": round(hits / starts, 4) if starts else None,
        "byte_hit_ratio": round(reused / (reused + loaded), 4) if loaded + reused else None,
        "bytes_loaded": loaded,
        "load_s": round(load_s, 3),
        "reclaims": reclaims,
        "refused": refused,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the quick zoo, two policies, one capacity")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--duration", type=float, default=None, help="trace seconds after time scaling")
    parser.add_argument("--service", type=float, default=1.0, help="seconds an instance serves a request")
    parser.add_argument(
        "--speedup", type=float, default=3.0, help="replay this many times faster than the trace"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--zoo-root", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not args.speedup > 0 or args.service < 0:
        parser.error("--speedup must be > 0 and --service >= 0")
    profile = "quick" if args.quick else "full"
    t0 = time.perf_counter()
    zoo = build(args.zoo_root or default_root(profile), profile)
    # The same trace as bench.trace's (same defaults), the same function order.
    config = trace_config(zoo, args.quick, args.requests, args.duration, args.seed)
    trace = generate(config)
    by_name = {m.name: m for m in zoo.models}
    manifests = [load(zoo.model_dir(by_name[name])).manifest() for name in function_order(zoo, args.seed)]
    events = instance_timeline(trace, KEEP_ALIVE_S, args.service)
    policies = ("iam", "lru") if args.quick else POLICIES
    capacities = (0.6,) if args.quick else CAPACITIES
    configs = [replay(zoo, manifests, events, p, c, args.speedup) for c in capacities for p in policies]
    best: dict[str, Any] = {}
    for c in capacities:
        at = {r["policy"]: r["hit_ratio"] or 0.0 for r in configs if r["capacity"] == c}
        others = {p: h for p, h in at.items() if p != "iam"}
        top = max(others, key=lambda p: others[p])
        best[str(c)] = {
            "iam": at["iam"],
            "best_baseline": top,
            "best_hit_ratio": others[top],
            "iam_ge_best": at["iam"] >= others[top],
        }
    line = {
        "bench": "trace_pool",
        "profile": profile,
        "trace": asdict(config),
        "service_s": args.service,
        "speedup": args.speedup,
        "starts": sum(e.start for e in events),
        "working_set_bytes": zoo.working_set_bytes,
        "configs": configs,
        "iam_vs_best": best,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    emit(line, args.out)


if __name__ == "__main__":
    main()
