"""The ``ember`` command. Each verb imports what it needs only when it runs."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def _parser() -> argparse.ArgumentParser:
    from gpu_pool.cli import add_arguments

    parser = argparse.ArgumentParser(prog="ember", description="Ember: serverless LLM functions.")
    verbs = parser.add_subparsers(dest="verb", required=True)
    serve = verbs.add_parser("serve", help="run the gateway, scheduler, Redis, a CPU pool and workers")
    serve.add_argument("--host", default=None, help="listen address (EMBER_HOST, default 127.0.0.1)")
    serve.add_argument(
        "--port", type=int, default=None, help="listen port (EMBER_PORT, default 8080; 0 = any)"
    )
    serve.add_argument(
        "--redis", default=None, help="external Redis URL (EMBER_REDIS_URL); default: embedded"
    )
    serve.add_argument("--arena", default=None, help="CPU pool arena size, e.g. 2GiB (EMBER_ARENA)")
    serve.add_argument(
        "--prewarm", type=int, default=None, help="pre-warmed workers kept ready (EMBER_PREWARM)"
    )

    def client(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument(
            "--url", default=None, help="gateway URL (EMBER_URL; default: the running `ember serve`)"
        )
        return p

    def scoped(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument(
            "-n", "--namespace", default=None,
            help="the functions' namespace (admin key only; a tenant key always acts in its own)",
        )  # fmt: skip
        return client(p)

    gateway = verbs.add_parser(
        "gateway", help="cluster mode: the gateway over an external Redis, functions as Knative Services"
    )
    gateway.add_argument("--host", default=None, help="listen address (EMBER_HOST, default 127.0.0.1)")
    gateway.add_argument("--port", type=int, default=None, help="listen port (EMBER_PORT, default 8080)")
    gateway.add_argument("--redis", default=None, help="the cluster's Redis URL (EMBER_REDIS_URL, required)")
    deploy = client(verbs.add_parser("deploy", help="deploy (or update) a function from YAML"))
    deploy.add_argument("-f", "--file", required=True, type=Path)
    deploy.add_argument(
        "--target",
        choices=["gateway", "knative"],
        default="gateway",
        help="gateway: send it to the running gateway; knative: print its Knative Service YAML "
        "(no gateway, no cluster)",
    )
    invoke = scoped(verbs.add_parser("invoke", help="call a function"))
    invoke.add_argument("name")
    what = invoke.add_mutually_exclusive_group(required=True)
    what.add_argument("-d", "--data", help="the event as JSON")
    what.add_argument("-p", "--prompt", help="a user message (default handler) or {'prompt': ...} (custom)")
    invoke.add_argument("--stream", action="store_true", help="print text as it is generated")
    invoke.add_argument("--max-tokens", type=int, default=None)
    invoke.add_argument("--timing", action="store_true", help="print time to first token and total")
    scoped(verbs.add_parser("list", help="list deployed functions"))
    for verb, text in (("describe", "show a function's spec with defaults"), ("delete", "delete a function")):
        scoped(verbs.add_parser(verb, help=text)).add_argument("name")
    logs = scoped(verbs.add_parser("logs", help="show a function's instance logs"))
    logs.add_argument("name")
    logs.add_argument("--tail", type=int, default=200)
    status = client(verbs.add_parser("status", help="nodes, devices, residency and instances"))
    status.add_argument("--socket", default=None, help="show one pool daemon's stats instead")
    tenant = verbs.add_parser("tenant", help="API keys scoped to a namespace (admin key only)")
    tenant_verbs = tenant.add_subparsers(dest="tenant_verb", required=True)
    create = client(tenant_verbs.add_parser("create", help="a new key for NAMESPACE (printed once)"))
    create.add_argument("namespace")
    client(tenant_verbs.add_parser("list", help="namespaces with keys, and the keys' ids"))
    revoke = client(tenant_verbs.add_parser("revoke", help="revoke NAMESPACE's keys (or one: --key ID)"))
    revoke.add_argument("namespace")
    revoke.add_argument("--key", default=None, help="the id of one key (`ember tenant list`)")
    pool = verbs.add_parser("pool", help="run a per-device memory pool daemon")
    add_arguments(pool)
    gen = verbs.add_parser("generate", help="complete a prompt with a model (registered on first use)")
    gen.add_argument("--model", required=True, help="gguf:/path, safetensors:/dir or pkg:PACKAGE/RESOURCE")
    gen.add_argument("--dtype", choices=["bfloat16", "float32", "int8", "q4"], default="bfloat16")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("-p", "--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    worker = verbs.add_parser("worker", help="serve one registered model as a function instance")
    mode = worker.add_mutually_exclusive_group()
    mode.add_argument(
        "--function", default=None, metavar="ID",
        help="a Knative function pod: serve function ID (NAME or NAMESPACE/NAME) from the cluster state",
    )  # fmt: skip
    mode.add_argument(
        "--openwhisk", action="store_true", help="an OpenWhisk blackbox action: POST /init, then /run"
    )
    worker.add_argument("--name", default=None, help="function name (standalone)")
    worker.add_argument("--model-dir", default=None, help="registered model directory (standalone)")
    worker.add_argument("--pool-socket", default=None, help="the device pool's socket (standalone)")
    worker.add_argument(
        "--host", default=None, help="listen address (standalone: 127.0.0.1; pods and actions: 0.0.0.0)"
    )
    worker.add_argument(
        "--port", type=int, default=None,
        help="standalone: 0 (default) picks a free port, printed when ready; --function: $PORT (8080); "
        "--openwhisk: 8080",
    )  # fmt: skip
    worker.add_argument(
        "--token-stdin",
        action="store_true",
        help="read the worker's credential from stdin (default: generate one, printed when ready)",
    )
    worker.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger bodies get 413")
    verbs.add_parser("node", help="run this node's pool daemons and report their residency (cluster mode)")
    extender = verbs.add_parser(
        "extender", help="serve the kube-scheduler extender (residency-aware placement)"
    )
    extender.add_argument("--host", default=None, help="listen address (EMBER_HOST, default 127.0.0.1)")
    extender.add_argument(
        "--port", type=int, default=None, help="listen port (EMBER_EXTENDER_PORT, default 8090)"
    )
    extender.add_argument("--redis", default=None, help="the cluster's Redis URL (EMBER_REDIS_URL)")
    extender.add_argument(
        "--prefix", default=None, help="URL prefix of /filter and /prioritize (default /extender)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ember`` console script."""
    args = _parser().parse_args(argv)
    handler = {
        "serve": _serve, "gateway": _gateway, "pool": _pool, "generate": _generate, "worker": _worker,
        "deploy": _deploy, "invoke": _invoke, "list": _list, "describe": _describe, "delete": _delete,
        "logs": _logs, "status": _status, "tenant": _tenant, "extender": _extender, "node": _node,
    }[args.verb]  # fmt: skip

    from gateway.client import GatewayError

    try:
        return handler(args)
    except GatewayError as exc:  # every client verb: unreachable gateway or an error reply
        return _fail(args.verb, exc)
    except KeyboardInterrupt:
        return 130


def _fail(verb: str, exc: Exception, code: int = 1) -> int:
    print(f"ember {verb}: {exc}", file=sys.stderr)
    return code


def _serve(args: argparse.Namespace) -> int:
    from gateway.serve import ServeConfig, ServeError, configure_logging, serve
    from gpu_pool.errors import ConfigError

    try:
        configure_logging()
        config = ServeConfig.from_env(
            host=args.host, port=args.port, redis_url=args.redis, prewarm=args.prewarm
        )
        if args.arena is not None:
            from dataclasses import replace

            from gpu_pool.config import parse_size

            config = replace(config, arena_bytes=parse_size(args.arena, "--arena"))
    except (ValueError, ConfigError) as exc:
        return _fail("serve", exc, 2)
    from gateway import secret_env

    secret_env.hide()  # read into config: now out of /proc/<pid>/environ, where handlers could look
    import uvloop  # the event loop the gateway's proxying runs on (several times faster than asyncio's)

    try:
        uvloop.run(serve(config))
    except ServeError as exc:
        return _fail("serve", exc)
    return 0


def _gateway(args: argparse.Namespace) -> int:
    from gateway.cluster_gateway import SECRETS, ClusterGatewayConfig, run

    try:
        config = ClusterGatewayConfig.from_env(host=args.host, port=args.port, redis_url=args.redis)
    except ValueError as exc:
        return _fail("gateway", exc, 2)
    from gateway import secret_env
    from scheduler.errors import SchedulerError

    secret_env.hide(SECRETS)  # read into config: now out of /proc/<pid>/environ
    import uvloop

    try:
        uvloop.run(run(config))
    except SchedulerError as exc:  # Redis or the Kubernetes API cannot be reached at start
        return _fail("gateway", exc)
    return 0


def _pool(args: argparse.Namespace) -> int:
    from gpu_pool.cli import config_from_args, run
    from gpu_pool.errors import ConfigError

    try:
        config = config_from_args(args)
    except ConfigError as exc:
        return _fail("pool", exc, 2)
    return run(config)


def _node(args: argparse.Namespace) -> int:
    import os

    import uvloop

    from gateway.compose import run_node

    try:
        uvloop.run(run_node(dict(os.environ)))
    except ValueError as exc:
        return _fail("node", exc, 2)
    return 0


def _extender(args: argparse.Namespace) -> int:
    from gateway.extender import ExtenderServeConfig, log_decisions, serve_extender

    try:
        config = ExtenderServeConfig.from_env(
            host=args.host, port=args.port, redis_url=args.redis, prefix=args.prefix
        )
    except ValueError as exc:
        return _fail("extender", exc, 2)
    log_decisions()
    import uvloop

    try:
        uvloop.run(serve_extender(config))
    except OSError as exc:  # cannot listen there (no such address, port taken): say so, no traceback
        return _fail("extender", OSError(f"cannot listen on {config.host}:{config.port}: {exc}"), 1)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from runtime.engine.sampling import SamplingParams
    from runtime.errors import EmberRuntimeError
    from runtime.generate import generate

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
        )
        generate(args.model, args.prompt, args.dtype, args.chat, params, args.stream)
    except (EmberRuntimeError, ValueError) as exc:
        return _fail("generate", exc, 2)
    return 0


def _worker(args: argparse.Namespace) -> int:
    if args.function is not None or args.openwhisk:
        if args.name or args.model_dir or args.pool_socket or args.token_stdin:
            return _fail("worker", ValueError("--name, --model-dir, --pool-socket and --token-stdin are "
                                              "for a standalone worker only"), 2)  # fmt: skip
        return _knative_worker(args) if args.function is not None else _openwhisk_worker(args)
    if not (args.name and args.model_dir and args.pool_socket):
        return _fail("worker", ValueError("give --function, --openwhisk, or --name, --model-dir and "
                                          "--pool-socket"), 2)  # fmt: skip
    from gateway.compose import standalone_assignment
    from runtime.http_server import HeaderLimits
    from runtime.worker import serve
    from runtime.worker_guard import GuardConfig
    from runtime.worker_spawn import new_token

    try:
        token = sys.stdin.readline(4096).strip() if args.token_stdin else new_token()
        guard = GuardConfig.from_env(token, args.max_body_bytes)
        headers = HeaderLimits.from_env()
    except ValueError as exc:
        return _fail("worker", exc, 2)
    assignment = standalone_assignment(args.name, Path(args.model_dir), args.pool_socket)
    host, port = args.host or "127.0.0.1", args.port or 0
    serve(
        host,
        port,
        [args.model_dir],
        assignment,
        guard=guard,
        show_token=not args.token_stdin,
        headers=headers,
    )
    return 0


def _secret_free_environ() -> dict[str, str]:
    """This process's environment, read once; its secrets are then hidden from handler code."""
    import os

    from gateway import compose, secret_env

    env = dict(os.environ)
    secret_env.hide((compose.WORKER_TOKEN_ENV, *secret_env.SECRETS))
    return env


def _knative_worker(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from gateway.compose import build_knative_worker
    from runtime import knative_worker
    from scheduler.errors import SchedulerError

    env = _secret_free_environ()
    try:
        worker = build_knative_worker(args.function, env, args.max_body_bytes)
    except (ValueError, SchedulerError) as exc:
        return _fail("worker", exc, 2)
    config = worker.config
    try:
        if args.host is not None or args.port is not None:
            config = replace(config, host=args.host or config.host, port=args.port or config.port)
    except ValueError as exc:
        worker.record.gone()
        return _fail("worker", exc, 2)
    return knative_worker.serve(config, worker.assignment, worker.guard, worker.record)


def _openwhisk_worker(args: argparse.Namespace) -> int:
    from gateway.compose import build_openwhisk_worker
    from gpu_pool.errors import ConfigError, PoolError
    from runtime import openwhisk

    env = _secret_free_environ()
    try:
        worker = build_openwhisk_worker(env)
    except (ValueError, ConfigError, PoolError, OSError) as exc:
        return _fail("worker", exc, 2)
    try:
        host, port = args.host or "0.0.0.0", args.port or openwhisk.PORT
        return openwhisk.serve(worker.prepare, host, port, args.max_body_bytes)
    finally:
        worker.close()


def _client(args: argparse.Namespace) -> Any:
    from gateway.client import GatewayClient, find_endpoint
    from runtime.registry import ember_home

    return GatewayClient(find_endpoint(args.url, ember_home()))


def _deploy(args: argparse.Namespace) -> int:
    import yaml

    from gateway.function_code import with_handler_module

    try:
        document = yaml.safe_load(args.file.read_text())
    except (OSError, yaml.YAMLError) as exc:
        return _fail("deploy", exc, 2)
    if args.target == "knative":
        return _print_knative(document, args.file)
    try:
        body = with_handler_module(document, args.file)
    except (OSError, ValueError) as exc:
        return _fail("deploy", exc, 2)
    print(
        "deploying (the first deploy of a model registers it, which takes a few seconds)...", file=sys.stderr
    )
    with _client(args) as gw:
        created = gw.call("POST", "/v1/functions", json=body).json()
    print(f"deployed {created['metadata']['name']}")
    return 0


def _print_knative(document: Any, spec_file: Path) -> int:
    """The function's handler ConfigMap (a custom handler's module, read from beside the YAML),
    Knative Service and token Secret as YAML on stdout (the token left out: the gateway derives
    it when it deploys); warnings on stderr."""
    import yaml

    from gateway.compose import knative_manifests
    from runtime.registry import ember_home

    try:
        manifests = knative_manifests(document, ember_home(), spec_file)
    except (OSError, ValueError) as exc:  # SpecError, a bad EMBER_KNATIVE_* setting, no module
        return _fail("deploy", exc, 2)
    rendered = manifests.rendered
    for note in rendered.notes:
        print(f"ember deploy: note: {note}", file=sys.stderr)
    for warning in manifests.warnings:
        print(f"ember deploy: warning: {warning}", file=sys.stderr)
    if rendered.config_map is not None:
        print("# The handler's code: apply it before the Service (its pods mount it).")
        print(yaml.safe_dump(rendered.config_map, sort_keys=False), end="")
        print("---")
    print(yaml.safe_dump(rendered.service, sort_keys=False), end="")
    print("---")
    print("# stringData.token is left out: `ember gateway` sets it when it deploys the function")
    print("# (HMAC-SHA256 of EMBER_CLUSTER_SECRET and the function's qualified id).")
    print(yaml.safe_dump(rendered.secret, sort_keys=False), end="")
    return 0


def _invoke(args: argparse.Namespace) -> int:

    with _client(args) as gw:
        spec = gw.call("GET", f"/v1/functions/{args.name}", params=_ns(args)).json()
        default = spec["spec"]["handler"] == "default"
        if args.data is not None:
            try:
                event = json.loads(args.data)
            except json.JSONDecodeError as exc:
                return _fail("invoke", ValueError(f"-d is not valid JSON: {exc}"), 2)
        elif default:
            event = {"messages": [{"role": "user", "content": args.prompt}], "temperature": 0}
        else:
            event = {"prompt": args.prompt}
        if isinstance(event, dict) and default:
            if args.max_tokens is not None:
                event["max_tokens"] = args.max_tokens
            event["stream"] = args.stream
        path = f"/v1/functions/{args.name}/invoke"
        if args.namespace is not None:
            from urllib.parse import urlencode

            path += "?" + urlencode(_ns(args))
        t0 = time.perf_counter()
        ttft = None
        if args.stream:
            for chunk in gw.stream(path, json.dumps(event).encode()):
                text = _chunk_text(chunk)
                if ttft is None and text:
                    ttft = time.perf_counter() - t0
                sys.stdout.write(text)
                sys.stdout.flush()
            sys.stdout.write("\n")
        else:
            answer = gw.call("POST", path, json=event).json()
            ttft = time.perf_counter() - t0
            choices = answer.get("choices") if isinstance(answer, dict) else None
            if default and choices:
                first = choices[0]
                print(first.get("message", {}).get("content", first.get("text", "")))
            else:
                print(json.dumps(answer, indent=2))
        if args.timing:
            total = time.perf_counter() - t0
            print(f"time to first token {1e3 * (ttft or total):.0f} ms, total {1e3 * total:.0f} ms")
    return 0


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices")
    if not choices:
        return json.dumps(chunk) + "\n"
    first = choices[0]
    return str(first.get("delta", {}).get("content") or first.get("text") or "")


def _list(args: argparse.Namespace) -> int:
    from scheduler.names import qualified

    with _client(args) as gw:
        functions = gw.call("GET", "/v1/functions", params=_ns(args)).json()["functions"]
        cluster = gw.call("GET", "/v1/cluster").json()["functions"]  # admin: by "ns/name"
    knative = any("knative" in (f.get("status") or {}) for f in functions)  # a cluster-mode gateway
    print(f"{'NAME':<24} {'HANDLER':<10} {'MODEL':<48} " + ("READY  REVISION" if knative else "INSTANCES"))
    for f in functions:
        name = f["metadata"]["name"]
        handler = "default" if f["spec"]["handler"] == "default" else "custom"
        line = f"{name:<24} {handler:<10} {f['spec']['model']['source'][:48]:<48}"
        if knative:
            service = (f.get("status") or {}).get("knative", {})
            print(f"{line} {service.get('ready', '-'):<6} {service.get('latestReadyRevisionName', '-')}")
            continue
        shown = cluster.get(qualified(f["metadata"].get("namespace", "default"), name)) or cluster.get(name)
        live = [i for i in (shown or {}).get("instances", []) if i["state"] in ("starting", "ready")]
        print(f"{line} {len(live)}")
    return 0


def _describe(args: argparse.Namespace) -> int:
    import yaml

    with _client(args) as gw:
        spec = gw.call("GET", f"/v1/functions/{args.name}", params=_ns(args)).json()
    print(yaml.safe_dump(spec, sort_keys=False), end="")
    return 0


def _delete(args: argparse.Namespace) -> int:
    with _client(args) as gw:
        gw.call("DELETE", f"/v1/functions/{args.name}", params=_ns(args))
    print(f"deleted {args.name}")
    return 0


def _logs(args: argparse.Namespace) -> int:
    with _client(args) as gw:
        params = {"tail": args.tail, **_ns(args)}
        print(gw.call("GET", f"/v1/functions/{args.name}/logs", params=params).text, end="")
    return 0


def _status(args: argparse.Namespace) -> int:
    if args.socket is not None:
        from gpu_pool.client import PoolClient

        try:
            with PoolClient(args.socket) as pool:
                print(json.dumps(pool.stats(), indent=2))
        except ConnectionError as exc:
            return _fail("status", exc)
        return 0
    with _client(args) as gw:
        cluster = gw.call("GET", "/v1/cluster").json()
    for device_id, d in cluster["devices"].items():
        gib = 1 << 30
        print(
            f"device {device_id}: capacity {d['capacity_bytes'] / gib:.2f} GiB, "
            f"free {d['free_bytes'] / gib:.2f} GiB, "
            f"resident {d['resident_bytes'] / 1e6:.0f} MB (pinned {d['pinned_bytes'] / 1e6:.0f} MB), "
            f"loaded {d['bytes_loaded'] / 1e6:.0f} MB, reused {d['bytes_reused'] / 1e6:.0f} MB, "
            f"warm workers {d.get('warm_workers', 0)}"
        )
        if d.get("worker_failures"):
            error = str(d.get("last_worker_error") or "")[-200:]
            print(f"  workers failing to start: {d['worker_failures']} in a row, next try in "
                  f"{d.get('backoff_s', 0):.0f} s: {error}")  # fmt: skip
        for model_id, nbytes in d.get("models", {}).items():
            print(f"  resident model {model_id}: {nbytes / 1e6:.0f} MB")
    for name, f in cluster["functions"].items():
        print(f"function {name}:")
        for i in f["instances"]:
            extra = f", loaded {int(i['bytes_loaded']) / 1e6:.0f} MB" if "bytes_loaded" in i else ""
            print(f"  instance {i['id']} {i['state']} on {i['device']}, in flight {i['in_flight']}{extra}")
    return 0


def _ns(args: argparse.Namespace) -> dict[str, str]:
    """The ``?namespace=`` of a verb's request (none: the key's own, or "default" for the admin)."""
    return {} if args.namespace is None else {"namespace": args.namespace}


def _tenant(args: argparse.Namespace) -> int:
    with _client(args) as gw:
        if args.tenant_verb == "create":
            created = gw.call("POST", "/v1/tenants", json={"namespace": args.namespace}).json()
            print(f"namespace {created['namespace']}: key {created['key']} (id {created['id']})")
            print("the key is shown only now: store it (EMBER_API_KEY for `ember` calls)", file=sys.stderr)
        elif args.tenant_verb == "list":
            print(f"{'NAMESPACE':<32} KEYS")
            for t in gw.call("GET", "/v1/tenants").json()["tenants"]:
                print(f"{t['namespace']:<32} {' '.join(k['id'] for k in t['keys'])}")
        else:
            path = f"/v1/tenants/{args.namespace}" + (f"/keys/{args.key}" if args.key else "")
            revoked = gw.call("DELETE", path).json()["revoked"]
            print(f"revoked {revoked} key(s) of {args.namespace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
