"""``python -m runtime``: a worker process (what the node agent starts for its pre-warmed pool).

The worker's credential is the first line of its stdin (the agent writes it there: argv and
the environment are readable by other processes through ``/proc``). First of all the worker
applies its resource limits and drops its capabilities (:mod:`runtime.worker_limits`); then,
with ``--sandbox-home``, it confines its reads and writes with Landlock (:mod:`runtime.sandbox`).
Both happen while it has a single thread and before torch is imported, so no handler code ever
runs unconfined.
"""

from __future__ import annotations

import argparse
import sys

from runtime.http_server import HeaderLimits
from runtime.worker_guard import DEFAULT_MAX_BODY_BYTES, GuardConfig
from runtime.worker_limits import DEFAULT_OPEN_FILES, LimitsError, WorkerLimits, apply_limits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime", description="An Ember worker process.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed when ready)")
    parser.add_argument("--preload", action="append", default=[], help="registered model directory")
    parser.add_argument("--premap", action="append", default=[], help="pool socket whose arena to map early")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process dies")
    parser.add_argument(
        "--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger request bodies get 413"
    )
    parser.add_argument(
        "--sandbox-home",
        default=None,
        help="EMBER_HOME to hide from handlers (Landlock; see runtime.sandbox)",
    )
    parser.add_argument(
        "--require-sandbox", action="store_true", help="refuse to start where Landlock is unavailable"
    )
    parser.add_argument("--max-open-files", type=int, default=DEFAULT_OPEN_FILES, help="RLIMIT_NOFILE")
    parser.add_argument("--max-data", default="unlimited", help="RLIMIT_DATA: bytes, or 'unlimited'")
    parser.add_argument(
        "--keep-capabilities", action="store_true", help="do not drop the capabilities of a root worker"
    )
    parser.add_argument(
        "--mesh-fd", type=int, default=None, help="socketpair end for the agent's token scheduler"
    )
    parser.add_argument("--mesh-page-fd", type=int, default=None, help="memfd of its state page")
    parser.add_argument(
        "--control-fd", type=int, default=None, help="socketpair end of the agent's control line"
    )
    parser.add_argument(
        "--survive-pool-loss",
        action="store_true",
        help="when the pool dies, end the instance but wait to be assigned its function again",
    )
    args = parser.parse_args(argv)
    try:
        guard = GuardConfig.from_env(sys.stdin.readline(4096).strip(), args.max_body_bytes)
    except ValueError as exc:
        parser.error(f"stdin must carry the worker's credential: {exc}")
    try:
        headers = HeaderLimits.from_env()  # the gateway's header bounds (the agent's environment)
        data = None if args.max_data == "unlimited" else int(args.max_data)
        limits = WorkerLimits(args.max_open_files, data, not args.keep_capabilities)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        print(f"worker limits: {apply_limits(limits)}", file=sys.stderr, flush=True)  # the worker's log
    except LimitsError as exc:
        print(f"worker limits: {exc}", file=sys.stderr, flush=True)
        return 1
    from runtime.process import exit_with_parent, set_idle_priority

    if args.parent_pid is not None:
        exit_with_parent(args.parent_pid)
    layer = None
    if args.sandbox_home is not None:
        from pathlib import Path

        from runtime.sandbox import FunctionLayer, SandboxConfig, SandboxError, apply

        config = SandboxConfig(required=args.require_sandbox)
        try:
            # Gathered first: the first layer makes the functions root's ancestors unlistable.
            layer = FunctionLayer.prepare(Path(args.sandbox_home), config)
            report = apply(Path(args.sandbox_home), config)
        except SandboxError as exc:
            print(f"worker sandbox: {exc}", file=sys.stderr, flush=True)
            return 1
        print(f"worker sandbox: {report}", file=sys.stderr, flush=True)  # the worker's log
    set_idle_priority(True)  # until assigned: import and warm up only on cores instances leave free
    import runtime.models.llama  # noqa: F401  (imported now so an assignment does not pay for it)
    from runtime.worker import serve

    serve(
        args.host,
        args.port,
        args.preload,
        premap=args.premap,
        guard=guard,
        headers=headers,
        function_layer=layer,
        mesh_fd=args.mesh_fd,
        mesh_page_fd=args.mesh_page_fd,
        survive_pool_loss=args.survive_pool_loss,
        control_fd=args.control_fd,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
