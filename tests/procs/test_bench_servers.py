"""serve-compare's servers at each side's dtype for the CPU at hand: trnd at its default (`auto`), vLLM at
its best (bf16 only where the CPU has bf16 in hardware). On an AVX2-only CPU a bf16 run is emulated and
measures neither server as its operator would run it."""

import pytest

from trnd_kernels.cpuinfo import cpu_info
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


def test_a_trnd_server_on_the_torch_ops_is_a_problem_row(tmp_path):
    """serve-compare reads each trnd server's log: one whose processes ran the torch ops (no build, or a build
    stale against the sources) is reported, not passed off as trnd's figures; a peer's log is not read."""
    from trnd.bench.servers import Server, kernel_problems

    def server(key: str, text: str) -> Server:
        log = tmp_path / f"{key}.log"
        log.write_text(text)
        return Server(key, ["true"], {}, 0, log, "/health")

    stale = ("05:04:50 INFO    trnd.kernels: cpu kernels: not used (/x/trnd_avx512.so was built from other sources "
             "than /x/csrc (changed since): rebuild it); the torch ops run\n")
    got = kernel_problems(server("trnd-disagg", "start\n" + stale + stale))
    assert len(got) == 1 and "torch ops" in got[0] and "built from other sources" in got[0]
    assert kernel_problems(server("trnd-agg", "INFO trnd.kernels: cpu kernels: trnd_avx512 with dpbf16 on ...\n")) == []
    assert kernel_problems(server("vllm", stale)) == []
