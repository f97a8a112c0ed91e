"""Admission of a request into a co-located instance: the agent's side of shadow validation.

The agent knows, for each instance on a device, its model's time table (materialized at
registration), its function's SLO and its state page (the requests it holds now,
:mod:`runtime.mesh.state_page`). :func:`admit` turns them into the device's shadow
(:mod:`runtime.mesh.shadow`) and validates the new request against it. An instance whose
model has no time table (registered before they existed) is not validated: it admits, and so
does a request on a device with no other request (refusing it would protect nobody).
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime.mesh.shadow import ShadowInstance, ShadowRequest, Verdict, validate
from runtime.mesh.slo import RequestClock, Slo, slo_of
from runtime.mesh.state_page import StatePage
from runtime.mesh.time_table import TimeTable

log = logging.getLogger("ember.agent")
DEFAULT_OUTPUT_TOKENS = 64  # expected output of a request before any has finished (LLM-Mesh's O-bar)


@dataclass(frozen=True, slots=True)
class InstanceView:
    """What the agent knows of one instance for its admissions."""

    page: StatePage
    table: TimeTable | None
    slo: Slo
    max_tokens: int  # the model's context: bounds what the page may claim


def instance_view(
    page: mmap.mmap, spec: dict[str, Any], profile: dict[str, Any], context: int
) -> InstanceView:
    """The view of an instance of ``spec`` (its function document) whose model has the CPU
    ``profile`` (its time table, when materialized) and ``context``; ``page`` maps its state
    page. A profile whose table does not decode counts as none (the instance admits)."""
    table = None
    if "time_table" in profile:
        try:
            table = TimeTable.from_json(profile["time_table"])
        except ValueError as exc:
            log.warning("%s: no admission control for this model: %s", spec.get("metadata"), exc)
    return InstanceView(StatePage(memoryview(page)), table, slo_of(spec), context)


def _shadow(instance_id: str, view: InstanceView, table: TimeTable) -> ShadowInstance:
    state = view.page.read(view.max_tokens)
    expected = state.avg_out or DEFAULT_OUTPUT_TOKENS
    requests = [
        ShadowRequest(
            RequestClock(e.arrival_s, max(e.input_len, 1), view.slo, e.tokens_out),
            max(1, round(expected - e.tokens_out)),
        )
        for e in state.entries
    ]
    return ShadowInstance(instance_id, table, requests, state.slowdown)


def admit(views: Mapping[str, InstanceView], target_id: str, prompt_tokens: int, now: float) -> Verdict:
    """Whether a request of ``prompt_tokens`` may join ``target_id`` on the device whose
    instances are ``views`` (:func:`runtime.mesh.shadow.validate`)."""
    target = views[target_id]
    if target.table is None:
        return Verdict(True)
    shadows = [_shadow(i, v, v.table) for i, v in views.items() if v.table is not None]
    if not any(s.requests for s in shadows):
        # Nobody else on the device: refusing protects no one, and the request runs as fast
        # as it can anyway (a table measured on a busy machine must not refuse everything).
        return Verdict(True)
    expected = target.page.read(target.max_tokens).avg_out or DEFAULT_OUTPUT_TOKENS
    new = ShadowRequest(RequestClock(now, max(prompt_tokens, 1), target.slo), max(1, round(expected)))
    return validate(shadows, target_id, new, now)
