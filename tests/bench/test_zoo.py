"""The model zoo: the quick profile built for real (registration, a real pool daemon)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from bench.zoo import (
    MAX_MODEL_SHARE,
    POOL_ALIGNMENT,
    PROFILES,
    VOCAB,
    Finetune,
    Random,
    Zoo,
    ZooError,
    build,
    check_shares,
    default_root,
    function_spec,
    working_set_bytes,
)
from bench.zoo_weights import INIT_STD, LlamaShape, perturbed_names
from gateway.compose import registered_model
from gateway.spawn import ServeProcess
from gpu_pool import store
from runtime.models.llama import Batch, LlamaConfig, LlamaModel
from runtime.registry import load, register
from runtime.sources import ROOTS_ENV
from scheduler.spec import parse_function

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Zoo:
    return build(tmp_path_factory.mktemp("zoo"), "quick")


def fingerprints(zoo: Zoo, name: str) -> dict[str, str]:
    return {t.name: t.fingerprint for t in load(zoo.model_dir(zoo.model(name))).manifest().tensors}


def test_quick_zoo_registers_every_model(zoo: Zoo) -> None:
    recipes = PROFILES["quick"]
    assert [m.name for m in zoo.models] == [r.name for r in recipes]
    assert {m.dtype for m in zoo.models} == {"bfloat16", "float32", "int8", "q4"}
    assert zoo.root == Path(os.path.realpath(zoo.root)) and zoo.home == zoo.root / "home"
    for m in zoo.models:
        reg = load(zoo.model_dir(m))
        assert reg.model_id == m.model_id and reg.record["source"] == m.source
        assert reg.record["dtype"] == m.dtype and reg.manifest().nbytes == m.nbytes
        assert m.source.startswith(f"safetensors:{zoo.root}/sources/")
        assert m.family == ("finetune" if m.base else "random")
        assert reg.config["vocab_size"] == VOCAB
        assert Tokenizer.from_file(str(reg.directory / "tokenizer.json")).get_vocab_size() == VOCAB
        spec = parse_function(function_spec(m))  # a valid function spec, named after the model
        assert spec.name == m.name and spec.spec.model.source == m.source
    assert zoo.model("tiny-a-ft").base == "tiny-a-bf16"
    assert zoo.working_set_bytes == working_set_bytes(zoo, zoo.models)
    assert max(check_shares(zoo).values()) <= MAX_MODEL_SHARE
    # fewer than the models' sum: the fine-tune shares most of its base, norms are shared
    assert zoo.working_set_bytes < sum(working_set_bytes(zoo, [m]) for m in zoo.models)


def test_finetune_shares_all_but_the_perturbed_tensors(zoo: Zoo) -> None:
    base, tuned = fingerprints(zoo, "tiny-a-bf16"), fingerprints(zoo, "tiny-a-ft")
    recipe = next(r for r in PROFILES["quick"] if isinstance(r, Finetune))
    perturbed = perturbed_names(load(zoo.model_dir(zoo.model("tiny-a-bf16"))).config, recipe.seed)
    assert len(perturbed) == 7  # two layers' gate/up/down and one attention projection
    assert base.keys() == tuned.keys()
    assert {n for n in base if base[n] != tuned[n]} == set(perturbed)


def test_random_weights_are_llama_init_and_give_finite_logits(zoo: Zoo) -> None:
    for m in zoo.models:
        reg = load(zoo.model_dir(m))
        weights = load_file(str(reg.store_path / store.TENSORS_FILE))
        if m.family == "random" and m.dtype in ("bfloat16", "float32"):
            assert torch.equal(weights["model.norm.weight"], torch.ones_like(weights["model.norm.weight"]))
            std = weights["model.embed_tokens.weight"].float().std().item()
            assert abs(std - INIT_STD) < 0.001
        cfg = LlamaConfig.from_hf(reg.config)
        model = LlamaModel(cfg, weights)
        n = 8
        kv_dtype = torch.float32 if m.dtype == "float32" else torch.bfloat16
        kv = torch.zeros(1, *cfg.kv_block_shape(16), dtype=kv_dtype)
        pos = torch.arange(n)
        table = torch.zeros(1, 1, dtype=torch.long)
        logits = model.forward(Batch(pos * 7 + 3, pos, pos, [n], [n], table), kv)
        assert logits.shape == (1, VOCAB) and torch.isfinite(logits).all(), m.name
        assert logits.std() > 0, m.name


def test_builds_are_deterministic_and_cached(zoo: Zoo, tmp_path: Path) -> None:
    """Another directory gives the same ids and fingerprints; a second build of one directory
    finds everything, with or without the zoo's record (registration is idempotent)."""
    other = build(tmp_path / "other", "quick")
    assert [m.model_id for m in other.models] == [m.model_id for m in zoo.models]
    assert other.working_set_bytes == zoo.working_set_bytes
    for m in zoo.models:
        assert fingerprints(other, m.name) == fingerprints(zoo, m.name)
    records = {m.name: (other.model_dir(m) / "registration.json").stat() for m in other.models}
    start = time.perf_counter()
    assert build(tmp_path / "other", "quick") == other
    assert time.perf_counter() - start < 1.0
    (other.root / "zoo-quick.json").unlink()
    assert build(tmp_path / "other", "quick") == other
    for m in other.models:
        again = (other.model_dir(m) / "registration.json").stat()
        assert (again.st_ino, again.st_mtime_ns) == (records[m.name].st_ino, records[m.name].st_mtime_ns)


def test_a_hard_linked_home_reuses_the_registrations(
    zoo: Zoo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the replayer does: a fresh EMBER_HOME whose models/ is `cp -al` of the zoo's, the
    zoo's root as EMBER_MODEL_ROOTS; a deploy's registration finds the model, registers nothing."""
    home = tmp_path / "home"
    home.mkdir()
    subprocess.run(["cp", "-al", str(zoo.home / "models"), str(home / "models")], check=True)
    monkeypatch.setenv(ROOTS_ENV, str(zoo.root))
    before = {p.name for p in (home / "models").iterdir()}
    for m in zoo.models:
        spec = function_spec(m)["spec"]
        assert isinstance(spec, dict)
        reg = register(spec["model"]["source"], spec["model"]["dtype"], home=home)
        assert reg.model_id == m.model_id and reg.directory == home / "models" / m.model_id
        ours, theirs = reg.directory / "registration.json", zoo.model_dir(m) / "registration.json"
        assert ours.stat().st_ino == theirs.stat().st_ino  # the linked file, not a new registration
        found = registered_model(m.source, m.dtype, home)
        assert found is not None and found.model_id == m.model_id
    assert {p.name for p in (home / "models").iterdir()} == before


@pytest.mark.slow
def test_ember_serve_deploys_from_a_hard_linked_home(zoo: Zoo, tmp_path: Path) -> None:
    """The same through a real `ember serve`: deploys find the registrations (the models/ tree
    is untouched) and the functions answer chat completions."""
    home = tmp_path / "home"
    home.mkdir()
    subprocess.run(["cp", "-al", str(zoo.home / "models"), str(home / "models")], check=True)
    before = {p.name: p.stat().st_ino for p in (home / "models").rglob("*")}
    env = {ROOTS_ENV: str(zoo.root), "EMBER_ARENA": "64MiB", "EMBER_PREWARM": "1"}
    server = ServeProcess(home, env=env)
    try:
        headers = {"authorization": f"Bearer {server.api_key}"} if server.api_key else {}
        with httpx.Client(base_url=server.url, headers=headers, timeout=120) as http:
            for m in (zoo.model("tiny-a-ft"), zoo.model("tiny-d-q4")):
                assert http.post("/v1/functions", json=function_spec(m)).status_code == 201
                body = {"model": m.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                reply = http.post("/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text
                assert http.get("/v1/cluster").json()["functions"][m.name]["model"]["id"] == m.model_id
    finally:
        server.stop()
    assert {p.name: p.stat().st_ino for p in (home / "models").rglob("*")} == before


def test_cli_and_dedup_on_a_real_pool(zoo: Zoo) -> None:
    """`python -m bench.zoo --dedup`: one JSON line; the pool holds base + differing tensors."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.zoo", "--profile", "quick", "--root", str(zoo.root), "--dedup"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["working_set_bytes"] == zoo.working_set_bytes
    assert [m["name"] for m in out["models"]] == [m.name for m in zoo.models]
    (report,) = out["dedup"]
    assert report["base"] == "tiny-a-bf16" and report["alignment"] == POOL_ALIGNMENT
    (variant,) = report["variants"]
    assert variant["model"] == "tiny-a-ft" and variant["differing_tensors"] == 7
    assert report["base_bytes"] == working_set_bytes(zoo, [zoo.model("tiny-a-bf16")])
    expected = report["base_bytes"] + variant["differing_bytes"]
    assert report["resident_bytes"] == report["expected_bytes"] == expected
    assert expected == working_set_bytes(zoo, [zoo.model("tiny-a-bf16"), zoo.model("tiny-a-ft")])
    assert report["equal"] is True


def test_full_profile_shapes() -> None:
    """~0.5, ~1.0 and ~1.5 B parameters, SmolLM2's vocabulary, quantizable projections."""
    sizes = {r.name: r.shape.params() for r in PROFILES["full"] if isinstance(r, Random)}
    assert 0.45e9 < sizes["random-500m-bf16"] < 0.55e9
    assert 0.95e9 < sizes["random-1b-int8"] < 1.15e9
    assert 1.4e9 < sizes["random-1500m-q4"] < 1.6e9
    for recipe in PROFILES["full"] + PROFILES["quick"]:
        if isinstance(recipe, Random):
            assert recipe.shape.vocab == VOCAB
            assert recipe.shape.hidden % 32 == 0 and recipe.shape.intermediate % 32 == 0
    with pytest.raises(ValueError, match="heads"):
        LlamaShape(100, 128, 2, 3, 1, VOCAB)


def test_default_root_and_bad_values(tmp_path: Path) -> None:
    assert default_root("quick", {}) == Path.home() / ".cache" / "ember" / "zoo" / "quick"
    assert default_root("full", {"EMBER_ZOO_DIR": str(tmp_path)}) == tmp_path / "full"
    for bad in ("relative/dir", ""):
        with pytest.raises(ZooError, match="EMBER_ZOO_DIR"):
            default_root("quick", {"EMBER_ZOO_DIR": bad})
    (tmp_path / "file").write_text("")
    with pytest.raises(ZooError, match="not a directory"):
        default_root("quick", {"EMBER_ZOO_DIR": str(tmp_path / "file")})
    with pytest.raises(ZooError, match="profile"):
        build(tmp_path / "z", "huge")
