"""serve-compare's servers at each side's dtype for the CPU at hand: trnd at its default (`auto`), vLLM at
its best (bf16 only where the CPU has bf16 in hardware). On an AVX2-only CPU a bf16 run is emulated and
measures neither server as its operator would run it."""

import pytest

from kernels.cpuinfo import cpu_info
from trnd.bench.servers import Ctx, make_server, peer_dtype


@pytest.fixture
def isa(monkeypatch):
    def cap(level: str):
        monkeypatch.setenv("TRND_CPU_ISA", level)
        cpu_info.cache_clear()

    yield cap
    cpu_info.cache_clear()


def _ctx(tmp_path) -> Ctx:
    return Ctx("/models/small", "/peer/bin/python", str(tmp_path / "w.py"), tmp_path, 2, None)


def test_the_peer_runs_float32_on_a_cpu_without_native_bf16(isa, tmp_path):
    isa("avx2")
    assert peer_dtype() == "float32"
    cmd = make_server("vllm", _ctx(tmp_path)).cmd
    assert cmd[cmd.index("--dtype") + 1] == "float32"


def test_the_peer_runs_bf16_where_the_cpu_computes_it(isa, tmp_path):
    isa("")
    if not cpu_info().native_bf16:
        pytest.skip(f"this CPU has no native bf16 ({cpu_info().summary()}): only the float32 case applies here")
    cmd = make_server("vllm", _ctx(tmp_path)).cmd
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"


@pytest.mark.parametrize("key", ["trnd-agg", "trnd-disagg", "trnd-agg-compiled", "trnd-disagg-roles"])
def test_trnd_runs_at_its_default_dtype(isa, tmp_path, key):
    isa("avx2")
    srv = make_server(key, _ctx(tmp_path))
    assert not any("--dtype" in w for w in srv.cmd), srv.cmd
