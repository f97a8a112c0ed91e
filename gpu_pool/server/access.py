"""Who may do what in a pool: admin sessions, KV tickets and per-session KV quotas.

The daemon may be started with an admin token (``--admin-token-file`` or
``EMBER_POOL_ADMIN_TOKEN``; :class:`gpu_pool.spawn.PoolProcess` makes one and hands it over
on the daemon's stdin, never in argv). A ``hello`` that presents it (compared in constant
time) makes its session an admin: admins may ``evict`` and ``grant``, and hold KV blocks
without limit. ``grant`` returns a random single-use ticket with a KV quota; the session
whose ``hello`` presents the ticket gets that quota, and the ticket is gone. Other sessions
get the daemon's default quota (``EMBER_POOL_SESSION_KV_QUOTA``; by default unlimited when the
daemon has no admin token, since nobody could grant anything, and 0 otherwise).
Outstanding tickets are bounded: granting past the bound drops the oldest unused ticket.
"""

from __future__ import annotations

import hmac
import secrets
from collections import OrderedDict
from dataclasses import dataclass

from gpu_pool.arena.kv_memory import SessionKV
from gpu_pool.errors import Forbidden, KVQuotaExceeded
from gpu_pool.manifest import Manifest


@dataclass(slots=True)
class Session:
    """One connection's identity and KV state (mutable: hello upgrades it)."""

    session_id: str
    kv_quota: int | None  # bytes; None: unlimited
    admin: bool = False
    ticketed: bool = False
    kv: SessionKV | None = None  # CPU pools: the session's private KV pages
    kv_sent: bool = False  # whether the client has received kv's descriptor
    prefix_scope: str = ""  # whose published prefix KV it shares (gpu_pool.server.prefix_kv)
    acquired: Manifest | None = None  # its last acquire's manifest, as parsed (for reacquire)


class AccessControl:
    """The admin token, outstanding tickets and the default quota of one daemon."""

    def __init__(self, admin_token: str | None, default_kv_quota: int | None, max_tickets: int) -> None:
        self._admin_token = admin_token
        self.default_kv_quota = default_kv_quota
        self.max_tickets = max_tickets
        self._tickets: OrderedDict[str, tuple[int, str]] = OrderedDict()  # ticket -> quota, scope

    def new_session(self, session_id: str) -> Session:
        """A session before its hello: default quota, no admin rights."""
        return Session(session_id, self.default_kv_quota)

    def authenticate(self, session: Session, admin_token: str | None, ticket: str | None) -> None:
        """Apply a hello's credentials; a wrong token or unknown ticket is refused."""
        if admin_token is not None:
            expected = self._admin_token
            # Constant time in the token's bytes: no timing oracle for guessing it.
            if expected is None or not hmac.compare_digest(admin_token.encode(), expected.encode()):
                raise Forbidden("hello: the admin token is wrong (or this pool has none)")
            session.admin = True
            session.kv_quota = None
        if ticket is not None:
            if session.ticketed:
                raise Forbidden("hello: this session already redeemed a ticket")
            granted = self._tickets.pop(ticket, None)
            if granted is None:
                raise Forbidden("hello: unknown or already used ticket")
            session.ticketed = True
            quota, session.prefix_scope = granted
            if not session.admin:
                session.kv_quota = quota

    def require_prefix_scope(self, session: Session, op: str) -> None:
        """Raise :class:`Forbidden` when a session of a managed pool (one with an admin token: an
        agent or node daemon hands out tickets) has no ticket naming a prefix scope: published
        prefix KV is shared within one function only, or a worker running one function's code
        could plant KV that another function's prompts would restore. A pool run by hand without
        an admin token is single-tenant: its sessions share the pool-wide scope."""
        if self._admin_token is not None and not session.prefix_scope:
            raise Forbidden(
                f"{op}: prefix KV is shared within one function; this session's ticket names none"
            )

    def require_admin(self, session: Session, op: str) -> None:
        """Raise :class:`Forbidden` unless the session presented the admin token."""
        if not session.admin:
            raise Forbidden(f"{op} is an admin operation: say hello with the pool's admin token")

    def grant(self, session: Session, kv_quota_bytes: int, prefix_scope: str | None = None) -> str:
        """A new single-use ticket for ``kv_quota_bytes`` of KV blocks (admin only); the session
        that redeems it shares published prefix KV within ``prefix_scope`` only (e.g. one
        function's instances; None: the pool-wide scope of sessions without a ticket)."""
        self.require_admin(session, "grant")
        ticket = secrets.token_urlsafe(24)
        self._tickets[ticket] = (kv_quota_bytes, "" if prefix_scope is None else f"~{prefix_scope}")
        while len(self._tickets) > self.max_tickets:
            self._tickets.popitem(last=False)
        return ticket

    @staticmethod
    def check_kv_quota(session: Session, used: int, requested: int) -> None:
        """Raise :class:`KVQuotaExceeded` if ``used + requested`` passes the session's quota."""
        if session.kv_quota is not None and used + requested > session.kv_quota:
            raise KVQuotaExceeded(session.kv_quota, used, requested)
