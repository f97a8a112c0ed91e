"""Messages between a worker and its agent's token scheduler (one SOCK_SEQPACKET socketpair
per worker, made by the agent when it starts the worker: no path, no one else can speak on it).

Every message is 10 bytes: version (1 byte), op (1 byte), a little-endian double. ``WANT``
carries the deadline of the instance's most urgent request (monotonic seconds, Eq. 1);
``GRANT`` carries 1.0 when the grant is a lease (:mod:`runtime.mesh.token_scheduler`);
``ADMIT`` the prompt tokens of a request asking to join, ``VERDICT`` the answer (0: admitted,
else the number of the shadow validation's failed case); ``DONE`` and ``YIELD`` carry 0.
"""

from __future__ import annotations

import enum
import math
import struct
from typing import NamedTuple

VERSION = 1
_FORMAT = struct.Struct("<BBd")
SIZE = _FORMAT.size


class Op(enum.IntEnum):
    WANT = 1  # worker -> agent: run my next iteration (value: deadline)
    DONE = 2  # worker -> agent: my iteration is over / I give my lease back
    GRANT = 3  # agent -> worker: run it (value: 1.0 when leased)
    YIELD = 4  # agent -> worker: another instance waits; give the lease back after this iteration
    ADMIT = 5  # worker -> agent: may a request of this many prompt tokens join? (shadow validation)
    VERDICT = 6  # agent -> worker: 0 admitted, else the failed case (runtime.mesh.shadow.Case)


class WireError(ValueError):
    """A malformed message: the peer is not a well-behaved worker or agent."""


class Message(NamedTuple):
    op: Op
    value: float = 0.0


def encode(message: Message) -> bytes:
    return _FORMAT.pack(VERSION, message.op, message.value)


def decode(raw: bytes) -> Message:
    if len(raw) != SIZE:
        raise WireError(f"a token-scheduler message is {SIZE} bytes, got {len(raw)}")
    version, op, value = _FORMAT.unpack(raw)
    if version != VERSION:
        raise WireError(f"token-scheduler message version {version}, expected {VERSION}")
    try:
        kind = Op(op)
    except ValueError:
        raise WireError(f"unknown token-scheduler op {op}") from None
    if not math.isfinite(value):
        raise WireError("a token-scheduler value must be finite")
    return Message(kind, value)
