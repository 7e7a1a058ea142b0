"""Expert parallelism (`ep`, trnd/parallel.py): a MoE model's experts split over groups of a role's TP ranks (real
processes over gloo), greedy output token-identical to transformers, each rank holding only its experts; the
KV does not depend on ep, so a prefill with tp=2 ep=2 hands off to a decode with tp=1; a layout the model does
not split into is one line at start."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from trnd.engine.request import SamplingParams
from trnd.llm import LLM
from trnd.model.loader import load_model
from trnd.model.moe import Experts
from trnd.parallel import TPGroup

from tests.launch import Server, admin_state, wait_for
from tests.procs.test_moe_models import MODELS, _make
from tests.unit.test_engine_vs_hf import hf_greedy, prompts_of

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LENGTHS = [5, 40, 17]
# tiny-moe's attention at head_dim 64: o_proj's 256 columns split by tp=2 into whole 128-column fp8 blocks (at 16,
# its 64 cannot be split: one line at load). The experts' 32 rows stay whole with ep = tp.
MODELS = {**MODELS, "moe-fp8-hd64": dict(MODELS["moe-fp8"], overrides={"head_dim": 64}),
          "mla-v3-ep": dict(preset="tiny-mla-v3", seed=4)}  # DeepSeek-V3's routed experts (model/deepseek.py)


def run(model_dir, prompts, **layout) -> tuple[list[list[int]], dict]:
    llm = LLM(str(model_dir), page_size=8, num_pages=128, chunk_size=24, token_budget=64, threads=1, **layout)
    try:
        outs = [c.token_ids for c in llm.generate(prompts, GREEDY)]
        state = msgspec.to_builtins(llm.engine.state().layout)  # as /admin/state has it
        assert llm.engine.check_integrity()["in_use"] == 0
    finally:
        llm.engine.close()
    return outs, state


@pytest.mark.parametrize("name", ["moe", "gptoss", "mla-v3-ep"])
def test_ep2_matches_transformers(models_dir, name):
    """tp=2 ep=2: each rank runs its 4 of 8 experts whole for every token, the all-reduce combines; tp=2 ep=1
    (each expert's rows split) gives the same tokens."""
    model = _make(models_dir, name, **MODELS[name])
    prompts = prompts_of(LENGTHS, 1000, seed=7)
    expected = hf_greedy(model, prompts, GREEDY.max_tokens)
    ep2, layout = run(model, prompts, tp=2, ep=2)
    assert ep2 == expected
    assert layout["tp"] == 2 and layout["ep"] == 2 and all(r["alive"] for r in layout["ranks"])
    one, single = run(model, prompts)
    assert one == expected and single["ep"] == 1
    assert layout["expert_bytes"] * 2 == single["expert_bytes"]  # rank 0 holds half the experts, whole
    ep1, _ = run(model, prompts, tp=2, ep=1)
    assert ep1 == expected


@pytest.mark.slow
@pytest.mark.parametrize("name", ["moe-fp8-hd64", "gptoss-mxfp4"])
def test_ep2_quantized_matches_one_rank(models_dir, name):
    """FP8 and MXFP4 experts read as stored on each rank (their codes and scales, its experts only): the tokens of
    one rank (test_moe_models checks those against transformers)."""
    model = _make(models_dir, name, **MODELS[name])
    prompts = prompts_of(LENGTHS, 1000, seed=8)
    ep2, layout = run(model, prompts, tp=2, ep=2)
    one, single = run(model, prompts)
    assert ep2 == one and layout["expert_bytes"] * 2 == single["expert_bytes"]


@pytest.mark.parametrize("name", ["moe", "gptoss", "moe-fp8-hd64", "gptoss-mxfp4"])
def test_each_rank_loads_only_its_experts(models_dir, name):
    """Read from the checkpoint per rank (no process group needed to load): ep=2 gives each rank a disjoint half of
    the experts, whole, in their stored format; the two halves hold the one rank's bytes."""
    model_dir = _make(models_dir, name, **MODELS[name])

    def experts(par):
        model, _ = load_model(model_dir, "float32", par)
        return [m for m in model.modules() if isinstance(m, Experts)]

    full = experts(TPGroup(0, 1))
    ranks = [experts(TPGroup(r, 2, 2)) for r in range(2)]
    for layer, whole in enumerate(full):
        a, b = ranks[0][layer], ranks[1][layer]
        assert (a.e0, a.e1, b.e0, b.e1) == (0, 4, 4, 8) and (a.i0, a.i1) == (b.i0, b.i1) == (whole.i0, whole.i1)
        assert a.nbytes == b.nbytes == whole.nbytes // 2
        assert a.w13.dtype == whole.w13.dtype and a.fmt == whole.fmt
        assert (a.w13 == whole.w13[:4]).all() and (b.w2 == whole.w2[4:]).all()


@pytest.mark.parametrize("model,flags,says", [
    ("moe", ("--tp", "2", "--ep", "3"), "config error: ep = 3 does not divide tp = 2"),
    ("dense", ("--tp", "2", "--ep", "2"), "ep = 2 splits a mixture-of-experts model's experts, and Qwen3ForCausalLM has none"),
    ("moe6", ("--tp", "4", "--ep", "4"), "num_experts = 6 is not divisible by ep = 4"),
    ("moe-fp8-hd64", ("--tp", "2"), "splits each expert's 32 intermediate rows into 16 a rank, not whole fp8 blocks"),
])
def test_a_layout_the_experts_do_not_split_into_is_one_line(models_dir, tiny_qwen3, model, flags, says):
    """Before any rank starts: exit 78, one line naming the value, no traceback."""
    path = {"dense": tiny_qwen3}.get(model) or _make(
        models_dir, model, **(dict(preset="tiny-moe", seed=3, overrides={"num_experts": 6}) if model == "moe6"
                              else MODELS[model]))
    out = subprocess.run([sys.executable, "-m", "trnd", "serve", "--aggregated", "--model", str(path), *flags],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 78 and "Traceback" not in out.stderr, out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if "error" in ln]
    assert len(lines) == 1 and says in lines[0], out.stderr[-2000:]


def test_points_reports_the_experts_a_rank(models_dir):
    model = _make(models_dir, "moe", **MODELS["moe"])
    out = subprocess.run([sys.executable, "-m", "trnd", "points", "--model", str(model), "--tp", "2", "--ep", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tp 2, ep 2" in out.stdout and "experts a rank: 4 of 8, each whole" in out.stdout


@pytest.mark.slow
def test_serve_tp2_ep2_through_the_openai_client(models_dir, tmp_path):
    """`trnd serve --tp 2 --ep 2`: the local prefill + decode pair, each two ranks holding half the experts; the
    official client gets transformers' greedy tokens."""
    model = _make(models_dir, "moe", **MODELS["moe"])
    prompts = prompts_of([6, 70], 1000, seed=9)  # the long one goes to the prefill peer (not prefilled on decode)
    expected = hf_greedy(model, prompts, 6)
    s = Server(model, tmp_path, "--tp", "2", "--ep", "2", "--local-prefill-tokens", "0")
    try:
        with s.client() as c:
            name = c.models.list().data[0].id
            for p, want in zip(prompts, expected, strict=True):
                r = c.completions.create(model=name, prompt=p, max_tokens=6, temperature=0, logprobs=1,
                                         extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
                got = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
                assert got == want
        st = s.state()
        assert st["layout"]["tp"] == 2 and st["layout"]["ep"] == 2 and st["transfers"]["handoffs"] >= 1
        s.wait_idle()
    finally:
        s.stop()


@pytest.mark.slow
def test_prefill_tp2_ep2_hands_off_to_decode_tp1(models_dir, tmp_path):
    """The KV depends on tp alone (transfer/protocol.py Manifest.ep is reported, not compared): prefill's two ranks
    with half the experts each write decode's one-rank pool, and decode continues with all eight."""
    from tests.procs.test_disagg import Deployment

    model = _make(models_dir, "moe", **MODELS["moe"])
    secret = tmp_path / "secret"
    secret.write_text("test-secret-0123456789")
    prompts = prompts_of([9, 600], 1000, seed=4)
    expected = hf_greedy(model, prompts, 6)
    d = Deployment(model, secret, prefill_tp=2, prefill_extra=("--ep", "2"), decode_extra=("--local-prefill-tokens",
                                                                                          "0"))
    try:
        for p, want in zip(prompts, expected, strict=True):
            r = d.client.completions.create(model="m", prompt=p, max_tokens=6, temperature=0, logprobs=1,
                                            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
            assert [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens] == want
        peer = admin_state(d.prefills[0][2])["peers"][0]
        assert (peer["tp"], peer["ep"]) == (1, 1)  # the decode server as prefill saw it in the handshake
        assert admin_state(d.prefills[0][2])["layout"]["ep"] == 2
        assert admin_state(d.port)["transfers"]["handoffs"] >= 1
        assert wait_for(d.baseline_ok)
    finally:
        d.close()
