"""Workers' resource limits and capabilities (issue 10): every worker the agent starts has no
core dumps, bounded descriptors, an optional private-memory ceiling and, as root, no
capabilities; it still leaves SCHED_IDLE when assigned and serves. Read from the real worker
processes (``/proc/<pid>/limits``, ``/proc/<pid>/status``)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import pytest

from runtime.agent import NodeAgent
from runtime.worker_guard import TOKEN_HEADER
from runtime.worker_limits import WorkerLimits
from tests.runtime.test_agent_workers import agent_config, spec, wait_warm
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf

CAP_CHOWN, CAP_SETPCAP = 0, 8

HANDLER = """
import os
import resource


def _try(action):
    try:
        action()
        return "ok"
    except (OSError, ValueError, MemoryError) as exc:
        return type(exc).__name__


def handler(event, context):
    return {
        "allocate": _try(lambda: bytearray(event["allocate"])),
        "chown": _try(lambda: os.chown(event["own_file"], 4321, 4321)),
        "read other uid": _try(lambda: open(event["other_uid_file"]).read()),
        "core dumps": _try(lambda: resource.setrlimit(resource.RLIMIT_CORE, (1 << 20, 1 << 20))),
    }
"""


def limits_of(pid: int) -> dict[str, tuple[str, str]]:
    lines = Path(f"/proc/{pid}/limits").read_text().splitlines()[1:]
    return {line[:26].strip(): (line[26:47].strip(), line[47:68].strip()) for line in lines}


def status_of(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def test_config_from_env_is_validated() -> None:
    assert WorkerLimits.from_env({}) == WorkerLimits(4096, None, True)
    env = {
        "EMBER_WORKER_MAX_OPEN_FILES": "1000",
        "EMBER_WORKER_MAX_DATA": "8GiB",
        "EMBER_WORKER_DROP_CAPS": "off",
    }
    limits = WorkerLimits.from_env(env)
    assert limits == WorkerLimits(1000, 8 << 30, False)
    assert limits.args() == ["--max-open-files", "1000", "--max-data", str(8 << 30), "--keep-capabilities"]
    for bad in (
        {"EMBER_WORKER_MAX_OPEN_FILES": "lots"},
        {"EMBER_WORKER_MAX_OPEN_FILES": "10"},
        {"EMBER_WORKER_MAX_DATA": "1MiB"},
        {"EMBER_WORKER_MAX_DATA": "plenty"},
        {"EMBER_WORKER_DROP_CAPS": "yes"},
    ):
        with pytest.raises(ValueError):
            WorkerLimits.from_env(bad)


@pytest.mark.slow
def test_workers_run_limited_without_capabilities_and_still_serve(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", hf_weights(3))
    home = tmp_path / "home"
    module = home / "functions" / "default" / "limited" / "d1" / "limited.py"
    module.parent.mkdir(parents=True)
    module.write_text(HANDLER)
    elsewhere = tmp_path / "elsewhere"  # made before the workers start (see runtime.sandbox)
    elsewhere.mkdir()
    own_file, other_uid_file = elsewhere / "own", elsewhere / "other-uid"
    own_file.write_text("mine")
    other_uid_file.write_text("someone else's")
    other_uid_file.chmod(0o600)
    own_caps = int(status_of(os.getpid())["CapEff"], 16)
    chowned = bool(own_caps >> CAP_CHOWN & 1)
    if chowned:  # (root) a file of another uid, which only CAP_DAC_OVERRIDE would let a worker read
        os.chown(other_uid_file, 4321, 4321)
    limits = WorkerLimits(max_open_files=1000, max_data_bytes=3 << 30)

    async def scenario() -> None:
        agent = NodeAgent(agent_config(home, prewarm=1, limits=limits))
        try:
            await agent.start()
            model = await agent.ensure_model(str(tmp_path / "tiny.gguf"), "float32")
            ((pid, _),) = await wait_warm(agent, 1)
            seen = limits_of(pid)
            assert seen["Max core file size"] == ("0", "0")
            assert seen["Max open files"] == ("1000", "1000")
            assert seen["Max data size"] == (str(3 << 30), str(3 << 30))
            assert seen["Max processes"] == limits_of(os.getpid())["Max processes"]  # per-uid: untouched
            status = status_of(pid)
            assert status["NoNewPrivs"] == "1"
            for caps in ("CapEff", "CapPrm", "CapInh", "CapAmb"):
                assert int(status[caps], 16) == 0, (caps, status[caps])
            if own_caps >> CAP_SETPCAP & 1:  # (root) the bounding set is emptied too
                assert int(status["CapBnd"], 16) == 0, status["CapBnd"]
                assert int(status_of(os.getpid())["CapEff"], 16) == own_caps  # the agent keeps its own
            document = spec("limited", {"source": str(tmp_path / "tiny.gguf")})
            document["spec"]["handler"] = f"{module}:handler"
            started = await agent.launch("1", document, model, agent.devices()[0], time.time() + 120)
            # Assigned: out of SCHED_IDLE (the agent moves it: the worker has no CAP_SYS_NICE).
            policies = {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{started.pid}/task")}
            assert policies == {os.SCHED_OTHER}, policies
            event = {"allocate": 4 << 30, "own_file": str(own_file), "other_uid_file": str(other_uid_file)}
            async with httpx.AsyncClient(base_url=started.url, timeout=60) as http:
                out = await http.post("/invoke", json=event, headers={TOKEN_HEADER: started.token})
                assert out.status_code == 200, out.text
                assert out.json() == {
                    "allocate": "MemoryError",  # beyond RLIMIT_DATA: refused, the worker lives on
                    "chown": "PermissionError",  # no CAP_CHOWN
                    # no CAP_DAC_OVERRIDE
                    "read other uid": "PermissionError" if chowned else "someone else's",
                    "core dumps": "ValueError",  # hard limit 0 and no CAP_SYS_RESOURCE: it stays
                }
                event["allocate"] = 64 << 20
                small = await http.post("/invoke", json=event, headers={TOKEN_HEADER: started.token})
                assert small.json()["allocate"] == "ok"
                body = {"prompt": "abc", "max_tokens": 2, "temperature": 0}
                ok = await http.post("/v1/completions", json=body, headers={TOKEN_HEADER: started.token})
                assert ok.status_code == 200, ok.text
        finally:
            await agent.close()

    asyncio.run(scenario())
