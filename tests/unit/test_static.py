"""The static-shape (bucketed) path on the CPU: what Neuron compiles per decode point and CUDA replays as graphs.

Against the eager ModelRunner on both architectures: same greedy tokens (and logprobs), over mixed prompt
lengths, chunked prefill, prefix-cache hits, decode groups and chunks larger than the largest bucket; one
compiled graph per bucket (a counting torch.compile backend), no graph breaks; padding writes nowhere but
the scratch page, which no request ever holds.
"""

from __future__ import annotations

import pytest
import torch

from trnd.engine.build import EngineConfig
from trnd.engine.request import SamplingParams
from trnd.engine.static import StaticRunner, bucket, pow2_buckets, resolve_point
from trnd.llm import LLM

# Few buckets keep compiles few: page-table widths 1, 2, 4, 8 (128 tokens / 16 per page).
POINT = """
[points.static-test]
max_context = 128
max_batch = 4
page_size = 16
prefill_chunk = 32
decode_buckets = [2, 4]
prefill_buckets = [16, 32]
"""
# max_batch 6 > the largest decode bucket and chunk_size 40 > the largest prefill bucket: the runner
# splits both. token_budget 48 mixes decodes and several sequences' chunks in one step.
ENGINE = dict(num_pages=40, page_size=16, max_batch=6, token_budget=48, chunk_size=40, max_model_len=128)
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)


def prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


FIRST = prompts(0, [5, 19, 40, 70, 16, 33])
# Second round: prefix hits (whole pages of earlier prompts, then a new tail; one prompt repeated), mixed
# with a cold prompt.
SECOND = [FIRST[3][:50] + prompts(1, [9])[0], FIRST[2], FIRST[5][:32] + [7, 8, 9], prompts(2, [26])[0]]


@pytest.fixture
def point_file(tmp_path, monkeypatch):
    path = tmp_path / "points.toml"
    path.write_text(POINT)
    monkeypatch.setenv("TRND_POINTS", str(path))


class CountingCompiler:
    """A torch.compile backend that records the bucket of each graph it is given and runs it as traced."""

    def __init__(self):
        self.keys: list[tuple[str, int, int]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        shapes = {n.name: tuple(n.meta["example_value"].shape) for n in gm.graph.nodes if n.op == "placeholder"}
        if "l_ids_" not in shapes or "l_pages_" not in shapes:  # a piece of a broken graph
            self.keys.append(("fragment", len(gm.graph.nodes), 0))
        elif "l_ctx_" in shapes:
            self.keys.append(("decode", shapes["l_ids_"][0], shapes["l_pages_"][1]))
        else:
            self.keys.append(("prefill", shapes["l_ids_"][0], shapes["l_pages_"][0]))
        return gm.forward


def watch(engine, kv_writes: list[str], seen: dict):
    """Wrap the runner's forward: after every step the pool must be intact (no request holds the scratch
    page, refcounts add up) and every KV slot that changed must be a real token's slot or in the scratch page."""
    runner, scratch, inner = engine.runner, engine.scratch_page, engine.runner.forward

    def forward(x):
        before = runner.kv.clone()
        seen["decodes"] = max(seen.get("decodes", 0), len(x.decode_ctx))
        seen["chunk"] = max([seen.get("chunk", 0)] + [q_len for _, q_len, _, _ in x.prefill])
        out = inner(x)
        allowed = set(zip(x.page_ids, x.offsets))
        changed = (runner.kv != before).flatten(1, 3).any(dim=(1, 3))  # [page, slot]
        for page, slot in changed.nonzero().tolist():
            if page != scratch and (page, slot) not in allowed:
                kv_writes.append(f"page {page} slot {slot} written by no token of the step")
        for req in engine.scheduler.running:
            assert scratch not in req.pages, f"{req.rid} holds the scratch page {scratch}"
        assert engine.pool.refcount(scratch) == 1
        engine.check_integrity()
        return out

    runner.forward = forward


def run(llm: LLM) -> list:
    return [llm.generate(FIRST, PARAMS), llm.generate(SECOND, PARAMS)]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_static_matches_eager(arch, tiny_qwen3, tiny_llama, point_file):
    model = str(tiny_qwen3 if arch == "qwen3" else tiny_llama)
    want = run(LLM(model, **ENGINE))

    llm = LLM(model, static=True, point="static-test", **ENGINE)
    engine = llm.engine
    assert engine.scratch_page is not None and engine.pool.refcount(engine.scratch_page) == 1
    counter = CountingCompiler()
    engine.runner = StaticRunner(engine.model, engine.model_config, engine.pools[0], engine.runner.point,
                                 engine.scratch_page, compiler=counter)
    leaks: list[str] = []
    seen: dict = {}
    watch(engine, leaks, seen)
    got = run(llm)

    assert not leaks, leaks[:5]
    for w_round, g_round in zip(want, got, strict=True):
        for w, g in zip(w_round, g_round, strict=True):
            assert g.token_ids == w.token_ids
            assert g.cached_tokens == w.cached_tokens
            assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-4)
    assert [c.cached_tokens for c in got[1]][:3] == [48, 32, 32], "the second round must hit the prefix cache"
    engine.check_integrity()

    used = engine.runner.used
    kinds = {k[0] for k in used}
    assert kinds == {"decode", "prefill"}
    assert seen["decodes"] > 4 and seen["chunk"] > 32  # steps larger than the largest buckets, split
    assert {k[1] for k in used if k[0] == "decode"} == {2, 4}
    assert {k[1] for k in used if k[0] == "prefill"} == {16, 32}
    # One graph per bucket used, each compiled once, none for a shape outside the buckets: a graph break
    # would show as more graphs (fullgraph=True makes it an error first).
    assert sorted(counter.keys) == sorted(used), (counter.keys, used)


def test_scratch_page_is_reserved_once(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), static=True, num_pages=8, page_size=16, max_batch=2, chunk_size=16)
    engine = llm.engine
    # Every other page can be handed out, never the scratch one.
    got = engine.pool.alloc(engine.pool.num_free)
    assert engine.scratch_page not in got and len(got) == 7
    engine.pool.unref(got)
    assert engine.check_integrity()["in_use"] == 1
    # Compiling ahead (what CUDA capture runs) feeds all-padding inputs: they write the scratch page only.
    kv = engine.runner.kv
    kv.normal_()
    before = kv.clone()
    engine.runner.warmup(decode=[(2, 1)], prefill=[(16, 1)])
    changed = (kv != before).flatten(1).any(dim=1).nonzero().flatten().tolist()
    assert changed == [engine.scratch_page]
    assert engine.runner.used == {("decode", 2, 1), ("prefill", 16, 1)}
    assert LLM(str(tiny_qwen3), num_pages=8).engine.scratch_page is None


def test_buckets():
    assert pow2_buckets(1, 8) == [1, 2, 4, 8]
    assert pow2_buckets(1, 6) == [1, 2, 4, 6]
    assert pow2_buckets(16, 16) == [16]
    assert [bucket([2, 4], n, "x") for n in (1, 2, 3, 4)] == [2, 2, 4, 4]
    with pytest.raises(ValueError, match="past the largest bucket"):
        bucket([2, 4], 5, "decode batch")
    p = resolve_point(None, page_size=16, max_batch=6, chunk_size=40, max_context=100)
    assert (p.decode_buckets, p.prefill_buckets, p.pool_pages_needed()) == ([1, 2, 4, 6], [16, 32, 40], 7)


def test_point_must_fit_the_engine(point_file):
    with pytest.raises(ValueError, match="page_size 16, the engine 32"):
        resolve_point("static-test", page_size=32, max_batch=4, chunk_size=32, max_context=128)
    with pytest.raises(ValueError, match="max_model_len <= 128"):
        resolve_point("static-test", page_size=16, max_batch=4, chunk_size=32, max_context=256)
    with pytest.raises(ValueError, match="static runs one rank: tp = 2 must be 1"):
        EngineConfig(model="unused", static=True, tp=2)
