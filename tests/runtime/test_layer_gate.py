"""The model waits per layer for a progressive acquire's bytes (TIDAL §5.2)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from gpu_pool.readiness import READY, Readiness
from gpu_pool.spawn import running_pool
from runtime.instance import bind, load_template
from runtime.models.layer_gate import LayerGate, stage_groups
from runtime.models.llama import Batch, LlamaConfig, LlamaModel
from runtime.registry import models_dir, register
from tests.runtime.tiny_gguf import hf_weights, write_tiny_gguf

LAYERS = 6


def _model_inputs() -> tuple[LlamaConfig, dict[str, torch.Tensor], Batch, torch.Tensor]:
    weights = {k: torch.from_numpy(v) for k, v in hf_weights(layers=LAYERS).items()}
    vocab, hidden = weights["model.embed_tokens.weight"].shape
    heads, kv_heads, inter = 4, 2, weights["model.layers.0.mlp.gate_proj.weight"].shape[0]
    cfg = LlamaConfig(vocab, hidden, inter, LAYERS, heads, kv_heads, hidden // heads, 1e-6, 10000.0,
                      "lm_head.weight" not in weights, False, 128)  # fmt: skip
    n = 5
    pos = torch.arange(n)
    batch = Batch(pos % vocab, pos, pos, [n], [n], torch.zeros(1, 1, dtype=torch.int64))
    kv = torch.zeros(1, *cfg.kv_block_shape(16))
    return cfg, weights, batch, kv


@pytest.mark.parametrize("kernels", ["off", None])  # the torch path; the CPU kernels where built
def test_forward_waits_for_each_layer_before_reading_it(kernels: str | None) -> None:
    cfg, weights, batch, kv = _model_inputs()
    expected = LlamaModel(cfg, weights, cpu_kernels=kernels).forward(batch, kv.clone())
    names = list(weights)
    ends = stage_groups(names, LAYERS, 4096)
    assert ends is not None and len(ends) == LAYERS + 2  # embeddings, each layer, norm (+ head)
    # The bytes arrive as the daemon writes them: NaN until a group is copied, then signalled.
    live = {k: torch.full_like(v, float("nan")) for k, v in weights.items()}
    read_fd, write_fd = os.pipe()
    readiness = Readiness(read_fd, ends, "tiny")
    gate = LayerGate(readiness, names, LAYERS)
    model = LlamaModel(cfg, live, cpu_kernels=kernels, gate=gate)

    def loader() -> None:
        start = 0
        for end in ends:
            time.sleep(0.01)
            for name in names[start:end]:
                live[name].copy_(weights[name])
            os.write(write_fd, READY)
            start = end
        os.close(write_fd)

    thread = threading.Thread(target=loader)
    thread.start()
    got = model.forward(batch, kv.clone())
    thread.join()
    assert torch.equal(got, expected)
    assert gate.waited_s > 0 and readiness.done
    model.forward(batch, kv.clone())
    assert model.gate is None  # all in: the next forward checks nothing


@pytest.mark.parametrize("kernels", ["off", None])  # the torch path; the CPU kernels where built
def test_the_prompts_rows_come_from_the_store_file_while_the_table_loads_last(
    tmp_path: Path, kernels: str | None
) -> None:
    """Access order v2: the embedding table loads last. The forward reads the prompt's rows from
    the store file and runs every layer before the table is in; a tied head waits for it."""
    from gpu_pool import store
    from runtime.models.embedding_rows import EMBED, EmbeddingRows

    cfg, weights, batch, kv = _model_inputs()
    expected = LlamaModel(cfg, weights, cpu_kernels=kernels).forward(batch, kv.clone())
    names = [n for n in weights if n != EMBED] + [EMBED]
    manifest = store.write(tmp_path / "entry", {n: weights[n] for n in names})
    rows = EmbeddingRows.of(manifest)
    assert rows is not None
    ends = stage_groups(names, LAYERS, 4096)
    assert ends is not None and len(ends) == LAYERS + 2  # each layer, norm (+ head), the table
    live = {k: torch.full_like(v, float("nan")) for k, v in weights.items()}
    read_fd, write_fd = os.pipe()
    readiness = Readiness(read_fd, ends, "tiny")
    gate = LayerGate(readiness, names, LAYERS, embedding=rows, tied=cfg.tie_word_embeddings)
    model = LlamaModel(cfg, live, cpu_kernels=kernels, gate=gate)

    def loader() -> None:
        start = 0
        for i, end in enumerate(ends):
            if i == len(ends) - 1:
                time.sleep(0.05)  # every layer is in, the table is not: the forward is past them
            for name in names[start:end]:
                live[name].copy_(weights[name])
            os.write(write_fd, READY)
            start = end
        os.close(write_fd)

    thread = threading.Thread(target=loader)
    thread.start()
    got = model.forward(batch, kv.clone())
    thread.join()
    assert torch.equal(got, expected)
    assert gate.rows_read == batch.input_ids.numel()  # the rows came from the file, not the table


def test_a_failed_load_fails_the_forward() -> None:
    from gpu_pool.errors import LoadError

    cfg, weights, batch, kv = _model_inputs()
    read_fd, write_fd = os.pipe()
    names = list(weights)
    ends = stage_groups(names, LAYERS, 4096)
    assert ends is not None
    os.write(write_fd, READY * 2 + b"E")
    os.close(write_fd)
    model = LlamaModel(
        cfg, weights, cpu_kernels="off", gate=LayerGate(Readiness(read_fd, ends), names, LAYERS)
    )
    with pytest.raises(LoadError):
        model.forward(batch, kv)


@pytest.mark.slow
def test_progressive_instance_generates_what_a_loaded_one_does(tmp_path: Path) -> None:
    from gpu_pool.client import PoolClient

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, hf_weights(layers=LAYERS))
    home = tmp_path / "home"
    model = register(str(path), "float32", home=home)
    template = load_template(model.directory)
    prompt = template.tokenizer.encode("the then in", add_special_tokens=False).ids
    from runtime.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = []
    with running_pool(str(tmp_path / "pool.sock"), "64MiB", store_roots=(models_dir(home),)) as pool:
        for progressive in (True, False, True):
            with PoolClient(pool.socket_path, admin_token=pool.admin_token) as admin:
                admin.evict()
            with PoolClient(pool.socket_path) as client:
                binding = bind(template, client, 16, progressive=progressive)
                assert binding.acquire_report.bytes_loaded == model.manifest().nbytes
                gate = binding.engine.runner.model.gate
                assert (gate is not None) == progressive
                outputs.append(binding.engine.generate([prompt], params)[0].output_ids)
                binding.engine.close()
    assert outputs[0] == outputs[1] == outputs[2]
