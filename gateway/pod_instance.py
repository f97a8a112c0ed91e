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

A pod that is SIGKILLed (OOM kill, node loss) never removes its record, so the record expires
in Redis after ``ttl_s`` unless the worker's heartbeat (:meth:`refresh`) renews it. A record
lost while the pod still serves (it expired while Redis was unreachable) is written again,
whole and under the same id, by the next refresh or transition.

Implements :class:`runtime.knative_worker.InstanceReporter`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING

from scheduler.errors import StateConflict

if TYPE_CHECKING:
    from runtime.knative_worker import Revision
    from scheduler.state import ClusterState

NEVER_EXPIRES = 2**52  # epoch seconds: the deadline of an instance Knative ends, not keep-alive


class PodInstanceRecord:
    """One pod's expiring instance record; owns ``state`` (closed by :meth:`gone`).

    Thread-safe: the heartbeat refreshes from its own thread while the worker transitions."""

    def __init__(
        self, state: ClusterState, function_id: str, instance_id: str, device: str, ttl_s: float,
        created: float,
    ) -> None:  # fmt: skip
        self.state = state
        self.function_id = function_id
        self.instance_id = instance_id
        self.ttl_s = ttl_s
        # The whole record as this pod last wrote it: what a lost record is rewritten with.
        self._fields: dict[str, str | int | float] = {
            "v": "1", "function": function_id, "state": "starting", "device": device, "url": "",
            "in_flight": 0, "deadline": 0, "created": created,
        }  # fmt: skip
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def create(cls, state: ClusterState, function_id: str, device: str, ttl_s: float) -> PodInstanceRecord:
        """Record a ``starting`` instance of ``function_id`` on ``device``, expiring after ``ttl_s``."""
        now = time.time()
        instance_id = state.add_instance(function_id, device, now, ttl_s)
        return cls(state, function_id, instance_id, device, ttl_s, now)

    def _move(self, from_state: str, to_state: str, **fields: str | int | float) -> None:
        """The transition, or (the record was lost) the record rewritten in ``to_state``."""
        with self._lock:
            try:
                self.state.transition(self.instance_id, from_state, to_state, **fields)
            except StateConflict:
                if self._fields["state"] != from_state:
                    raise  # a transition out of order: not a lost record
                moved = {**self._fields, **fields, "state": to_state}
                if self.state.refresh_instance(self.function_id, self.instance_id, self.ttl_s, moved):
                    raise  # the record is there, in another state: not ours to overwrite
                self._fields = moved
            else:
                self._fields.update(fields, state=to_state)

    def ready(self, url: str, revision: Revision) -> None:
        self._move("starting", "ready", url=url, deadline=NEVER_EXPIRES, **revision.fields())

    def draining(self) -> None:
        # Never became ready, or already draining: gone() removes it all the same.
        with contextlib.suppress(StateConflict):
            self._move("ready", "draining")

    def refresh(self) -> bool:
        """Renew the record's TTL (the heartbeat); False when it had to be written again."""
        with self._lock:
            if self._closed:
                return True
            return self.state.refresh_instance(self.function_id, self.instance_id, self.ttl_s, self._fields)

    def gone(self) -> None:
        with self._lock:
            self._closed = True
            try:
                self.state.forget_instance(self.function_id, self.instance_id)
            finally:
                self.state.close()
