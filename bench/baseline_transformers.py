"""Cold-start baseline without Ember: a fresh process, ``transformers`` ``from_pretrained``, one token.

This is what a user pays to get the first token of a registered model *without* Ember: start
a new Python interpreter, ``import torch`` and ``transformers``, load the model and its
tokenizer with ``from_pretrained`` from the same safetensors bytes Ember serves, apply the
chat template and greedily generate one token. The clock starts in the parent just before the
process is launched (``time.time()`` is passed to the child on its command line), so
``total_s`` covers interpreter start, imports, loading and the prefill that yields the token.

The registered model directory is not laid out the way ``from_pretrained`` expects (the weights
live in the pool store entry ``store/``), so :func:`prepare_hf_dir` builds a throw-away
directory of symbolic links: ``config.json``, the tokenizer files and the store's safetensors
as ``model.safetensors`` (or several files plus ``model.safetensors.index.json``). No weight
bytes are copied. The store already uses Hugging Face tensor names
(``model.layers.0.self_attn.q_proj.weight``; registration renames GGUF tensors and undoes
llama.cpp's q/k permutation), so no renaming is needed; a store with other names is refused.

Caveat: the safetensors file is usually in the page cache (it was just registered or read), so
the figure is a warm-disk cold start of the process, the same condition Ember's cold start is
measured under.

Run ``python -m bench.baseline_transformers --model-dir DIR [--prompt P]``; it prints one JSON
line. The parent process imports neither torch nor transformers; the child's stderr (which
``transformers`` may fill with warnings) is captured and shown only if the child fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_PROMPT = "What is the capital of France?"
_CHILD_FLAG = "--child"
_STORE_DIR = "store"
_MANIFEST = "manifest.json"
_METADATA_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
_HF_PREFIXES = ("model.", "lm_head.")
# Keys of the child's JSON line that hold timings.
TIMING_KEYS = ("startup_s", "import_s", "load_s", "first_token_s", "total_s")


def prepare_hf_dir(model_dir: Path, out: Path) -> Path:
    """Lay out ``model_dir`` (a registered model) in ``out`` so ``from_pretrained(out)`` loads it.

    ``out`` must be an empty or missing directory. Every file is a symbolic link to the
    registered model's own file; the store's safetensors files become ``model.safetensors`` (one
    file) or keep their names with a ``model.safetensors.index.json`` (several). Raises
    ``ValueError`` when ``model_dir`` is not a registered model or its tensors lack Hugging Face
    names. Returns ``out``.
    """
    model_dir = model_dir.absolute()
    store = model_dir / _STORE_DIR
    try:
        manifest = json.loads((store / _MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"{model_dir} is not a registered model (no readable {_STORE_DIR}/{_MANIFEST}): {exc}"
        ) from None
    for name in ("config.json", "tokenizer.json"):
        if not (model_dir / name).is_file():
            raise ValueError(f"{model_dir} is not a registered model (missing {name})")

    weight_map: dict[str, str] = {t["name"]: Path(t["file"]).name for t in manifest["tensors"]}
    foreign = sorted(n for n in weight_map if not n.startswith(_HF_PREFIXES))
    if foreign:
        raise ValueError(
            f"{model_dir}: store tensors are not named like Hugging Face weights "
            f"(e.g. {foreign[:3]}); transformers could not load them"
        )

    out.mkdir(parents=True, exist_ok=True)
    for name in _METADATA_FILES:
        if (model_dir / name).is_file():
            (out / name).symlink_to(model_dir / name)
    files = sorted(set(weight_map.values()))
    if len(files) == 1:
        (out / "model.safetensors").symlink_to(store / files[0])
    else:
        for file in files:
            (out / file).symlink_to(store / file)
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return out


def measure(model_dir: Path, prompt: str, timeout_s: float = 600) -> dict[str, Any]:
    """Time a fresh process loading ``model_dir`` with transformers and generating one token.

    The Hugging Face layout is prepared before the clock starts. Returns the child's figures
    (seconds, see :data:`TIMING_KEYS`; ``total_s`` is from launch to the first token) plus
    ``token_id``, ``token_text`` (the greedy first token, decoded), ``prompt_tokens``,
    ``dtype`` and ``threads``. Raises ``RuntimeError`` if the child fails or times out.
    """
    with tempfile.TemporaryDirectory(prefix="ember-hf-baseline-") as tmp:
        hf_dir = prepare_hf_dir(Path(model_dir), Path(tmp) / "model")
        # A user's plain process: no warnings-as-errors inherited from a test harness, and no
        # hub look-ups (the directory is local; offline mode only skips network probes).
        env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        script = str(Path(__file__).absolute())
        t_launch = time.time()
        try:
            proc = subprocess.run(
                [sys.executable, script, _CHILD_FLAG, str(hf_dir), prompt, str(t_launch)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env=env,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"transformers baseline child timed out after {timeout_s} s") from exc
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"transformers baseline child failed (exit {proc.returncode}):\n"
            f"{proc.stderr[-4000:]}{proc.stdout[-2000:]}"
        )
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _child(hf_dir: Path, prompt: str, t_launch: float) -> None:
    """The measured process: imports, ``from_pretrained``, chat template, one greedy token."""
    t_start = time.time()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_imported = time.time()
    config = json.loads((hf_dir / "config.json").read_text())
    dtype_name = config.get("dtype") or config.get("torch_dtype") or "float32"
    model: Any = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype_name))
    model.eval()
    tokenizer: Any = AutoTokenizer.from_pretrained(hf_dir)
    t_loaded = time.time()
    inputs: Any = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        output = model.generate(
            **inputs,
            max_new_tokens=1,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    t_token = time.time()
    prompt_len = int(inputs["input_ids"].shape[1])
    token_id = int(output[0, prompt_len])
    figures = {
        "startup_s": t_start - t_launch,
        "import_s": t_imported - t_start,
        "load_s": t_loaded - t_imported,
        "first_token_s": t_token - t_loaded,
        "total_s": t_token - t_launch,
    }
    result: dict[str, Any] = {k: round(v, 4) for k, v in figures.items()}
    result.update(
        token_id=token_id,
        token_text=tokenizer.decode([token_id]),
        prompt_tokens=prompt_len,
        dtype=dtype_name,
        threads=torch.get_num_threads(),
    )
    print(json.dumps(result), flush=True)


def main(argv: list[str] | None = None) -> None:
    """CLI: ``--model-dir DIR [--prompt P] [--timeout S]``, or the internal ``--child`` mode."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == _CHILD_FLAG:
        if len(args) != 4:
            raise SystemExit(f"usage: {_CHILD_FLAG} HF_DIR PROMPT T_LAUNCH")
        _child(Path(args[1]), args[2], float(args[3]))
        return
    parser = argparse.ArgumentParser(
        prog="python -m bench.baseline_transformers",
        description="Cold start without Ember: fresh process + transformers from_pretrained + one token.",
    )
    parser.add_argument("--model-dir", type=Path, required=True, help="a registered model directory")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message (default: %(default)r)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the child is killed")
    ns = parser.parse_args(args)
    print(json.dumps(measure(ns.model_dir, ns.prompt, ns.timeout)))


if __name__ == "__main__":
    main()
