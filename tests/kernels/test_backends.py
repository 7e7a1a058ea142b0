"""Backend selection: the contract, the one-line messages for an unavailable backend (missing SDK, the PyPI
placeholders, no device, a CPU-only torch), lazy SDK imports, the Neuron ops dispatch, and the check
command's own machinery. The SDK states are simulated (sys.modules, sys.path, version lookups); no test
here produces or fakes a device result."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from trnd_kernels import TORCH_OPS, norm
from trnd_kernels import attention as twin_attention
from trnd_kernels.cases import make_decode_case
from trnd import check
from trnd.backends import Backend, BackendUnavailable, get_backend
from trnd.backends import neuron as neuron_mod
from trnd.backends.cuda import CUDABackend
from trnd.backends.neuron import NeuronBackend

SDK_MODULES = ("torch_neuronx", "neuronxcc", "nki")


def test_cpu_backend():
    b = get_backend("cpu")
    assert (b.name, b.device, b.available()) == ("cpu", "cpu", (True, ""))
    # the compiled kernels where they are built for this CPU (tests/kernels/test_cpu_kernels.py), else the torch twins
    from trnd_kernels.cpu import cpu_ops

    assert b.ops is cpu_ops()
    # one table: every op compiled, or every op the torch reference
    assert (b.ops.rms_norm is TORCH_OPS.rms_norm) == (b.ops.decode_attention is TORCH_OPS.decode_attention)


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="'tpu': not one of cpu, cuda, neuron"):
        get_backend("tpu")


def test_importing_trnd_touches_no_sdk_and_no_cuda():
    code = ("import sys, torch, trnd, trnd.backends, trnd.backends.cpu, trnd.backends.cuda, "
            "trnd.backends.neuron, trnd.check\n"
            "loaded = [m for m in sys.modules if m.split('.')[0] in "
            "('torch_neuronx', 'nki', 'neuronxcc', 'torch_xla') or m.startswith('trnd_kernels.nki')]\n"
            "print(loaded, torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] False"


# -- neuron: the SDK states an operator meets ----------------------------------------------------------------

def _missing(monkeypatch, *modules):
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)  # `import m` now raises ImportError


def _versions(monkeypatch, **versions):
    names = {"torch_neuronx": "torch-neuronx", "neuronx_cc": "neuronx-cc", "nki": "nki"}
    table = {names[k]: v for k, v in versions.items()}
    monkeypatch.setattr(neuron_mod, "installed_version", lambda dist: table.get(dist))


def test_neuron_sdk_not_installed(monkeypatch):
    _missing(monkeypatch, *SDK_MODULES)
    _versions(monkeypatch)
    ok, why = NeuronBackend().available()
    assert not ok
    assert why.startswith("torch-neuronx is not installed; neuronx-cc is not installed; nki is not installed; ")
    with pytest.raises(BackendUnavailable) as e:
        get_backend("neuron")
    msg = str(e.value)
    assert "\n" not in msg
    assert "install the AWS Neuron SDK (torch-neuronx, neuronx-cc, nki) from AWS's Neuron pip repository " \
           "https://pip.repos.neuron.amazonaws.com, see docs/NEURON.md" in msg


def _pypi_placeholders(root):
    """Lay out the three PyPI placeholder wheels as pip installs them (their real files: a dist-info and an
    __init__.py that raises; neuronx-cc's package directory is even named `neuronx-cc`)."""
    for dist, pkg, version in (("torch_neuronx", "torch_neuronx", "1.0"), ("neuronx_cc", "neuronx-cc", "1.0.post1"),
                               ("nki", "nki", "0.0.1")):
        (root / pkg).mkdir()
        (root / pkg / "__init__.py").write_text('raise ImportError("WRONG PACKAGE. Please install the package '
                                                'from Neuron Repository - pip.repos.neuron.amazonaws.com")\n')
        info = root / f"{dist}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\n"
                                       f"Version: {version}\n")


def test_neuron_pypi_placeholders_are_named(monkeypatch, tmp_path):
    _pypi_placeholders(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in SDK_MODULES:
        monkeypatch.delitem(sys.modules, m, raising=False)
    ok, why = NeuronBackend().available()
    assert not ok
    assert "the torch-neuronx on this machine is the PyPI placeholder (torch-neuronx 1.0), not the SDK" in why
    assert "the neuronx-cc on this machine is the PyPI placeholder (neuronx-cc 1.0.post1), not the SDK" in why
    assert "the nki on this machine is the PyPI placeholder (nki 0.0.1), not the SDK" in why
    assert why.endswith("https://pip.repos.neuron.amazonaws.com, see docs/NEURON.md")


def test_neuron_placeholder_caught_by_its_import_error(monkeypatch, tmp_path):
    """A placeholder of a version we have not seen still says WRONG PACKAGE when imported."""
    pkg = tmp_path / "torch_neuronx"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('raise ImportError("WRONG PACKAGE. Please install the package from Neuron '
                                     'Repository - pip.repos.neuron.amazonaws.com")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_neuronx", raising=False)
    _versions(monkeypatch, torch_neuronx="1.1")
    assert neuron_mod.probe("torch-neuronx", "torch_neuronx") == \
        "the torch-neuronx on this machine is the PyPI placeholder (torch-neuronx 1.1), not the SDK"


def test_neuron_placeholder_caught_by_version(monkeypatch):
    monkeypatch.setitem(sys.modules, "nki", types.ModuleType("nki"))
    _versions(monkeypatch, nki="0.0.3")
    assert "is the PyPI placeholder (nki 0.0.3)" in neuron_mod.probe("nki", "nki")


def test_neuron_broken_install_quotes_the_import_error(monkeypatch):
    _missing(monkeypatch, "neuronxcc")
    _versions(monkeypatch, neuronx_cc="2.27.5334.0")
    why = neuron_mod.probe("neuronx-cc", "neuronxcc")
    assert why.startswith("neuronx-cc 2.27.5334.0 is installed but `import neuronxcc` fails (")


def test_neuron_sdk_without_device(monkeypatch, tmp_path):
    for m in SDK_MODULES:
        monkeypatch.setitem(sys.modules, m, types.ModuleType(m))
    _versions(monkeypatch, torch_neuronx="2.9.0.2.15.32035", neuronx_cc="2.27.5334.0", nki="0.6.0")
    monkeypatch.setattr(neuron_mod, "DEVICE_GLOB", str(tmp_path / "neuron*"))
    ok, why = NeuronBackend().available()
    assert not ok
    assert why.startswith("the Neuron SDK imports but there is no Neuron device")
    assert "trn2" in why
    (tmp_path / "neuron0").touch()
    assert NeuronBackend().available() == (True, "")


# -- neuron: ops dispatch -------------------------------------------------------------------------------------

def test_neuron_ops_swap_in_kernels_and_keep_twins():
    from trnd_kernels.nki import decode_attention, prefill_attention, rmsnorm, rotary

    ops = NeuronBackend().ops  # composing ops imports kernels.nki, which imports without the SDK
    assert ops.rms_norm is rmsnorm.rms_norm and ops.add_rms_norm is rmsnorm.add_rms_norm
    assert ops.apply_rotary is rotary.apply_rotary and ops.decode_attention is decode_attention.decode_attention
    assert ops.prefill_attention is prefill_attention.prefill_attention
    assert ops.silu_and_mul is TORCH_OPS.silu_and_mul and ops.write_kv is TORCH_OPS.write_kv


def test_neuron_ops_use_the_twin_outside_the_kernel_constraints():
    """Shapes a kernel refuses go to the twin (so this runs here, on the CPU, without the SDK)."""
    from trnd_kernels.nki import SDKMissing

    ops = NeuronBackend().ops
    x, w = torch.randn(3, 9000), torch.rand(9000)  # hidden > 8192: outside rms_norm's supports()
    assert torch.equal(ops.rms_norm(x, w, 1e-6), norm.rms_norm(x, w, 1e-6))
    q, kv, meta = make_decode_case([5, 20], 4, 2, 256, 16)  # head_dim 256 > 128
    assert torch.equal(ops.decode_attention(q, kv, 0, meta, 0.1), twin_attention.decode_attention(q, kv, 0, meta, 0.1))
    with pytest.raises(SDKMissing, match="needs the Neuron SDK"):  # inside: the kernel, which needs the SDK
        ops.rms_norm(torch.randn(3, 64), torch.rand(64), 1e-6)


# -- cuda ----------------------------------------------------------------------------------------------------

def test_cuda_on_a_cpu_only_torch(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    ok, why = CUDABackend().available()
    assert not ok and "is a CPU-only build; install a CUDA build of torch" in why and "NVIDIA GPU" in why


def test_cuda_build_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, why = CUDABackend().available()
    assert not ok and "built for CUDA 12.8 but sees no NVIDIA GPU" in why


# -- the check command ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["neuron", "cuda"])
def test_check_exits_unavailable_with_the_reason(name, monkeypatch, capsys):
    def unavailable(n):
        raise BackendUnavailable(f"backend {n!r} is unavailable: simulated")

    monkeypatch.setattr(check, "get_backend", unavailable)
    assert check.main([name]) == check.EX_UNAVAILABLE
    assert capsys.readouterr().err.strip() == f"trnd check {name}: backend '{name}' is unavailable: simulated"


def test_check_here_says_the_sdk_is_missing(capsys):
    """On this machine (no SDK, no GPU) the real check refuses and says why; it never reports a pass."""
    if NeuronBackend().available()[0]:
        pytest.skip("this machine has a working Neuron SDK and device")
    assert check.main(["neuron"]) == check.EX_UNAVAILABLE
    err = capsys.readouterr().err
    assert "https://pip.repos.neuron.amazonaws.com" in err and "PASS" not in err


class _Broken(Backend):
    """A backend whose rms_norm is off by 1%: the check must notice."""

    name = "broken"

    @property
    def ops(self):
        from dataclasses import replace

        return replace(TORCH_OPS, rms_norm=lambda x, w, eps: norm.rms_norm(x, w, eps) * 1.01)


def test_compare_kernels_flags_a_wrong_kernel():
    results = check.compare_kernels(_Broken(), dtypes=(torch.float32,))
    bad = {r.name for r in results if not r.ok}
    assert bad and all(n.startswith("rms_norm") for n in bad)
    assert any(r.ok and r.name.startswith("decode_attention") for r in results)


def test_compare_generation_plumbing(tiny_qwen3):
    """The harness on the CPU against itself: it runs the engine through LLM and compares token lists."""
    r = check.compare_generation(get_backend("cpu"), str(tiny_qwen3), tokens=4)
    assert r.ok, r.detail
    assert r.detail.startswith("4/4 prompts identical over 4 greedy tokens")


def test_check_cases_are_inside_the_kernel_constraints():
    """So on a trn2 host `trnd check neuron` runs the NKI kernels, not their fallbacks."""
    from trnd_kernels.nki import decode_attention, prefill_attention, rmsnorm, rotary

    for dtype in (torch.bfloat16, torch.float32):
        for name, op, args in check.kernel_cases(dtype):
            if op in ("rms_norm", "add_rms_norm"):
                inside = rmsnorm.supports(args[0].shape, args[-2].shape, dtype)
            elif op == "apply_rotary":
                inside = rotary.supports(args[0].shape, args[1].shape, args[2].shape, dtype)
            elif op == "decode_attention":
                q, kv, _, meta, _ = args
                inside = decode_attention.supports(q.shape, kv.shape, meta.decode_pages.shape, dtype)
            else:
                q, _, _, kv, _, seq, _, _ = args
                inside = prefill_attention.supports(q.shape, kv.shape, seq.pages.shape[0], dtype)
            assert inside, name
