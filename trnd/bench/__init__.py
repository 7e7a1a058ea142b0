"""Benchmarks behind docs/RESULTS.md. Every table names the CPU it ran on: figures from two CPU classes
(AVX-512 with bf16 vs AVX2 + FMA only) are not comparable."""

import os


def cpu_line() -> str:
    """The CPU, its relevant flags and ISA level, printed beside every benchmark's figures."""
    from trnd_kernels.cpuinfo import cpu_info

    return f"cpu: {cpu_info().summary()}; {os.cpu_count()} cores"


def add_bench_parser(sub) -> None:
    """`trnd bench ...`: each benchmark's flags (cli.py adds this to its parser)."""
    p = sub.add_parser("bench", help="benchmarks that write the figures in docs/RESULTS.md")
    bsub = p.add_subparsers(dest="bench_cmd", required=True)
    e = bsub.add_parser("engine", help="trnd vs transformers on one machine: prefill and decode tokens/s")
    e.add_argument("--model", default="small", help="model dir or preset (default small)")
    e.add_argument("--prompt-len", type=int, default=1024)
    e.add_argument("--new-tokens", type=int, default=128)
    e.add_argument("--batches", default="1,8,32")
    e.add_argument("--dtype", default="bfloat16")
    e.add_argument("--skip-hf", action="store_true", help="measure trnd only")
    e.add_argument("--tp", type=int, default=1, help="N > 1: trnd at TP=N against trnd at TP=1 (no transformers)")
    e.add_argument("--ep", type=int, default=1,
                   help="E > 1 with --tp N: trnd at TP=N with a MoE model's experts in E groups (EP) against TP=N alone")
    e.add_argument("--compare-dtype", choices=["bfloat16", "float32"],
                   help="trnd at --dtype against trnd at this dtype (no transformers), alternated --rounds times")
    e.add_argument("--compare-decode-layers", action="store_true",
                   help="trnd's decode steps in one call (ops.decode_layers) against its Python loop over the layers "
                        "(TRND_DECODE_LAYERS=0), alternated --rounds times (no transformers)")
    e.add_argument("--rounds", type=int, default=1,
                   help="with --compare-dtype or --compare-decode-layers: alternated rounds, best of each")
    e.add_argument("--floor-rounds", type=int, default=0, metavar="N",
                   help="then N rounds of (read bandwidth, batch-1 decode step) back to back in one process: the "
                        "step against the bandwidth floor per round, and the median ratio")
    from trnd.bench import current

    e.add_argument("--save-floor", default=current.SAVE_DEFAULT, metavar="DIR",
                   help="with --floor-rounds: save the median ratio there (default docs/results, what `trnd bench "
                        "report` reads); '' for none")
    rep = bsub.add_parser("report", help="the current tables at the top of docs/RESULTS.md, one per CPU class, "
                                         "from the saved runs (docs/results/*.json)")
    current.add_arguments(rep)
    d = bsub.add_parser("disagg", help="NIXL throughput vs memcpy; TTFT disaggregated vs aggregated, pipelining "
                                       "on and off")
    d.add_argument("--model", default="small", help="model dir or preset (default small)")
    d.add_argument("--point", default="128k", help="decode point for the roles (default 128k)")
    d.add_argument("--lengths", default="2048,8192,16384", help="prompt lengths for TTFT")
    d.add_argument("--reps", type=int, default=3)
    d.add_argument("--kv-memory-gb", type=float, default=2.0)
    d.add_argument("--threads", type=int, default=None)
    d.add_argument("--prompt-tokens", metavar="N[,N...]", help="prompt lengths for TTFT (as --lengths)")
    d.add_argument("--netns", action="store_true",
                   help="prefill in its own network namespace behind a shaped veth pair (needs root and iproute2; "
                        "bench/link.py): the handoff crosses a real link, made and removed by the run")
    d.add_argument("--rate", default="1gbit", help="with --netns: the link's rate, as tc takes it (default 1gbit)")
    d.add_argument("--delay-ms", type=float, default=0.2, help="with --netns: one-way delay where netem exists")
    d.add_argument("--loss", type=float, default=0.0, metavar="PCT", help="with --netns: packets dropped, percent")
    d.add_argument("--transfer-backend", choices=["ucx", "libfabric"], default="ucx")
    d.add_argument("--dtype", default=None, help="the roles' and the aggregated server's dtype (default auto)")
    d.add_argument("--kv-cache-dtype", default=None, help="e.g. fp8_e4m3 (default: the model dtype)")
    g = bsub.add_parser("grammar", help="decode tok/s with and without a json_schema on every request")
    g.add_argument("--model", default="small", help="model dir or preset (default small)")
    g.add_argument("--batch", type=int, default=8)
    g.add_argument("--new-tokens", type=int, default=64)
    g.add_argument("--reps", type=int, default=3)
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--threads", type=int, default=None)
    # the benchmarks that declare their own flags (add_arguments in their module)
    for name, help_ in (
            ("serve-compare", "trnd vs vLLM's CPU build, both loaded by `vllm bench serve`"),
            ("router", "session affinity vs random routing through trnd serve --prefill 1 --decode 2"),
            ("kv-accuracy", "fp8 KV pages vs model-dtype KV (transformers the oracle): logit differences and greedy "
                            "agreement"),
            ("longctx", "the long-context curve on the 1m point: prefill tok/s by context and the decode step there "
                        "(tiny model, RoPE scaled to the point)"),
            ("preempt", "a preempted request's resume from L2 against recompute, at one context"),
            ("million", "one request at 1,048,576 tokens of context through the 1m point: prefill, handoff, decode, "
                        "reload from L2, each phase's time and memory"),
            ("agentic", "agent sessions at growing context (AgentX's shape) replayed against any OpenAI server, or "
                        "trnd and vLLM side by side"),
            ("l3", "the L3 tier on trnd store vs Mooncake Store: GB/s and L3-hit TTFT"),
            ("spec", "speculative decoding (draft = target, n-gram, an unrelated draft) vs none: TPOT, tok/s, "
                     "acceptance at c=1 and c=4")):
        import importlib

        module = importlib.import_module(f"trnd.bench.{name.replace('-', '_')}")
        module.add_arguments(bsub.add_parser(name, help=help_))
    t = bsub.add_parser("tiers", help="multi-turn agentic replay: tiers off vs host L2 vs L2 + remote L3")
    t.add_argument("--model", default="small", help="model dir or preset (default small)")
    t.add_argument("--point", default="8k")
    t.add_argument("--sessions", type=int, default=16)
    t.add_argument("--turns", type=int, default=8)
    t.add_argument("--concurrency", type=int, default=4, help="turns in flight at once")
    t.add_argument("--first", type=int, default=256, help="tokens of a session's system prompt (before turn 1)")
    t.add_argument("--growth", type=int, default=768, help="new tokens a turn (the user's message or tool output)")
    t.add_argument("--gen", type=int, default=32, help="tokens generated a turn")
    t.add_argument("--kv-memory-gb", type=float, default=0.25, help="device pool per role: below the working set")
    t.add_argument("--host-gb", type=float, default=2.0)
    t.add_argument("--store-gb", type=float, default=2.0)
    t.add_argument("--tiers", default="off,l2,l3,l2+l3", help="configurations, in order (off, l2, l3, l2+l3)")
