"""Synthetic FaaS request traces with the statistics of production serverless workloads.

Two generators, both deterministic for a given seed (numpy only, no torch):

* :func:`generate`: a trace of ``num_requests`` invocations of ``num_functions`` functions,
  shaped on the Azure Functions production trace characterised by Shahrad et al., "Serverless
  in the Wild: Characterizing and Optimizing the Serverless Workload at a Large Cloud
  Provider", USENIX ATC 2020 (two weeks of July 2019). The figures used, as the paper states
  them (§3.3 and its takeaways):

  - popularity is extremely skewed: invocations per day span over 8 orders of magnitude;
    the 18.6 % most popular applications (those invoked at least once per minute on
    average) account for 99.6 % of all invocations (Fig. 5b);
  - most functions are rarely invoked: 45 % of applications are invoked once per hour or
    less on average, 81 % once per minute or less (Fig. 5a);
  - inter-arrival times are bursty: 40 % of applications have an IAT coefficient of
    variation above 1 (Fig. 6; a Poisson process has CV 1, a timer CV 0);
  - Azure keeps an idle instance alive for a fixed 20 minutes (the paper's baseline keep-alive
    policy), hence the default ``keep_alive_s`` of 1,200 trace seconds.

  mCache (Table 3's workload, ../shared/papers/mcache.txt §2) reads the same trace: HTTP-
  triggered functions' mean rates run from 1.15e-5 to 967 requests/s and only 1.17 % of them
  exceed one request per second.

  How they are modelled (the modelling choices are ours, not the paper's): function ``i``
  (0 = most popular) gets a share of the requests proportional to ``(i + 1) ** -zipf_s``
  (largest-remainder rounding, so counts are exact and non-increasing). A trace of tens of
  functions cannot reproduce "18.6 % of functions carry 99.6 %" without leaving most of them
  with no request at all, so the default ``zipf_s = 1.5`` is an assumption: with 20-100
  functions the top 20 % carry about 75-90 % of the requests, and :func:`summary` reports the
  share so a run can say how skewed it was. Each function's arrivals are a renewal process
  with Gamma inter-arrival times of coefficient of variation ``burst_cv`` (default 2: the
  bursty 40 % of Fig. 6, the ones a fixed keep-alive serves worst), conditioned to fit the
  trace: a function with ``c`` requests draws ``c + 1`` gaps and scales them to the trace's
  length, so its first request comes at a random time and its mean gap is
  ``duration / (c + 1)``. Rarely invoked functions therefore idle far longer than the
  keep-alive between requests, and bursty ones alternate clusters with long idle gaps.

  Time is compressible: ``time_scale`` trace seconds pass per replay second, so a trace of
  4 hours with ``time_scale = 24`` replays in 10 minutes. Arrival times are replay seconds;
  the system under test should run with a keep-alive of :attr:`TraceConfig.replay_keep_alive_s`
  (``keep_alive_s / time_scale``) so that gaps keep their relation to the keep-alive.

* :func:`locality_sequence` / :func:`locality_arrivals`: Tangram's locality levels (§5.1).
  Tangram derives requests from the same Azure trace, with Gamma arrivals whose CV sets the
  level, and thins out runs of consecutive requests to one model for the weaker levels:
  L1: CV 0.25 and no consecutive requests; L2: CV 0.5, consecutive runs halved; L3: CV 1, the
  original runs; L4: CV 2, the runs as they are. The paper gives no run-length figures (its
  Fig. 4a says that most requests follow one to the same model), so the original runs here
  are an assumption: models drawn by Zipf(1) popularity, each different from the one before,
  run lengths ``1 + Geometric`` with mean :data:`MEAN_RUN` (2/3 of requests then repeat the
  previous model). The weaker levels are derived from the same runs, so the share of
  consecutive requests is ordered L1 (0) <= L2 <= L3 = L4 for every seed.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

TRACE_VERSION = 1
MAX_FUNCTIONS = 100_000
MAX_REQUESTS = 1_000_000
MAX_TOKENS = 32_768
MAX_DURATION_S = 1e7
MAX_TRACE_JSON = 256 << 20  # characters: a million arrivals fit well within it
MEAN_RUN = 3.0  # mean length of the original runs of one model (an assumption: see above)
AZURE_KEEP_ALIVE_S = 1200.0  # Azure Functions' fixed 20-minute keep-alive (Shahrad et al.)
HOUR_S = 3600.0
MINUTE_S = 60.0


def _check_range(name: str, value: object, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}: expected a number, got {value!r}")
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ValueError(f"{name}: expected {lo} <= value <= {hi}, got {value!r}")
    return float(value)


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}: expected {lo} <= value <= {hi}, got {value!r}")
    return value


def _check_bounds(name: str, value: object) -> tuple[int, int]:
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise ValueError(f"{name}: expected (low, high), got {value!r}")
    lo = _check_int(f"{name}[0]", value[0], 1, MAX_TOKENS)
    hi = _check_int(f"{name}[1]", value[1], lo, MAX_TOKENS)
    return lo, hi


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of a trace."""

    t_s: float  # seconds from trace start (already time-scaled)
    function: int  # index into the function list (0 = most popular)
    prompt_tokens: int  # prompt length to send
    max_tokens: int  # output tokens to ask for


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """What :func:`generate` draws; validated on construction (``ValueError``)."""

    num_functions: int
    num_requests: int
    duration_s: float  # replay duration after scaling
    zipf_s: float = 1.5  # popularity skew: function i gets a share ~ (i + 1) ** -zipf_s
    burst_cv: float = 2.0  # inter-arrival CV within a function (> 1: bursty)
    prompt_tokens: tuple[int, int] = (16, 128)
    max_tokens: tuple[int, int] = (4, 32)
    seed: int = 0
    time_scale: float = 1.0  # trace seconds per replay second
    keep_alive_s: float = AZURE_KEEP_ALIVE_S  # in trace seconds

    def __post_init__(self) -> None:
        _check_int("num_functions", self.num_functions, 1, MAX_FUNCTIONS)
        _check_int("num_requests", self.num_requests, 0, MAX_REQUESTS)
        _check_range("duration_s", self.duration_s, 1e-3, MAX_DURATION_S)
        _check_range("zipf_s", self.zipf_s, 0.0, 10.0)
        _check_range("burst_cv", self.burst_cv, 0.05, 20.0)
        object.__setattr__(self, "prompt_tokens", _check_bounds("prompt_tokens", self.prompt_tokens))
        object.__setattr__(self, "max_tokens", _check_bounds("max_tokens", self.max_tokens))
        _check_int("seed", self.seed, 0, 2**63 - 1)
        _check_range("time_scale", self.time_scale, 1e-3, 1e6)
        _check_range("keep_alive_s", self.keep_alive_s, 1e-3, MAX_DURATION_S)
        object.__setattr__(self, "duration_s", float(self.duration_s))
        object.__setattr__(self, "time_scale", float(self.time_scale))
        object.__setattr__(self, "keep_alive_s", float(self.keep_alive_s))

    @property
    def trace_duration_s(self) -> float:
        """The span of the trace before compression."""
        return self.duration_s * self.time_scale

    @property
    def replay_keep_alive_s(self) -> float:
        """The keep-alive the replayed system should use (replay seconds)."""
        return self.keep_alive_s / self.time_scale


@dataclass(frozen=True, slots=True)
class Trace:
    """A generated trace: its config and its arrivals sorted by time."""

    config: TraceConfig
    arrivals: tuple[Arrival, ...]

    def to_json(self) -> str:
        """The versioned JSON encoding (arrivals as ``[t_s, function, prompt, max]`` rows)."""
        rows = [[a.t_s, a.function, a.prompt_tokens, a.max_tokens] for a in self.arrivals]
        return json.dumps({"v": TRACE_VERSION, "config": asdict(self.config), "arrivals": rows})

    @staticmethod
    def from_json(text: str) -> Trace:
        """A trace from :meth:`to_json`'s encoding; ``ValueError`` naming what is wrong."""
        if len(text) > MAX_TRACE_JSON:
            raise ValueError(f"trace JSON longer than {MAX_TRACE_JSON} characters")
        try:
            data = json.loads(text)
        except RecursionError:  # nested deeper than the parser's stack: no trace is
            raise ValueError("trace JSON: nested too deeply") from None
        if not isinstance(data, dict) or set(data) != {"v", "config", "arrivals"}:
            raise ValueError("trace JSON: expected a map with keys v, config, arrivals")
        if type(data["v"]) is not int or data["v"] != TRACE_VERSION:
            raise ValueError(f"trace version {data['v']!r} is not supported (this reads {TRACE_VERSION})")
        raw = data["config"]
        if not isinstance(raw, dict):
            raise ValueError("trace JSON: config must be a map")
        try:
            config = TraceConfig(**raw)
        except TypeError as exc:
            raise ValueError(f"trace JSON: config: {exc}") from None
        rows = data["arrivals"]
        if not isinstance(rows, list) or len(rows) != config.num_requests:
            raise ValueError(f"trace JSON: expected {config.num_requests} arrivals")
        arrivals = tuple(_arrival(row, config) for row in rows)
        if any(b.t_s < a.t_s for a, b in itertools.pairwise(arrivals)):
            raise ValueError("trace JSON: arrivals are not sorted by time")
        return Trace(config, arrivals)


def _arrival(row: object, config: TraceConfig) -> Arrival:
    if not isinstance(row, list) or len(row) != 4:
        raise ValueError(f"trace JSON: arrival {row!r} is not [t_s, function, prompt, max]")
    t = _check_range("arrival t_s", row[0], 0.0, config.duration_s)
    function = _check_int("arrival function", row[1], 0, config.num_functions - 1)
    prompt = _check_int("arrival prompt_tokens", row[2], *config.prompt_tokens)
    out = _check_int("arrival max_tokens", row[3], *config.max_tokens)
    return Arrival(t, function, prompt, out)


def zipf_counts(total: int, n: int, s: float) -> list[int]:
    """``total`` split over ``n`` ranks in proportion to ``(i + 1) ** -s``: exact sum,
    non-increasing (largest remainder, ties to the more popular rank)."""
    weights = np.arange(1, n + 1, dtype=np.float64) ** -s
    ideal = total * weights / weights.sum()
    counts = np.floor(ideal).astype(np.int64)
    short = total - int(counts.sum())
    order = np.lexsort((np.arange(n), -(ideal - counts)))  # largest remainder first
    counts[order[:short]] += 1
    return [int(c) for c in np.sort(counts)[::-1]]


def _gamma_gaps(rng: np.random.Generator, cv: float, n: int, mean: float = 1.0) -> np.ndarray:
    """``n`` Gamma inter-arrival times of mean ``mean`` and coefficient of variation ``cv``."""
    shape = 1.0 / (cv * cv)
    return rng.gamma(shape, mean / shape, n)


def generate(config: TraceConfig) -> Trace:
    """The trace ``config`` describes (see the module docstring); same config, same trace."""
    rng = np.random.default_rng(config.seed)
    counts = zipf_counts(config.num_requests, config.num_functions, config.zipf_s)
    times: list[np.ndarray] = []
    functions: list[np.ndarray] = []
    for function, count in enumerate(counts):
        if count == 0:
            continue
        gaps = _gamma_gaps(rng, config.burst_cv, count + 1)
        # Conditioned on the trace's length: c + 1 gaps fill it, the last one runs past the end.
        t = np.cumsum(gaps)[:count] / gaps.sum() * config.duration_s
        times.append(np.minimum(t, np.nextafter(config.duration_s, 0.0)))
        functions.append(np.full(count, function, dtype=np.int64))
    if not times:
        return Trace(config, ())
    t_all = np.concatenate(times)
    f_all = np.concatenate(functions)
    order = np.lexsort((f_all, t_all))
    n = len(order)
    lo, hi = config.prompt_tokens
    # Prompt lengths log-uniform over the bounds: short prompts are the common case.
    prompts = np.floor(np.exp(rng.uniform(math.log(lo), math.log(hi + 1), n))).astype(np.int64)
    prompts = np.clip(prompts, lo, hi)
    outs = rng.integers(config.max_tokens[0], config.max_tokens[1] + 1, n)
    arrivals = tuple(
        Arrival(float(t_all[i]), int(f_all[i]), int(prompts[k]), int(outs[k])) for k, i in enumerate(order)
    )
    return Trace(config, arrivals)


def _cv(values: np.ndarray) -> float:
    mean = float(values.mean()) if len(values) else 0.0
    return float(values.std()) / mean if mean > 0 else 0.0


def summary(trace: Trace) -> dict[str, Any]:
    """What the trace looks like, in the terms of the module docstring's figures.

    ``top20_share``: share of requests of the most popular ``ceil(20 %)`` of functions;
    ``le_once_per_hour`` / ``le_once_per_minute``: fraction of functions whose mean rate over
    the trace (in trace time) is at most that; ``iat_cv_median`` and ``iat_cv_gt1``: per
    function (those with >= 3 requests); ``gaps_over_keep_alive``: fraction of the gaps
    between a function's consecutive requests longer than the replay keep-alive (each one is
    a cold start under a fixed keep-alive), ``cold_starts`` counts those plus first requests.
    """
    config = trace.config
    n = config.num_functions
    counts = [0] * n
    per_function: list[list[float]] = [[] for _ in range(n)]
    for a in trace.arrivals:
        counts[a.function] += 1
        per_function[a.function].append(a.t_s)
    total = sum(counts)
    top = max(1, math.ceil(0.2 * n))
    rates = [c / config.trace_duration_s for c in counts]
    cvs = []
    gaps_total = 0
    gaps_long = 0
    max_gap = 0.0
    keep_alive = config.replay_keep_alive_s
    for times in per_function:
        gaps = np.diff(np.asarray(times))
        gaps_total += len(gaps)
        gaps_long += int((gaps > keep_alive).sum())
        if len(gaps):
            max_gap = max(max_gap, float(gaps.max()))
        if len(times) >= 3:
            cvs.append(_cv(gaps))
    return {
        "num_functions": n,
        "num_requests": total,
        "per_function": counts,
        "top20_share": sum(sorted(counts, reverse=True)[:top]) / total if total else 0.0,
        "le_once_per_hour": sum(r <= 1 / HOUR_S for r in rates) / n,
        "le_once_per_minute": sum(r <= 1 / MINUTE_S for r in rates) / n,
        "iat_cv_median": float(np.median(cvs)) if cvs else 0.0,
        "iat_cv_gt1": sum(cv > 1 for cv in cvs) / len(cvs) if cvs else 0.0,
        "gaps_over_keep_alive": gaps_long / gaps_total if gaps_total else 0.0,
        "cold_starts": gaps_long + sum(c > 0 for c in counts),
        "max_gap_s": max_gap,
        "replay_keep_alive_s": keep_alive,
    }


class Locality(enum.Enum):
    """Tangram's locality levels (§5.1): the arrival CV, and how runs are thinned."""

    L1 = "L1"  # CV 0.25, no consecutive requests to one model
    L2 = "L2"  # CV 0.5, consecutive runs halved
    L3 = "L3"  # CV 1, the original runs
    L4 = "L4"  # CV 2, the runs as they are

    @property
    def cv(self) -> float:
        """The coefficient of variation of the level's Gamma inter-arrival times."""
        return {"L1": 0.25, "L2": 0.5, "L3": 1.0, "L4": 2.0}[self.value]


def _base_runs(rng: np.random.Generator, num_models: int, length: int) -> list[tuple[int, int]]:
    """``length`` (model, run length) pairs, each model different from the previous one:
    enough for ``length`` requests even when every run is cut to one request (L1)."""
    p = np.arange(1, num_models + 1, dtype=np.float64) ** -1.0
    p /= p.sum()
    runs: list[tuple[int, int]] = []
    previous = -1
    while len(runs) < length:
        model = int(rng.choice(num_models, p=p))
        if model == previous and num_models > 1:
            continue  # redraw: runs of one model are the run lengths' business
        run = int(rng.geometric(1.0 / MEAN_RUN))  # >= 1, mean MEAN_RUN
        runs.append((model, run))
        previous = model
    return runs


def locality_sequence(num_models: int, level: Locality, length: int, seed: int = 0) -> list[int]:
    """``length`` model indices (0 = most popular) with ``level``'s run structure."""
    _check_int("num_models", num_models, 1, MAX_FUNCTIONS)
    _check_int("length", length, 0, MAX_REQUESTS)
    if num_models == 1 and level is Locality.L1 and length > 1:
        raise ValueError("L1 needs at least two models (no request may repeat the previous model)")
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for model, original in _base_runs(rng, num_models, length):
        if level is Locality.L1:
            run = 1
        elif level is Locality.L2:
            run = math.ceil(original / 2)
        else:
            run = original
        out.extend([model] * run)
        if len(out) >= length:
            break
    return out[:length]


def locality_arrivals(level: Locality, length: int, mean_gap_s: float = 1.0, seed: int = 0) -> list[float]:
    """``length`` arrival times (seconds from 0) with Gamma gaps of ``level``'s CV."""
    _check_int("length", length, 0, MAX_REQUESTS)
    _check_range("mean_gap_s", mean_gap_s, 1e-9, MAX_DURATION_S)
    rng = np.random.default_rng(seed)
    return [float(t) for t in np.cumsum(_gamma_gaps(rng, level.cv, length, mean_gap_s))]


def consecutive_share(sequence: list[int]) -> float:
    """Fraction of requests (after the first) that ask for the same model as the one before."""
    if len(sequence) < 2:
        return 0.0
    return sum(a == b for a, b in itertools.pairwise(sequence)) / (len(sequence) - 1)
