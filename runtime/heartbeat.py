"""The heartbeat that keeps a Knative pod's instance record alive in the cluster state.

The record expires unless renewed (:class:`gateway.pod_instance.PodInstanceRecord`), so a pod
that is SIGKILLed, OOM-killed or lost with its node leaves no record behind. The heartbeat is a
thread, not a task on the worker's event loop: it must also beat while the loop waits for the
node's pool or builds the engine, and a slow Redis (the state's calls retry for seconds) must
never hold up requests. It renews every ``period_s``; the record's TTL is a multiple of that,
so one or two missed beats (a Redis failover) do not drop the record of a pod that serves.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("ember.worker")


class Heartbeat:
    """Calls ``beat`` every ``period_s`` seconds in a daemon thread until :meth:`stop`.

    ``beat`` returns False when the record was lost and had to be written again (logged); an
    exception is logged and the next beat tries again."""

    def __init__(self, beat: Callable[[], bool], period_s: float) -> None:
        if not period_s > 0:
            raise ValueError(f"a heartbeat period must be more than 0 s, got {period_s}")
        self._beat = beat
        self._period_s = period_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ember-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._period_s):
            try:
                if not self._beat():
                    log.warning("the instance's record had expired: written again")
            except Exception as exc:  # Redis away: the record lives on until its TTL runs out
                log.warning("could not renew the instance's record: %s", exc)

    def stop(self, timeout_s: float) -> None:
        """No more beats; waits up to ``timeout_s`` for one in progress to end."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
