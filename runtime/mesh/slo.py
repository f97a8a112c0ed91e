"""Service-level objectives and a request's headroom (LLM-Mesh §5.1, Eq. 1).

A request that started at ``ST`` and has produced ``O`` tokens must produce its next one by
``ST + TTFT_SLO + TPOT_SLO * O``; its *headroom* at ``CT`` is that deadline minus ``CT``:
how long its next token may still wait. Negative headroom is an SLO violation. All times are
seconds on one monotonic clock (``time.monotonic()``: the same in every process of a node).
"""

from __future__ import annotations

from dataclasses import dataclass

# LLM-Mesh's default TTFT SLO grows with the prompt: max(2 s, input_len / 512 s) (DESIGN.md).
TTFT_TOKENS_PER_S = 512.0


@dataclass(frozen=True, slots=True)
class Slo:
    """A function's SLO: time to first token and time per output token, seconds."""

    ttft_s: float = 2.0
    tpot_s: float = 0.25

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO times must be > 0 seconds, got ttft {self.ttft_s}, tpot {self.tpot_s}")

    def ttft_for(self, input_len: int) -> float:
        """The TTFT SLO of a prompt of ``input_len`` tokens: the spec's, or longer for long prompts."""
        return max(self.ttft_s, input_len / TTFT_TOKENS_PER_S)


@dataclass(slots=True)
class RequestClock:
    """One request's progress against its SLO."""

    start_s: float  # ST: when the request arrived
    input_len: int  # prompt tokens
    slo: Slo
    tokens_out: int = 0  # O: tokens produced so far

    def deadline(self) -> float:
        """When the next token is due (Eq. 1 without ``- CT``)."""
        return self.start_s + self.slo.ttft_for(self.input_len) + self.slo.tpot_s * self.tokens_out

    def headroom(self, now: float) -> float:
        """Eq. 1: how long the next token may still wait at ``now`` (negative: SLO violated)."""
        return self.deadline() - now

    @property
    def prefilled(self) -> bool:
        return self.tokens_out > 0


def _seconds(text: object, field: str) -> float:
    """A duration as the function document writes it ("250ms", "2s": scheduler.spec's format)."""
    raw = str(text)
    try:
        value = float(raw[:-2]) / 1e3 if raw.endswith("ms") else float(raw.removesuffix("s"))
    except ValueError:
        raise ValueError(f"slo.{field}: {raw!r} is not a duration") from None
    if not 0 < value < 86400:
        raise ValueError(f"slo.{field} must be in (0, 86400) seconds, got {raw!r}")
    return value


def slo_of(spec: dict[str, object]) -> Slo:
    """The SLO of a function document (its ``spec.slo``; LLM-Mesh's defaults when absent)."""
    body = spec.get("spec")
    slo = body.get("slo") if isinstance(body, dict) else None
    if not isinstance(slo, dict):
        return Slo()
    return Slo(_seconds(slo.get("ttft", "2s"), "ttft"), _seconds(slo.get("tpot", "250ms"), "tpot"))
