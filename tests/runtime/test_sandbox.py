"""The worker sandbox (issue 10): a process confined by :func:`runtime.sandbox.apply` cannot
read ``EMBER_HOME``'s secrets but still reads models, function code, its temp dir and the
rest of the machine, and still writes files. Each case runs in a real child process
(Landlock is irreversible)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.sandbox import FunctionLayer, SandboxConfig, SandboxError, abi_version

REPO = Path(__file__).resolve().parents[2]

needs_landlock = pytest.mark.skipif(abi_version() == 0, reason="this kernel has no Landlock")

CHILD = r"""
import json, os, sys, tempfile
from pathlib import Path
from runtime.sandbox import apply

home, outside = Path(sys.argv[1]), Path(sys.argv[2])
report = apply(home)
seen = {"applied": report.applied}

def attempt(name, action):
    try:
        seen[name] = action()
    except OSError as exc:
        seen[name] = type(exc).__name__

attempt("serve.json", lambda: (home / "serve.json").read_text())
attempt("redis", lambda: (home / "redis" / "x").read_text())
attempt("logs", lambda: (home / "logs" / "functions" / "f.log").read_text())
attempt("list home", lambda: sorted(os.listdir(home)))
attempt("model", lambda: (home / "models" / "m").read_text())
attempt("function", lambda: (home / "functions" / "f").read_text())
attempt("outside", lambda: (outside / "data").read_text())
attempt("list outside", lambda: sorted(os.listdir(outside)))

def append():
    with open(outside / "appended", "a") as f:
        f.write("ran\n")
    return "ok"

attempt("append", append)

def temp():
    with tempfile.NamedTemporaryFile("w+") as f:
        f.write("temp")
        f.flush()
        return [os.path.dirname(f.name), Path(f.name).read_text()]

attempt("tempfile", temp)
print(json.dumps(seen))
"""


def make_home(tmp_path: Path) -> tuple[Path, Path]:
    home, outside = tmp_path / "home", tmp_path / "elsewhere"
    for directory in (
        home / "redis",
        home / "models",
        home / "functions",
        home / "logs" / "functions",
        outside,
    ):
        directory.mkdir(parents=True)
    for path, text in {
        home / "serve.json": '{"api_key": "admin"}',
        home / "redis" / "x": "aof",
        home / "logs" / "functions" / "f.log": "other function's log",
        home / "models" / "m": "weights",
        home / "functions" / "f": "code",
        outside / "data": "data",
    }.items():
        path.write_text(text)
    return home, outside


def run_child(home: Path, outside: Path) -> dict[str, object]:
    env = dict(os.environ, TMPDIR=str(home / "tmp"))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(home), str(outside)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    result: dict[str, object] = json.loads(out.stdout)
    return result


@needs_landlock
def test_confined_process_cannot_read_home_but_reads_and_writes_elsewhere(tmp_path: Path) -> None:
    home, outside = make_home(tmp_path)
    seen = run_child(home, outside)
    assert seen["applied"] is True
    for secret in ("serve.json", "redis", "logs", "list home"):
        assert seen[secret] == "PermissionError", (secret, seen)
    assert seen["model"] == "weights" and seen["function"] == "code"
    assert seen["outside"] == "data" and seen["list outside"] == ["data"]
    assert seen["append"] == "ok" and (outside / "appended").read_text() == "ran\n"
    assert seen["tempfile"] == [str((home / "tmp").resolve()), "temp"]
    assert (home / "tmp").stat().st_mode & 0o777 == 0o700
    assert (home / "serve.json").read_text() == '{"api_key": "admin"}'  # this process is not confined


@needs_landlock
def test_symlink_beside_home_does_not_open_it(tmp_path: Path) -> None:
    """A symlink next to EMBER_HOME pointing into it gets no rule of its own."""
    home, _ = make_home(tmp_path)
    (tmp_path / "shortcut").symlink_to(home)
    code = (
        "import sys; from pathlib import Path; from runtime.sandbox import apply; apply(Path(sys.argv[1]));"
    )
    code += "print(open(sys.argv[2]).read())"
    out = subprocess.run(
        [sys.executable, "-c", code, str(home), str(tmp_path / "shortcut" / "serve.json")],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode != 0 and "PermissionError" in out.stderr, out


@needs_landlock
def test_refuses_a_process_with_threads(tmp_path: Path) -> None:
    """Landlock binds only the calling thread and its later children: an older thread would stay free."""
    home, _ = make_home(tmp_path)
    code = "import sys, threading, time; from pathlib import Path; from runtime.sandbox import apply\n"
    code += "threading.Thread(target=time.sleep, args=(5,), daemon=True).start(); apply(Path(sys.argv[1]))"
    out = subprocess.run(
        [sys.executable, "-c", code, str(home)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode != 0 and "before any thread starts" in out.stderr, out.stderr


def test_config_from_env_is_validated() -> None:
    assert SandboxConfig.from_env({}) == SandboxConfig(enabled=True, required=False)
    assert SandboxConfig.from_env({"EMBER_WORKER_SANDBOX": "off"}).enabled is False
    assert SandboxConfig.from_env({"EMBER_REQUIRE_SANDBOX": "1"}).required is True
    for bad in ({"EMBER_WORKER_SANDBOX": "maybe"}, {"EMBER_REQUIRE_SANDBOX": "yes"}):
        with pytest.raises(ValueError, match="expected one of"):
            SandboxConfig.from_env(bad)
    with pytest.raises(ValueError, match="contradicts"):
        SandboxConfig.from_env({"EMBER_WORKER_SANDBOX": "off", "EMBER_REQUIRE_SANDBOX": "1"})


def test_function_layer_without_landlock_follows_the_config(tmp_path: Path) -> None:
    """A kernel without Landlock: the function layer fails if the sandbox is required, else the
    worker goes on unconfined (with a warning), as the first layer does."""
    root = tmp_path / "functions"
    own = root / "default" / "f"
    with pytest.raises(SandboxError, match="EMBER_REQUIRE_SANDBOX=1"):
        FunctionLayer(root, SandboxConfig(required=True), 0, None, 0).restrict(own)
    assert FunctionLayer(root, SandboxConfig(), 0, None, 0).restrict(own).applied is False
    off = FunctionLayer(root, SandboxConfig(enabled=False), 0, None, 0).restrict(own)
    assert off.applied is False and off.reason == "EMBER_WORKER_SANDBOX=off"
    layer = FunctionLayer(root, SandboxConfig(), 0, None, 0)
    assert layer.function_dir("team-a", "f") == root / "team-a" / "f"
    for namespace, name in (("..", "f"), ("default", "a/b"), ("", "f"), ("default", "x" * 64)):
        with pytest.raises(SandboxError, match="not a namespace and name"):
            layer.function_dir(namespace, name)


WRITER = r"""
import json, os, sys
from pathlib import Path
from runtime.sandbox import apply

home, outside = Path(sys.argv[1]), Path(sys.argv[2])
apply(home)
seen = {}

def attempt(name, action):
    try:
        action()
        seen[name] = "ok"
    except OSError as exc:
        seen[name] = type(exc).__name__

def append(path):
    with open(path, "a") as f:
        f.write("tampered")

attempt("append function", lambda: append(home / "functions" / "f"))
attempt("append model", lambda: append(home / "models" / "m"))
attempt("append serve.json", lambda: append(home / "serve.json"))
attempt("append aof", lambda: append(home / "redis" / "x"))
attempt("create in models", lambda: (home / "models" / "planted").write_text("x"))
attempt("remove function", lambda: os.unlink(home / "functions" / "f"))
attempt("rename model", lambda: os.rename(home / "models" / "m", home / "tmp" / "m"))
attempt("truncate model", lambda: os.truncate(home / "models" / "m", 0))
attempt("write tmp", lambda: (home / "tmp" / "t").write_text("x"))
attempt("rename in tmp", lambda: os.rename(home / "tmp" / "t", home / "tmp" / "u"))
attempt("write outside", lambda: (outside / "new").write_text("x"))
attempt("mkdir outside", lambda: (outside / "d").mkdir())
print(json.dumps(seen))
"""


@needs_landlock
def test_confined_process_cannot_write_home_but_writes_tmp_and_elsewhere(tmp_path: Path) -> None:
    """A handler could rewrite another function's module, the model store or the Redis AOF."""
    home, outside = make_home(tmp_path)
    (home / "tmp").mkdir()
    out = subprocess.run(
        [sys.executable, "-c", WRITER, str(home), str(outside)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    seen = json.loads(out.stdout)
    for denied in (
        "append function", "append model", "append serve.json", "append aof", "create in models",
        "remove function", "rename model", "truncate model",
    ):  # fmt: skip
        assert seen[denied] == "PermissionError", (denied, seen)
    for allowed in ("write tmp", "rename in tmp", "write outside", "mkdir outside"):
        assert seen[allowed] == "ok", (allowed, seen)
    assert (home / "functions" / "f").read_text() == "code"
    assert (home / "models" / "m").read_text() == "weights"


@pytest.mark.skipif(abi_version() < 6, reason="Landlock scopes signals from ABI 6")
def test_confined_process_cannot_signal_processes_outside_it(tmp_path: Path) -> None:
    """Handler code runs with the pool's and ember serve's uid: a signal to them (here: to an
    outside process it could otherwise kill) is refused; its own children it may still signal."""
    home, _ = make_home(tmp_path)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    code = r"""
import os, signal, subprocess, sys
from pathlib import Path
from runtime.sandbox import apply
apply(Path(sys.argv[1]))
try:
    os.kill(int(sys.argv[2]), signal.SIGKILL)
    print("killed")
except PermissionError:
    print("refused")
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
child.kill()
print(child.wait())
"""
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, str(home), str(bystander.pid)],
            cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        assert out.stdout.split() == ["refused", "-9"], out.stderr
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
