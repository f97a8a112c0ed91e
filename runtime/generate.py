"""``ember generate``: register a model if needed and complete one prompt on a private pool."""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

import torch
from tokenizers import Tokenizer

from runtime.chat import render_chat
from runtime.engine.build import PoolKV, build_engine
from runtime.engine.engine import EngineConfig
from runtime.engine.kv_storage import kv_block_bytes
from runtime.engine.sampling import SamplingParams
from runtime.models.llama import LlamaConfig, LlamaModel
from runtime.registry import RegisteredModel, register
from runtime.sources import SourceRoots

BLOCK = 16


@contextmanager
def private_pool(arena_bytes: int, store_root: Path) -> Iterator[str]:
    """A pool daemon of our own, on a socket in a temporary directory, trusting the model
    store under ``store_root``; yields the socket."""
    from gpu_pool.spawn import running_pool

    with tempfile.TemporaryDirectory(prefix="ember-generate-") as tmp:
        sock = str(Path(tmp) / "pool.sock")
        env = {"EMBER_POOL_PREFAULT": "false"}
        with running_pool(sock, arena_bytes, env=env, store_roots=(store_root,)):
            yield sock


def eos_ids(model: RegisteredModel, tok: Tokenizer) -> set[int]:
    ids = {int(model.config["eos_token_id"])} if "eos_token_id" in model.config else set()
    cfg_path = model.directory / "tokenizer_config.json"
    if cfg_path.is_file():
        eos = json.loads(cfg_path.read_text()).get("eos_token")
        eos_id = tok.token_to_id(eos) if eos else None
        if eos_id is not None:
            ids.add(eos_id)
    return ids


def generate(
    source: str,
    prompt: str,
    dtype: str = "bfloat16",
    chat: bool = False,
    params: SamplingParams | None = None,
    stream: bool = False,
    out: TextIO | None = None,
) -> str:
    """Complete ``prompt`` with the model at ``source``; prints (or streams) and returns the text."""
    from gpu_pool.client import PoolClient

    sink = out or sys.stdout
    params = params or SamplingParams()
    model_reg = register(source, dtype, progress=sys.stderr.isatty(), roots=SourceRoots.unrestricted())
    tok = Tokenizer.from_file(str(model_reg.directory / "tokenizer.json"))
    if chat:
        tok_cfg = json.loads((model_reg.directory / "tokenizer_config.json").read_text())
        prompt = render_chat(tok_cfg.get("chat_template"), [{"role": "user", "content": prompt}], tok_cfg)
    ids = tok.encode(prompt, add_special_tokens=False).ids
    config = LlamaConfig.from_hf(model_reg.config)
    profile = model_reg.profile("cpu")  # materialized at registration: no profiling here
    torch_dtype = getattr(torch, profile["kv_dtype"])  # an int8/q4 model's activations: bfloat16
    block_bytes = int(profile["kv_block_bytes"])
    assert block_bytes == kv_block_bytes(config, BLOCK, torch_dtype) and profile["block_size"] == BLOCK
    kv_blocks = -(-(len(ids) + params.max_tokens) // BLOCK) + 8
    manifest = model_reg.manifest()
    arena = manifest.nbytes + kv_blocks * block_bytes + (64 << 20)
    with private_pool(arena, model_reg.store_path) as sock, PoolClient(sock) as client:
        model = LlamaModel(config, client.acquire(manifest))
        engine = build_engine(
            model, tok, eos_ids(model_reg, tok), PoolKV(client, block_bytes), torch_dtype, EngineConfig(BLOCK)
        )
        seq_id = engine.add_request(ids, params)
        while engine.has_unfinished():
            for o in engine.step():
                if stream and o.text_delta:
                    sink.write(o.text_delta)
                    sink.flush()
        text = engine.text(seq_id)
        engine.close()
    if not stream:
        sink.write(text)
    sink.write("\n")
    return text
