"""The agent's side of token-level scheduling: one :class:`DeviceGrants` per device.

Each instance on the device talks to it over its worker's socketpair (:mod:`runtime.mesh.wire`).
A grant that runs longer than ``max_iteration_s`` (a worker stuck or stopped) is taken back so
the device does not stall; that worker's late DONE is ignored. A socket that closes or sends a
malformed message removes its instance from the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

from runtime.mesh.admission import InstanceView, admit
from runtime.mesh.config import TokenSchedulingConfig
from runtime.mesh.shadow import Case, Verdict
from runtime.mesh.token_scheduler import TokenScheduler
from runtime.mesh.wire import SIZE, Message, Op, WireError, decode, encode

log = logging.getLogger("ember.agent")
CASES = tuple(Case)  # a verdict's number is its case's position here, plus one
# Messages taken from one worker per wake-up: a worker refilling its socket as fast as the
# agent drains it (tenant code runs there) must not hold the agent's event loop; the rest
# are read on the next turn of the loop (the reader is level-triggered).
MAX_BATCH = 64
# ... and at most this long: an ADMIT runs a shadow validation (milliseconds with full pages).
MAX_BATCH_S = 0.005


def _case_number(verdict: Verdict) -> float:
    assert verdict.case is not None
    return float(CASES.index(verdict.case) + 1)


class DeviceGrants:
    """Token-level grants of one device (see the module docstring)."""

    def __init__(self, device: str, config: TokenSchedulingConfig | None = None) -> None:
        self.device = device
        self.config = config or TokenSchedulingConfig(enabled=True)
        self.scheduler = TokenScheduler(max_passed_over=self.config.max_passed_over)
        self._socks: dict[str, socket.socket] = {}
        self._views: dict[str, InstanceView] = {}
        self.num_admitted = 0
        self.num_refused = 0
        self._overdue: asyncio.TimerHandle | None = None

    @property
    def instance_ids(self) -> list[str]:
        return list(self._socks)

    def attach(self, instance_id: str, sock: socket.socket, view: InstanceView) -> None:
        """Schedule ``instance_id``, whose worker holds the other end of ``sock``; ``view`` is
        what its admissions are validated with."""
        sock.setblocking(False)
        self._socks[instance_id] = sock
        self._views[instance_id] = view
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable, instance_id)

    def detach(self, instance_id: str, cut_off: bool = False) -> None:
        """The instance ended (its socket stays open: the worker handle owns it). ``cut_off``:
        it still runs, but its token scheduling ends (a malformed message, a send that
        failed): the socket is shut down so that its gate learns it and the instance runs on
        its own, instead of waiting for a grant nobody will send."""
        sock = self._socks.pop(instance_id, None)
        self._views.pop(instance_id, None)
        if sock is not None:
            asyncio.get_running_loop().remove_reader(sock.fileno())
            if cut_off:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        if self.scheduler.running == instance_id and self._overdue is not None:
            self._overdue.cancel()
            self._overdue = None
        self.scheduler.leave(instance_id)
        self._dispatch()

    def close(self) -> None:
        for instance_id in list(self._socks):
            self.detach(instance_id)

    def _readable(self, instance_id: str) -> None:
        sock = self._socks.get(instance_id)
        if sock is None:
            return
        until = time.monotonic() + MAX_BATCH_S
        try:
            for _ in range(MAX_BATCH):
                if time.monotonic() > until:
                    break
                try:
                    raw = sock.recv(SIZE)
                except BlockingIOError:
                    break
                if not raw:
                    raise ConnectionError("closed")
                self._handle(instance_id, decode(raw))
                if self._socks.get(instance_id) is not sock:  # cut off meanwhile (a failed send)
                    return
        except (OSError, WireError, ValueError) as exc:
            log.warning("token scheduling of %s on %s ends: %s", instance_id, self.device, exc)
            self.detach(instance_id, cut_off=True)
            return
        self._dispatch()

    def _handle(self, instance_id: str, message: Message) -> None:
        s = self.scheduler
        if message.op is Op.WANT:
            if s.running == instance_id:  # it gave its lease back without saying so: fine
                self._done(instance_id)
            if s.want(instance_id, message.value) and s.running is not None:
                self._send(s.running, Message(Op.YIELD))
                self._arm(s.running)  # the lease holder now has one iteration left
        elif message.op is Op.DONE:
            if s.running == instance_id:  # else: a grant taken back for running too long
                self._done(instance_id)
        elif message.op is Op.ADMIT:
            verdict = admit(self._views, instance_id, int(message.value), time.monotonic())
            if verdict.admit:
                self.num_admitted += 1
            else:
                self.num_refused += 1
            self._send(instance_id, Message(Op.VERDICT, 0.0 if verdict.admit else _case_number(verdict)))
        else:
            raise WireError(f"a worker may not send {message.op.name}")

    def _done(self, instance_id: str) -> None:
        self.scheduler.done(instance_id)
        if self._overdue is not None:
            self._overdue.cancel()
            self._overdue = None

    def _dispatch(self) -> None:
        granted = self.scheduler.grant()
        if granted is None:
            return
        self._send(granted, Message(Op.GRANT, 1.0 if self.scheduler.leased else 0.0))
        if not self.scheduler.leased:
            self._arm(granted)

    def _arm(self, instance_id: str) -> None:
        if self._overdue is not None:
            self._overdue.cancel()
        loop = asyncio.get_running_loop()
        self._overdue = loop.call_later(self.config.max_iteration_s, self._take_back, instance_id)

    def _take_back(self, instance_id: str) -> None:
        self._overdue = None
        if self.scheduler.running == instance_id:
            limit = self.config.max_iteration_s
            log.warning("%s held %s for over %.0f s: taken back", instance_id, self.device, limit)
            self.scheduler.done(instance_id)
            self._dispatch()

    def _send(self, instance_id: str, message: Message) -> None:
        sock = self._socks.get(instance_id)
        if sock is None:
            return
        try:
            sock.send(encode(message))
        except OSError as exc:
            log.warning("token scheduling of %s on %s ends: %s", instance_id, self.device, exc)
            self.detach(instance_id, cut_off=True)
