"""The `trnd` command: serve, prefill, decode, router, store, top, check, points, model, compile, bench. The only
place that parses argv: each command's flags are its config's fields (trnd/config.py), loaded flat; the commands
that run an engine tune the process first (trnd/tuning.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from trnd.log import journal_prefix
from trnd.procs import EX_CONFIG, EX_UNAVAILABLE


def _check_backend(name: str) -> None:
    """Refuse a backend this host cannot run before loading anything (or starting a role's children)."""
    from trnd.backends import get_backend

    get_backend(name)


def _choices(field: str) -> list[str]:
    """A Literal field's values (trnd/config.py): the flag offers what the config accepts."""
    import typing

    from trnd.config import APIConfig, EngineKnobs, LogLevel, RouterConfig

    if field == "log_level":
        return list(typing.get_args(LogLevel))
    for part in (EngineKnobs, APIConfig, RouterConfig):
        hint = typing.get_type_hints(part).get(field)
        if hint is not None:
            return list(typing.get_args(hint))
    raise KeyError(field)


def _compute_flags(p) -> None:
    p.add_argument("--dtype", choices=_choices("dtype"),
                   help="weights, compute and KV dtype (default auto: the checkpoint's, or float32 on a CPU "
                        "without native bf16)")
    p.add_argument("--kv-cache-dtype", choices=_choices("kv_cache_dtype"),
                   help="KV page format (default auto: the compute dtype; fp8: half the bytes per page, "
                        "scales inside each page)")
    p.add_argument("--backend", choices=_choices("backend"), help="where the model runs (default cpu)")


def _engine_flags(p) -> None:
    """config.py EngineKnobs and TierConfig, for `trnd serve` and the roles alike: a new engine setting is a
    field there and a flag here."""
    _compute_flags(p)
    p.add_argument("--tp", type=int, help="tensor-parallel degree: ranks (processes) sharding the model (default 1)")
    p.add_argument("--ep", type=int, help="expert parallelism: a MoE model's experts split into EP groups of the tp "
                                          "ranks, whole experts each (divides --tp; default 1: a slice of every "
                                          "expert on every rank)")
    p.add_argument("--threads", type=int, help="torch intra-op threads per rank (default: all cores)")
    p.add_argument("--kv-memory-gb", type=float, help="memory for the KV page pool, per rank (default 1.0)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_const", const=False,
                   help="disable the radix prefix cache")
    p.add_argument("--static", action="store_const", const=True,
                   help="pad every step to the decode point's buckets, one compiled graph each (engine/static.py)")
    p.add_argument("--compile-decode", action="store_const", const=True,
                   help="CPU: run decode-only steps as one inductor graph, compiled at start (~30 s; the weights "
                        "held twice; engine/compiled.py)")
    p.add_argument("--compile-cache", metavar="DIR",
                   help="load every bucket's graph from a `trnd compile` output (implies --static); refuses a "
                        "cache built for another model, point, dtype or torch")
    p.add_argument("--core-lock", metavar="FILE",
                   help="roles on one node's cores: hold this file's lock per forward pass, taking turns "
                        "(the same FILE in each; engine/corelock.py)")
    p.add_argument("--transfer-backend", choices=_choices("transfer_backend"),
                   help="NIXL backend for the KV handoff and L3 (default ucx; libfabric: the EFA path, its tcp "
                        "provider elsewhere; both roles must name the same)")
    p.add_argument("--speculative-config", metavar="JSON",
                   help='speculative decoding, as vLLM\'s: \'{"method": "ngram" | "draft" | "mtp", '
                        '"num_speculative_tokens": K, "model": DIR, "prompt_lookup_min": N, "prompt_lookup_max": N}\' '
                        "(engine/spec/); prefill and decode must be given the same one")
    p.add_argument("--host-cache-gb", type=float, help="L2: host DRAM for evicted prefix pages (default 0: off)")
    p.add_argument("--store", action="append", metavar="HOST:PORT", help="L3: a remote KV store (repeatable)")
    p.add_argument("--remote-config", dest="remote", type=_json_object, metavar="JSON",
                   help="the L3 backend, as [remote] in TOML: '{\"backend\": \"mooncake\", \"master\": "
                        "\"127.0.0.1:50051\", \"metadata_server\": \"http://127.0.0.1:8080/metadata\"}' "
                        "(default: the `trnd store`s given with --store)")


def _api_key_flags(p) -> None:
    p.add_argument("--api-key-file", metavar="FILE",
                   help="require 'Authorization: Bearer KEY' on /v1 and /admin, KEY read from FILE (or set "
                        "TRND_API_KEY): unlike --api-key, not visible in ps")
    p.add_argument("--api-key", help="the same, KEY given on the command line (visible to every user in ps)")


def _api_flags(p) -> None:
    """config.py HTTPConfig's and APIConfig's flags, for the OpenAI fronts (serve, decode)."""
    p.add_argument("--host", help="address to bind (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, help="OpenAI API port (default 8000)")
    _api_key_flags(p)
    p.add_argument("--served-model-name", help="model name reported by /v1/models (default: directory name)")
    p.add_argument("--tool-call-parser", choices=_choices("tool_call_parser"),
                   help="how the model writes tool calls (default hermes: Qwen2.5/Qwen3 <tool_call> JSON)")
    p.add_argument("--reasoning-parser", choices=_choices("reasoning_parser"),
                   help="split <think>...</think> into reasoning_content (default none)")
    p.add_argument("--log-level", choices=_choices("log_level"))


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the OpenAI API: a local prefill + decode deployment (or --aggregated)",
                       description="Run trnd on this machine: a prefill and a decode process on loopback with the "
                                   "OpenAI API on --port (or everything in one process with --aggregated). Flags "
                                   "override values from --config; a flag the chosen mode cannot apply is refused.")
    p.add_argument("--config", metavar="FILE", help="TOML file with LocalConfig fields, or ServeConfig fields with "
                                                    "aggregated = true (see configs/serve.toml)")
    p.add_argument("--model", metavar="DIR", help="Hugging Face model directory, or a preset name (tiny, small) "
                                                  "made on first use; default: small")
    _api_flags(p)
    _engine_flags(p)
    _kv_events_flag(p)
    p.add_argument("--aggregated", action="store_const", const=True,
                   help="one process (API + engine); default: a local prefill + decode deployment")
    p.add_argument("--max-model-len", type=int, help="max context per request (default: the model's, capped "
                                                     "by the pool)")
    p.add_argument("--point", help="local deployment: its roles' decode point (configs/points.toml; default 8k)")
    p.add_argument("--prefill", dest="num_prefill", type=int, metavar="N",
                   help="local deployment: N prefill servers (default 1); every decode server uses all of them")
    p.add_argument("--decode", dest="num_decode", type=int, metavar="M",
                   help="local deployment: M decode servers (default 1); with M > 1 `trnd router` serves --port")
    p.add_argument("--prefill-control-port", type=int, metavar="PORT",
                   help="local deployment: the first prefill server's control port (the i-th takes PORT + i; "
                        "default: a free port)")
    p.add_argument("--prefill-admin-port", type=int, metavar="PORT",
                   help="local deployment: the first prefill server's admin HTTP port (likewise)")
    p.add_argument("--decode-port", type=int, metavar="PORT",
                   help="local deployment with --decode M > 1: the first decode server's API port (likewise)")
    p.add_argument("--no-share-cores", dest="share_cores", action="store_const", const=False,
                   help="local deployment: let the roles compute at once instead of taking turns on the cores "
                        "(engine/corelock.py)")
    p.add_argument("--local-prefill-tokens", type=int, metavar="N",
                   help="local deployment: the decode server prefills a prompt of at most N uncached tokens "
                        "itself (0: every prompt to the prefill server; default: 1000 while the roles share the "
                        "cores, else 0)")
    p.add_argument("--page-size", type=int, help="--aggregated: tokens per KV page (default 16)")
    p.add_argument("--max-batch", type=int, help="--aggregated: max running requests (default 32)")
    p.add_argument("--token-budget", type=int, help="--aggregated: tokens computed per engine step (default 512)")
    p.add_argument("--chunk-size", type=int, help="--aggregated: max prefill tokens of one request per step "
                                                  "(default 512)")


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _kv_events_flag(p) -> None:
    p.add_argument("--kv-events-config", dest="kv_events", type=_json_object, metavar="JSON",
                   help="KV events in vLLM's format, vLLM's flag as is: '{\"enable_kv_cache_events\": true, "
                        "\"endpoint\": \"tcp://127.0.0.1:5557\", \"replay_endpoint\": \"tcp://127.0.0.1:5558\"}' "
                        "(endpoints default to this role's host, ephemeral ports: /admin/state kv_events)")


def _role_flags(p) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML role config (see configs/)")
    _kv_events_flag(p)
    p.add_argument("--model", metavar="DIR", help="Hugging Face model directory or preset name (tiny, small)")
    p.add_argument("--point", help="named decode point (configs/points.toml): both roles must use the same one")
    _engine_flags(p)
    p.add_argument("--secret-file", help="file holding the control-plane shared secret")


def _disagg_parsers(sub) -> None:
    p = sub.add_parser("prefill", help="run a prefill server (KV factory for decode servers)",
                       description="Run a prefill server: decode servers connect to --control-port and get prompt "
                                   "KV written into their page pools over NIXL.")
    _role_flags(p)
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--control-port", type=int, help="control-plane TCP port (default 8100)")
    p.add_argument("--admin-port", type=int, help="HTTP port for /health, /ready, /metrics, /admin (default 8101)")
    p.add_argument("--no-pipeline", dest="pipeline", action="store_const", const=False,
                   help="write a prompt's KV only after its last chunk (to measure what pipelining buys)")
    p.add_argument("--log-level", choices=_choices("log_level"))
    d = sub.add_parser("decode", help="run a decode server (OpenAI API; prompts prefilled remotely)",
                       description="Run a decode server: the OpenAI API front that owns each request, with prompt KV "
                                   "computed by prefill servers (--prefill host:port, repeatable).")
    _role_flags(d)
    _api_flags(d)
    d.add_argument("--max-model-len", type=int, help="max context per request (default: the point's)")
    d.add_argument("--prefill", action="append", metavar="HOST:PORT", help="a prefill server's control port")
    d.add_argument("--local-prefill-tokens", type=int, metavar="N",
                   help="prefill a prompt of at most N uncached tokens here instead of on a peer (0: none; "
                        "default: 1000 with --core-lock, else 0)")


def _router_parser(sub) -> None:
    p = sub.add_parser("router", help="run the OpenAI front of several decode servers (session/prefix/load routing)",
                       description="Run a router: the decode servers' OpenAI routes, each request sent to one "
                                   "decode server by session (rendezvous hash), cached prefix, then load; failover "
                                   "to another server for requests not yet streaming.")
    p.add_argument("--config", metavar="FILE", help="TOML router config (see configs/router.toml)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port (default 8000)")
    p.add_argument("--target", dest="targets", action="append", metavar="HOST:PORT",
                   help="a decode server's HTTP address (repeatable; replaces the config's targets)")
    p.add_argument("--model", metavar="DIR", help="the targets' model dir or preset, to count prompt tokens exactly")
    _api_key_flags(p)
    p.add_argument("--policy", choices=_choices("policy"),
                   help="affinity (default): session, prefix, load; random: the session-unaware baseline for benchmarks")
    p.add_argument("--kv-events", action="store_const", const=True,
                   help="route prefixes on the targets' KV events (their real caches; needs --model and targets "
                        "started with --kv-events-config) instead of the texts this router sent")
    p.add_argument("--log-level", choices=_choices("log_level"))


def _model_parser(sub) -> None:
    p = sub.add_parser("model", help="make or inspect models")
    msub = p.add_subparsers(dest="model_cmd", required=True)
    i = msub.add_parser("init", help="write a random-weight Hugging Face-format model with a trained tokenizer")
    i.add_argument("dir", help="output directory")
    # maker.PRESET_NAMES and maker.ARCHS (not imported here: the maker imports torch; tests/test_maker.py checks)
    i.add_argument("--preset", choices=["tiny", "small", "tiny-moe", "small-moe", "tiny-gptoss", "tiny-mla",
                                        "tiny-mla-v3"], default="tiny",
                   help="tiny: tests; small: ~100M, benchmarks; tiny-moe / small-moe: Qwen3-MoE (small-moe ~380M, "
                   "~85M active); tiny-gptoss: GPT-OSS; tiny-mla / tiny-mla-v3: DeepSeek-V2 / V3 (MLA)")
    i.add_argument("--arch", choices=["qwen3", "llama", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3"],
                   help="default: the preset's (qwen3 for tiny and small)")
    i.add_argument("--quant", choices=["fp8", "mxfp4"],
                   help="fp8: block-scaled FP8 linears (the Qwen3 *-FP8 format); mxfp4: GPT-OSS's MXFP4 experts")
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")


def _compile_parser(sub) -> None:
    p = sub.add_parser("compile", help="build every bucket's graph of a decode point ahead of time (a compile cache)",
                       description="Build a decode point's static graphs ahead of time with torch.compile into DIR "
                                   "(torch's Inductor and AOTAutograd caches + manifest.json); a role started with "
                                   "--compile-cache DIR then loads them and compiles nothing. The CPU backend runs "
                                   "here; cuda and neuron take the same command on their hosts.")
    p.add_argument("--point", required=True, help="decode point (configs/points.toml)")
    p.add_argument("--model", required=True, metavar="DIR", help="Hugging Face model directory or preset name")
    p.add_argument("--out", required=True, metavar="DIR", help="the cache directory (created)")
    _compute_flags(p)
    p.add_argument("--kv-memory-gb", type=float,
                   help="the roles' kv_memory_gb (default 1.0): the pool's page count is a dimension of every graph")
    p.add_argument("--threads", type=int, help="torch intra-op threads while compiling")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trnd", description="LLM serving daemon (OpenAI API, paged KV cache, "
                                                              "disaggregated prefill/decode)")
    from trnd import __version__

    parser.add_argument("--version", action="version", version=f"trnd {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("top", help="live operator console for a deployment (trnd top --help)", add_help=False)
    sub.add_parser("points", help="what each decode point needs on this machine for a model (trnd points --help)",
                   add_help=False)
    sub.add_parser("check", help="trnd check cpu: the CPU, its flags and the paths chosen; trnd check neuron|cuda: "
                                 "kernels vs torch twins, generation vs CPU (trnd check --help)", add_help=False)
    _serve_parser(sub)
    _disagg_parsers(sub)
    from trnd.roles.store import add_store_args

    add_store_args(sub)
    _router_parser(sub)
    _model_parser(sub)
    _compile_parser(sub)
    from trnd.bench import add_bench_parser

    add_bench_parser(sub)
    return parser


def argv_source(role: str, load: Callable[[str | None, dict], object],
                argv: list[str] | None = None) -> Callable[[], object] | None:
    """How to re-read this process's config: the command line it was started with, parsed again by the
    same parser (so flags keep overriding the file) and loaded by `load(path, flags)`. None when argv is
    not a `trnd <role>` command."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != role:
        return None
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        return None
    flags = {k: v for k, v in vars(args).items() if k not in ("cmd", "config")}
    return lambda: load(args.config, flags)


# The commands that load a model or hold KV pages: started from the command line, they re-exec once with
# glibc's huge-page tunable (trnd/tuning.py huge_pages_environ); their children inherit it.
HUGE_PAGE_COMMANDS = ("serve", "prefill", "decode", "store", "bench", "compile")
# The commands that run an engine or its kernels tune the process before torch loads (trnd/tuning.py);
# `trnd top`, `trnd router`, `trnd points` and `trnd model` leave it as it is.
TUNED_COMMANDS = (*HUGE_PAGE_COMMANDS, "check")


def _reexec_with_huge_pages(argv: list[str]) -> None:
    import os

    from trnd.tuning import huge_pages_environ

    env = huge_pages_environ() if argv[:1] and argv[0] in HUGE_PAGE_COMMANDS else None
    if env is not None and getattr(sys, "orig_argv", None):
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)  # same pid: systemd sees one process


def main(argv: list[str] | None = None) -> int:
    """The command, with Ctrl-C before a role installs its own handlers (loading, making a preset) an exit
    status of 130 and one line, never a traceback."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print(f"{journal_prefix(4)}trnd: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command line, not a caller in this process (tests): may re-exec
        _reexec_with_huge_pages(sys.argv[1:])
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in TUNED_COMMANDS:
        from trnd import tuning

        tuning.tune()
    if argv[:1] == ["check"]:  # the operator's device check: its own flags (trnd check --help)
        from trnd.check import main as check_main

        return check_main(argv[1:])
    if argv[:1] == ["points"]:  # what each decode point needs here: its own flags (trnd points --help)
        from trnd.points_report import main as points_main

        return points_main(argv[1:])
    if argv[:1] == ["top"]:  # the operator console: its own flags (trnd top --help)
        from trnd.top.cli import main as top_main

        return top_main(argv[1:])
    args = build_parser().parse_args(argv)
    from trnd.backends import BackendUnavailable
    from trnd.config import ConfigError, StartupError
    from trnd.model.config import ModelError
    from trnd.procs import PortError

    try:
        if args.cmd in ("serve", "prefill", "decode", "router"):
            from functools import partial

            from trnd.config import (DecodeConfig, LocalConfig, PrefillConfig, RouterConfig, load_config,
                                     load_serve_config)
            from trnd.log import setup_logging
            from trnd.roles import decode, local, prefill, router, serve

            load = {"serve": load_serve_config, "prefill": partial(load_config, PrefillConfig),
                    "decode": partial(load_config, DecodeConfig),
                    "router": partial(load_config, RouterConfig)}[args.cmd]
            flags = {k: v for k, v in vars(args).items() if k not in ("cmd", "config")}
            cfg = load(args.config, flags)
            if args.cmd != "router":
                _check_backend(cfg.engine.backend)
            if args.cmd in ("prefill", "decode"):
                try:
                    cfg.resolved_secret()
                except (OSError, ValueError) as e:
                    raise ConfigError(str(e).replace("\n", " ")) from None
            setup_logging(cfg.log_level, args.cmd)
            run = {"prefill": prefill.run, "decode": decode.run, "router": router.run}.get(args.cmd)
            if run is None:
                run = local.run if isinstance(cfg, LocalConfig) else serve.run
            return run(cfg, argv_source(args.cmd, load, argv))
        if args.cmd == "store":
            from trnd.roles import store

            return store.run_args(args)
        if args.cmd == "model":
            from trnd.model.maker import make_model

            from trnd.model.maker import preset_arch

            try:
                path = make_model(args.dir, preset=args.preset, arch=args.arch, seed=args.seed, dtype=args.dtype,
                                  quant=args.quant)
            except ValueError as e:  # a combination the maker does not write: one line, as a config error
                raise ConfigError(str(e)) from None
            quant = f", {args.quant} weights" if args.quant else ""
            print(f"trnd: wrote {args.preset} {preset_arch(args.preset, args.arch)} model (seed {args.seed}{quant}) "
                  f"to {path}")
            return 0
        if args.cmd == "compile":
            from trnd.roles import compile as compile_role

            return compile_role.run(args)
        if args.cmd == "bench":
            import importlib

            # `report` is current.py (report.py renders serve-compare's own section)
            module = {"report": "current"}.get(args.bench_cmd, args.bench_cmd.replace("-", "_"))
            return importlib.import_module(f"trnd.bench.{module}").main(args)
    except ConfigError as e:
        print(f"{journal_prefix(3)}trnd: config error: {e}", file=sys.stderr)
        return EX_CONFIG
    except StartupError as e:
        print(f"{journal_prefix(3)}trnd: cannot start: {e}", file=sys.stderr)
        return EX_CONFIG
    except ModelError as e:  # a missing model directory, an architecture trnd does not run: no restart fixes it
        print(f"{journal_prefix(3)}trnd: model error: {e}", file=sys.stderr)
        return EX_CONFIG
    except PortError as e:  # another process holds a port: 1, a restart may find it free
        print(f"{journal_prefix(3)}trnd: cannot start: {e}", file=sys.stderr)
        return e.exit_code
    except BackendUnavailable as e:
        print(f"{journal_prefix(3)}trnd: {e}", file=sys.stderr)
        return EX_UNAVAILABLE
    return 2
