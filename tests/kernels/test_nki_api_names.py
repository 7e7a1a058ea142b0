"""Every nl.* / nisa.* name (and keyword) the NKI kernels use exists in the NKI API, read with `ast`.

The SDK does not install here, so this is the check that runs everywhere: a renamed or misspelt API, a
keyword from an older NKI (e.g. the pre-0.3 return-value style without `dst=`), or a deprecated loop
iterator fails here before anyone reaches a trn2 host.

Allow-lists: NKI 0.6.0, AWS Neuron SDK 2.32.0 (released 2026-08-17), taken from the API reference pages
nki/api/nki.language.rst and nki/api/nki.isa.rst and their API stubs nki/api/nki/language/__init__.py and
nki/api/nki/isa/__init__.py in the aws-neuron/aws-neuron-sdk documentation repository (commit 81ce03ae,
2026-08-21), i.e. https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/nki.isa.html and
.../nki.language.html. Keyword lists are the stubs' signatures.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels" / "nki"

# nki.isa functions -> their parameters.
NISA_FUNCS = {
    "get_nc_version": [], "dma_copy": ["dst", "src", "priority", "oob_mode", "dge_mode", "engine", "name"],
    "tensor_copy": ["dst", "src", "engine", "name"], "memset": ["dst", "value", "engine", "name"],
    "tensor_copy_predicated": ["dst", "src", "predicate", "reverse_pred", "name"],
    "nc_matmul": ["dst", "stationary", "moving", "is_stationary_onezero", "is_moving_onezero", "is_transpose",
                  "accumulate", "tile_position", "tile_size", "perf_mode", "name"],
    "nc_matmul_mx": ["dst", "stationary", "moving", "stationary_scale", "moving_scale", "tile_position",
                     "tile_size", "accumulate", "name"],
    "nc_transpose": ["dst", "data", "engine", "name"],
    "dma_transpose": ["dst", "src", "axes", "priority", "dge_mode", "oob_mode", "name"],
    "tensor_tensor": ["dst", "data1", "data2", "op", "engine", "name"],
    "tensor_scalar": ["dst", "data", "op0", "operand0", "reverse0", "op1", "operand1", "reverse1", "engine", "name"],
    "tensor_reduce": ["dst", "op", "data", "axis", "negate", "keepdims", "name"],
    "tensor_partition_reduce": ["dst", "op", "data", "name"],
    "tensor_scalar_cumulative": ["dst", "src", "op0", "op1", "imm0", "imm1", "reduce_cmd", "name"],
    "activation": ["dst", "op", "data", "bias", "scale", "reduce_op", "reduce_res", "reduce_cmd", "name"],
    "activation_reduce": ["dst", "op", "data", "reduce_op", "reduce_res", "bias", "scale", "name"],
    "activate2": ["dst", "op", "data", "imm0", "imm1", "op0", "op1", "relu_param", "reverse0", "reverse1",
                  "reduce_op", "reduce_res", "reduce_cmd", "name"],
    "iota": ["dst", "pattern", "offset", "channel_multiplier", "name"],
    "affine_select": ["dst", "pattern", "channel_multiplier", "on_true_tile", "on_false_value", "cmp_op", "offset",
                      "name"],
    "local_gather": ["dst", "src_buffer", "index", "num_elem_per_idx", "num_valid_indices", "name"],
    "nc_n_gather": ["dst", "data", "indices", "name"], "bn_stats": ["dst", "data", "name"],
    "bn_aggr": ["dst", "data", "name"],
    "tensor_tensor_scan": ["dst", "data0", "data1", "initial", "op0", "op1", "reverse0", "reverse1", "name"],
    "nc_stream_shuffle": ["dst", "src", "shuffle_mask", "name"], "rng": ["dst", "engine", "name"],
    "dropout": ["dst", "data", "prob", "name"], "set_rng_seed": ["src_seeds", "name"],
    "rand_set_state": ["src_seeds", "engine", "name"], "rand_get_state": ["dst", "engine", "name"],
    "rand2": ["dst", "min", "max", "name"],
    "exponential": ["dst", "src", "max_value", "reduce_res", "reduce_cmd", "reduce_init", "name"],
    "reciprocal": ["dst", "data", "name"], "max8": ["dst", "src", "name"],
    "sequence_bounds": ["dst", "segment_ids", "name"],
    "scalar_tensor_tensor": ["dst", "data", "op0", "operand0", "op1", "operand1", "reverse0", "reverse1", "name"],
    "tensor_scalar_reduce": ["dst", "data", "op0", "operand0", "reduce_op", "reduce_res", "reverse0", "reduce_cmd",
                             "reduce_init", "reduce_res_negate", "name"],
    "core_barrier": ["data", "cores", "engine", "name"],
    "dma_compute": ["dst", "srcs", "reduce_op", "scales", "unique_indices", "oob_mode", "name"],
    "quantize_mx": ["dst", "src", "dst_scale", "name"],
    "range_select": ["dst", "on_true_tile", "comp_op0", "comp_op1", "bound0", "bound1", "reduce_cmd", "reduce_res",
                     "reduce_op", "range_start", "on_false_value", "name"],
    "select_reduce": ["dst", "predicate", "on_true", "on_false", "reduce_res", "reduce_cmd", "reduce_op",
                      "reverse_pred", "name"],
    "sendrecv": ["src", "dst", "send_to_rank", "recv_from_rank", "pipe_id", "dma_engine", "name"],
    "register_alloc": ["x"], "register_move": ["dst", "src"], "register_load": ["dst", "src"],
    "register_store": ["dst", "src"], "nc_find_index8": ["dst", "data", "vals", "name"],
    "nc_match_replace8": ["dst", "data", "vals", "imm", "dst_idx", "name"],
    "nonzero_with_count": ["dst", "src", "index_offset", "padding_val", "name"],
    "topk": ["val_dst", "idx_dst", "src", "n", "name"],
}
# nki.isa config enums -> members.
NISA_ENUMS = {
    "engine": ["tensor", "vector", "scalar", "gpsimd", "dma", "sync", "unknown"],
    "reduce_cmd": ["idle", "reset", "reduce", "reset_reduce", "load_reduce"],
    "dge_mode": ["unknown", "swdge", "hwdge", "none"], "oob_mode": ["error", "skip"],
    "matmul_perf_mode": ["none", "double_row"], "nc_version": ["gen2", "gen3", "gen4"],
    "dma_engine": ["dma", "gpsimd_dma"],
}
# nki.language functions (ops usable as `op=` operands are functions too) -> parameters.
_UNARY = ["abs", "square", "invert", "logical_not", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu",
          "gelu", "gelu_apprx_sigmoid", "gelu_apprx_tanh", "gelu_dx", "gelu_apprx_sigmoid_dx", "silu", "silu_dx",
          "softplus", "mish", "erf", "erf_dx", "reciprocal", "copy", "sin", "cos", "tan", "arctan", "ceil", "floor",
          "trunc", "negative", "sign"]
_BINARY = ["add", "subtract", "multiply", "divide", "maximum", "minimum", "abs_max", "abs_min", "power", "equal",
           "not_equal", "less", "less_equal", "greater", "greater_equal", "bitwise_and", "bitwise_or",
           "bitwise_xor", "left_shift", "right_shift", "logical_and", "logical_or", "logical_xor", "fmod", "mod"]
NL_FUNCS = {
    **{f: ["x", "dtype"] for f in _UNARY}, **{f: ["x", "y", "dtype"] for f in _BINARY},
    **{f: ["x", "axis", "dtype", "keepdims"] for f in ("sum", "max", "min", "mean", "prod", "var")},
    "all": ["x", "axis", "dtype"], "softmax": ["x", "axis", "dtype"],
    "rms_norm": ["x", "w", "axis", "n", "epsilon", "dtype", "compute_dtype"],
    "where": ["condition", "x", "y", "dtype"], "dropout": ["x", "rate", "dtype"],
    "ndarray": ["shape", "dtype", "buffer", "name", "address"], "zeros": ["shape", "dtype", "buffer", "name"],
    "ones": ["shape", "dtype", "buffer", "name"], "full": ["shape", "fill_value", "dtype", "buffer", "name"],
    "zeros_like": ["x", "dtype", "buffer", "name"], "empty_like": ["x", "dtype", "buffer", "name"],
    "rand": ["shape", "dtype", "buffer", "name"], "random_seed": ["seed"],
    "shared_constant": ["constant"], "shared_identity_matrix": ["n", "dtype", "dst"],
    "expand_dims": ["x", "axis"], "broadcast_to": ["x", "shape", "dtype"], "transpose": ["x", "dtype"],
    "matmul": ["x", "y", "transpose_x"], "load": ["src", "dtype"], "load_transpose2d": ["src", "dtype"],
    "store": ["dst", "value"], "gather_flattened": ["data", "indices", "axis", "dtype"], "ds": ["start", "size"],
    "affine_range": ["start", "stop", "step"], "sequential_range": ["start", "stop", "step"],
    "static_range": ["start", "stop", "step"], "dynamic_range": ["start", "stop", "step"],
    "fori_loop": ["lower", "upper", "body_fun", "step"], "while_loop": ["init", "body_fun"],
    "no_reorder": [], "program_id": ["axis"], "num_programs": ["axes"], "program_ndim": [],
    "device_print": ["print_prefix", "tensor"], "is_hbm": ["buffer"], "is_on_chip": ["buffer"],
    "is_psum": ["buffer"], "is_sbuf": ["buffer"],
}
NL_CONSTANTS = {
    "bool_", "int8", "int16", "int32", "uint8", "uint16", "uint32", "float16", "float32", "bfloat16", "tfloat32",
    "float8_e4m3", "float8_e4m3fn", "float8_e5m2", "float8_e5m2_x4", "float8_e4m3fn_x4", "float8_e8m0fnu",
    "float4_e2m1fn_x4", "sbuf", "psum", "hbm", "private_hbm", "shared_hbm", "tile_size", "prelu", "bypass",
    "NkiTensor", "NKIObject",
}
TILE_SIZE = {"pmax", "psum_bank_fmax", "psum_bank_fmax_bytes", "gemm_stationary_fmax", "gemm_moving_fmax",
             "bn_stats_fmax", "psum_min_align", "sbuf_min_align", "psum_num_banks", "sbuf_size_bytes", "sbuf_fmax",
             "sbuf_fmax_bytes"}  # psum_fmax and total_available_sbuf_size are deprecated since 0.4.0
# Deprecated in the 0.6.0 reference: plain `range` replaces the first three, fori_loop/while_loop the last.
DEPRECATED = {"affine_range", "sequential_range", "static_range", "dynamic_range"}
AP_PARAMS = ["pattern", "offset", "scalar_offset", "vector_offset", "indirect_dim", "dtype"]  # NkiTensor.ap


def kernel_files() -> list[Path]:
    return sorted(p for p in KERNEL_DIR.glob("*.py") if p.name != "__init__.py")


def _chain(node: ast.AST) -> list[str] | None:
    """nl.tile_size.pmax -> ["nl", "tile_size", "pmax"]; None unless rooted at a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def _check_call(call: ast.Call, name: str, params: list[str], where: str) -> list[str]:
    bad = []
    if len(call.args) > len(params):
        bad.append(f"{where}: {name} takes at most {len(params)} positional arguments, got {len(call.args)}")
    bad += [f"{where}: {name} has no keyword {k.arg!r}" for k in call.keywords if k.arg and k.arg not in params]
    return bad


def problems(source: str, filename: str) -> list[str]:
    """Every use of nl.* / nisa.* (and NkiTensor.ap keywords) that the 0.6.0 API does not have."""
    tree = ast.parse(source, filename)
    bad = []
    calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    seen = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in seen:
            continue
        chain = _chain(node)
        # Mark the inner attributes of this chain as seen so nl.tile_size.pmax is judged once, whole.
        inner = node.value
        while isinstance(inner, ast.Attribute):
            seen.add(id(inner))
            inner = inner.value
        where = f"{filename}:{node.lineno}"
        if chain is None or chain[0] not in ("nl", "nisa"):
            if isinstance(node, ast.Attribute) and node.attr == "ap" and id(node) in calls:
                bad += _check_call(calls[id(node)], ".ap", AP_PARAMS, where)
            continue
        root, name, rest = chain[0], chain[1] if len(chain) > 1 else "", chain[2:]
        if root == "nl":
            if name in DEPRECATED:
                bad.append(f"{where}: nl.{name} is deprecated in NKI 0.6.0")
            elif name in NL_FUNCS:
                if rest:
                    bad.append(f"{where}: nl.{'.'.join(chain[1:])} is not an API")
                elif id(node) in calls:
                    bad += _check_call(calls[id(node)], f"nl.{name}", NL_FUNCS[name], where)
            elif name == "tile_size":
                if len(rest) != 1 or rest[0] not in TILE_SIZE:
                    bad.append(f"{where}: nl.{'.'.join(chain[1:])} is not a current tile_size constant")
            elif name not in NL_CONSTANTS or rest:
                bad.append(f"{where}: nl.{'.'.join(chain[1:])} is not in nki.language")
        else:
            if name in NISA_FUNCS:
                if rest:
                    bad.append(f"{where}: nisa.{'.'.join(chain[1:])} is not an API")
                elif id(node) in calls:
                    bad += _check_call(calls[id(node)], f"nisa.{name}", NISA_FUNCS[name], where)
            elif name in NISA_ENUMS:
                if len(rest) != 1 or rest[0] not in NISA_ENUMS[name]:
                    bad.append(f"{where}: nisa.{'.'.join(chain[1:])} is not a member of nisa.{name}")
            else:
                bad.append(f"{where}: nisa.{'.'.join(chain[1:])} is not in nki.isa")
    return bad


def test_there_are_kernels_to_check():
    names = {p.name for p in kernel_files()}
    assert {"rmsnorm.py", "rotary.py", "decode_attention.py"} <= names


@pytest.mark.parametrize("path", kernel_files(), ids=lambda p: p.name)
def test_kernel_uses_only_documented_nki_api(path):
    source = path.read_text()
    assert "nisa." in source and "nl." in source, "no NKI calls found: is this still a kernel file?"
    assert problems(source, path.name) == []


@pytest.mark.parametrize("path", kernel_files(), ids=lambda p: p.name)
def test_kernel_imports_the_current_namespace(path):
    """Kernels take nl/nisa from trnd_kernels.nki (which imports `nki`), never the older neuronxcc.nki."""
    tree = ast.parse(path.read_text())
    modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in modules if m and m.startswith("neuronxcc")]
    assert "trnd_kernels.nki" in modules


def test_package_imports_nki_namespace():
    tree = ast.parse((KERNEL_DIR / "__init__.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {"nki", "nki.isa", "nki.language"} <= imported


@pytest.mark.parametrize("snippet, complaint", [
    ("nisa.tensor_add(dst=a, data1=b, data2=c)", "not in nki.isa"),
    ("nisa.tensor_tensor(dst=a, data1=b, data2=c, op=nl.add, dtype=nl.float32)", "no keyword 'dtype'"),
    ("nisa.nc_matmul(a, b)", ""),  # positional dst-first call: fine
    ("x = nisa.tensor_reduce(op=nl.max, data=t, axis=1)", ""),  # nl.max is a documented reduction function
    ("nisa.activation(dst=a, op=nl.exp, data=b, bias=c, scale=1.0, negate=True)", "no keyword 'negate'"),
    ("for i in nl.affine_range(4): pass", "deprecated"),
    ("t = nl.tile_size.psum_fmax", "not a current tile_size constant"),
    ("t = nl.par_dim(128)", "not in nki.language"),
    ("nisa.activation(dst=a, op=nl.exp, data=b, reduce_cmd=nisa.reduce_cmd.reset_reduce)", ""),
    ("nisa.activation(dst=a, op=nl.exp, data=b, reduce_cmd=nisa.reduce_cmd.clear)", "not a member"),
    ("src = kv.ap(pattern=[[1, 2]], scalar_offset=r, indirect_dim=0)", ""),
    ("src = kv.ap(pattern=[[1, 2]], dynamic_offset=r)", "no keyword 'dynamic_offset'"),
])
def test_checker_catches_what_it_should(snippet, complaint):
    """The checker itself: it must reject what the 0.6.0 API lacks and accept what it has."""
    found = problems(snippet, "snippet")
    if complaint:
        assert found and complaint in found[0]
    else:
        assert found == []
