"""Find ``ember serve``'s child processes through ``/proc`` (the fault suite and fault tests kill them)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def children(pid: int) -> dict[int, str]:
    """Live (not zombie) children of ``pid``: child pid -> command line."""
    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
            if int(fields[1]) == pid and fields[0] != "Z":
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    return out


def child_pids(pid: int, needle: str) -> list[int]:
    """Children of ``pid`` whose command line contains ``needle``."""
    return sorted(p for p, cmd in children(pid).items() if needle in cmd)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def kill(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid`` (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
