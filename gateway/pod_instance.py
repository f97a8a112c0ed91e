"""A Knative pod's own instance record in the cluster state (``ember worker --function``).

Knative, not Ember's router, starts and stops function pods, so each pod records itself:
``starting`` when its worker begins (:meth:`PodInstanceRecord.create`), ``ready`` with its
URL (``http://POD_IP:PORT``, "" without ``POD_IP``) and its Knative Service, Revision and
Configuration once it serves, ``draining`` at SIGTERM, and removed when it exits. The
record's device is ``<node>/cpu``, the device whose pool holds its tensors, so ``ember status``
shows which node serves a function. Its keep-alive deadline is never reached: Knative's
autoscaler ends these instances, and no router's keep-alive expiry may drain them. What is
written is only the record's own fields (:class:`scheduler.records.Instance`) and the three
Knative names: no credential.

Implements :class:`runtime.knative_worker.InstanceReporter`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from scheduler.errors import StateConflict

if TYPE_CHECKING:
    from runtime.knative_worker import Revision
    from scheduler.state import ClusterState

NEVER_EXPIRES = 2**52  # epoch seconds: the deadline of an instance Knative ends, not keep-alive


class PodInstanceRecord:
    """One pod's instance record; owns ``state`` (closed by :meth:`gone`)."""

    def __init__(self, state: ClusterState, function_id: str, instance_id: str) -> None:
        self.state = state
        self.function_id = function_id
        self.instance_id = instance_id

    @classmethod
    def create(cls, state: ClusterState, function_id: str, device: str) -> PodInstanceRecord:
        """Record a ``starting`` instance of ``function_id`` on ``device``."""
        return cls(state, function_id, state.add_instance(function_id, device))

    def ready(self, url: str, revision: Revision) -> None:
        self.state.transition(
            self.instance_id, "starting", "ready", url=url, deadline=NEVER_EXPIRES, **revision.fields()
        )

    def draining(self) -> None:
        with contextlib.suppress(StateConflict):  # never became ready: gone() removes it all the same
            self.state.transition(self.instance_id, "ready", "draining")

    def gone(self) -> None:
        try:
            self.state.forget_instance(self.function_id, self.instance_id)
        finally:
            self.state.close()
