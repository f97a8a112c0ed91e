"""The ``ember`` command. Each verb imports what it needs only when it runs."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ember`` console script."""
    from gpu_pool.cli import add_arguments

    parser = argparse.ArgumentParser(prog="ember", description="Ember: serverless LLM functions.")
    verbs = parser.add_subparsers(dest="verb", required=True)
    pool = verbs.add_parser("pool", help="run a per-device memory pool daemon")
    add_arguments(pool)
    gen = verbs.add_parser("generate", help="complete a prompt with a model (registered on first use)")
    gen.add_argument("--model", required=True, help="gguf:/path, safetensors:/dir or pkg:PACKAGE/RESOURCE")
    gen.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("-p", "--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    worker = verbs.add_parser("worker", help="serve one registered model as a function instance")
    worker.add_argument("--name", required=True, help="function name")
    worker.add_argument("--model-dir", required=True, help="registered model directory")
    worker.add_argument("--pool-socket", required=True, help="the device pool's socket")
    worker.add_argument("--host", default="127.0.0.1")
    worker.add_argument("--port", type=int, default=0, help="0 picks a free port (printed when ready)")
    status = verbs.add_parser("status", help="show a pool's capacity, residency and reuse counters")
    status.add_argument("--socket", required=True, help="the pool daemon's socket")
    args = parser.parse_args(argv)

    if args.verb == "pool":
        from gpu_pool.cli import config_from_args
        from gpu_pool.daemon import run
        from gpu_pool.errors import ConfigError

        try:
            config = config_from_args(args)
        except ConfigError as exc:
            print(f"ember pool: {exc}", file=sys.stderr)
            return 2
        return run(config)
    if args.verb == "generate":
        from runtime.engine.sampling import SamplingParams
        from runtime.errors import EmberRuntimeError
        from runtime.generate import generate

        try:
            params = SamplingParams(
                max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
            )
            generate(args.model, args.prompt, args.dtype, args.chat, params, args.stream)
        except (EmberRuntimeError, ValueError) as exc:
            print(f"ember generate: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.verb == "worker":
        from pathlib import Path

        from runtime.worker import serve

        serve(args.name, Path(args.model_dir), args.pool_socket, args.host, args.port)
        return 0
    if args.verb == "status":
        from gpu_pool.client import PoolClient

        try:
            with PoolClient(args.socket) as client:
                print(json.dumps(client.stats(), indent=2))
        except ConnectionError as exc:
            print(f"ember status: {exc}", file=sys.stderr)
            return 1
        return 0
    raise AssertionError(args.verb)


if __name__ == "__main__":
    sys.exit(main())
