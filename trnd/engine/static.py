"""StaticRunner: the model at a fixed set of shapes, the buckets of a decode point, as an accelerator runs it.

Neuron compiles a graph per input shape (as NxD Inference does, per context-encoding and token-generation
bucket), and a CUDA graph replays fixed shapes only, so each step's inputs are padded up to the next bucket
and nothing inside the compiled region depends on the data for a shape:

- decode: B rows (the next of the point's `decode_buckets`) x a page-table width W (a power of two of pages,
  up to max_context / page_size). Padding rows write their KV into the scratch page, read only it, and
  attend one slot of it; padding table entries repeat the row's first page and lie past its context, masked.
- prefill: one sequence's chunk per forward, T tokens (the next of `prefill_buckets`) x W pages of context
  (`kernels.attention.chunk_attention`: every key read from the pool, masked by position). Padding tokens
  write into the scratch page at position 0; their rows are dropped.

A step the scheduler mixed (decodes plus prefill chunks of several sequences) becomes several forwards:
the decodes (in groups of the largest batch bucket), then each chunk (in pieces of the largest token
bucket). Attention never crosses sequences, so this computes what ModelRunner computes in one forward.

Each kind is one `torch.compile(fullgraph=True, dynamic=False)` function, specialized by dynamo on each
bucket's shapes (one graph per bucket, compiled on first use; `warmup` compiles them ahead, as a Neuron
deployment should). On CUDA each decode bucket is then captured as a CUDA graph and replayed.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from trnd_kernels.attention import AttnMeta
from trnd.engine.runner import ModelRunner, StepInputs
from trnd.model.config import ModelConfig
from trnd.points import DecodePoint, get_point

# torch.compile backend per device: CPU runs the traced graph as is (the static path exists there to be
# tested); "neuron" is TorchNeuron's backend, registered when torch-neuronx is imported.
COMPILERS = {"cpu": "eager", "cuda": "inductor", "neuron": "neuron"}


def pow2_buckets(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, 4 lo, ... below hi, then hi itself (NxD Inference's spacing)."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


def bucket(buckets: list[int], n: int, what: str) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{what} {n} is past the largest bucket ({buckets[-1]})")


def resolve_point(name: str | None, *, page_size: int, max_batch: int, chunk_size: int, max_context: int
                  ) -> DecodePoint:
    """The named point, checked against the engine's settings; or, without a name, one derived from them
    (powers of two up to max_batch rows, 16 .. chunk_size tokens)."""
    if name is None:
        return DecodePoint(max_context=max_context, max_batch=max_batch, page_size=page_size,
                           prefill_chunk=chunk_size, decode_buckets=pow2_buckets(1, max_batch),
                           prefill_buckets=pow2_buckets(min(16, chunk_size), chunk_size))
    point = get_point(name)
    if point.page_size != page_size:
        raise ValueError(f"point {name!r} has page_size {point.page_size}, the engine {page_size}: they must match")
    if max_context > point.max_context:
        raise ValueError(f"point {name!r} holds contexts up to {point.max_context} tokens, the engine "
                         f"{max_context}: set max_model_len <= {point.max_context}")
    return point


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _own_code(method):
    """The bound method with a code object of its own. Dynamo caches graphs, and counts recompiles, per code
    object: without this every runner in a process (tests make many) would share one cache and its limit."""
    f = method.__func__
    g = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return types.MethodType(g, method.__self__)


class StaticRunner(ModelRunner):
    def __init__(self, model, cfg: ModelConfig, kv: torch.Tensor, point: DecodePoint, scratch_page: int,
                 compiler: str | Callable | None = None, cuda_graphs: bool | None = None):
        """scratch_page: a page the engine reserved and never hands out, where padding writes its KV.
        compiler: a torch.compile backend (default: COMPILERS for the device).
        cuda_graphs: capture decode buckets as CUDA graphs (default: on CUDA)."""
        super().__init__(model, cfg, kv)
        if model.tp.size > 1:
            raise ValueError("the static path runs one rank (tp = 1); tensor-parallel workers run eagerly")
        assert point.page_size == self.page_size, (point.page_size, self.page_size)
        self.point, self.scratch = point, scratch_page
        self.decode_buckets = sorted(point.decode_buckets)
        self.prefill_buckets = sorted(point.prefill_buckets)
        self.widths = pow2_buckets(1, point.pool_pages_needed())
        self.vocab = model.lm_head.vocab
        # CausalLM.forward without its inference_mode: AOTAutograd (inductor) fails on inference tensors made
        # inside a compiled region (pytorch/pytorch#180823); this path runs under no_grad instead.
        fwd = type(model).forward
        self._model_forward = getattr(fwd, "__wrapped__", fwd)
        # dynamo specializes a function once per bucket and runs it eagerly past its recompile limit (8 by
        # default): a point has more buckets than that.
        n = len(self.widths) * max(len(self.decode_buckets), len(self.prefill_buckets))
        dyn = torch._dynamo.config
        dyn.recompile_limit = max(dyn.recompile_limit, n)
        dyn.accumulated_recompile_limit = max(dyn.accumulated_recompile_limit, 2 * n)
        self.compiler = compiler or COMPILERS.get(self.device.type, "eager")
        opts = dict(backend=self.compiler, fullgraph=True, dynamic=False)
        self._decode = torch.compile(_own_code(self._decode_graph), **opts)
        self._prefill = torch.compile(_own_code(self._prefill_graph), **opts)
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self._graphs: dict[tuple[int, int], tuple[list[torch.Tensor], torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_pool = None
        self.used: set[tuple[str, int, int]] = set()  # ("decode", B, W) / ("prefill", T, W) run so far

    def buckets(self) -> list[tuple[str, int, int]]:
        """Every graph of the point: ("decode", B, W) and ("prefill", T, W)."""
        return ([("decode", b, w) for b in self.decode_buckets for w in self.widths]
                + [("prefill", t, w) for t in self.prefill_buckets for w in self.widths])

    def counts(self) -> tuple[int, int]:
        """(graphs loaded from torch's compile cache, graphs compiled) in this process, from torch's own
        counters: inductor's FX graph cache hits and misses; a tracing-only backend (eager) compiles every
        graph dynamo captures and loads none."""
        if self.compiler != "inductor":
            return 0, counters["stats"]["unique_graphs"]
        c = counters["inductor"]
        return c["fxgraph_cache_hit"], c["fxgraph_cache_miss"] + c["fxgraph_cache_bypass"]

    def summary(self) -> str:
        n_d, n_p, n_w = len(self.decode_buckets), len(self.prefill_buckets), len(self.widths)
        return (f"static path: point {self.point.name or '(derived)'}, decode buckets {self.decode_buckets}, "
                f"prefill buckets {self.prefill_buckets}, {n_w} page-table widths up to {self.widths[-1]}: "
                f"{(n_d + n_p) * n_w} graphs, compiler {self.compiler}")

    # -- the compiled regions: shapes are the bucket's, everything else is tensor data ---------------------

    def _decode_graph(self, ids, positions, page_ids, offsets, pages, ctx, kv):
        meta = AttnMeta(page_ids, offsets, ids.shape[0], pages, ctx, [])
        rows = torch.arange(ids.shape[0], device=ids.device)
        return self._model_forward(self.model, ids, positions, kv, meta, rows)

    def _prefill_graph(self, ids, positions, page_ids, offsets, pages, last, kv):
        meta = AttnMeta(page_ids, offsets, 0, None, None, [], chunk_pages=pages, chunk_pos=positions)
        return self._model_forward(self.model, ids, positions, kv, meta, last)

    # -- padding -----------------------------------------------------------------------------------------

    def _decode_inputs(self, x: StepInputs, g0: int, g1: int) -> tuple[tuple[int, int], list[list]]:
        n, p, s = g1 - g0, self.page_size, self.scratch
        b = bucket(self.decode_buckets, n, "decode batch")
        ctx = x.decode_ctx[g0:g1]
        need = max(_ceil(c, p) for c in ctx)
        w = bucket(self.widths, need, "pages of context")
        pad = b - n
        table = [row[:need] + [row[0]] * (w - need) for row in x.decode_pages[g0:g1]] + [[s] * w] * pad
        return (b, w), [x.ids[g0:g1] + [0] * pad, x.positions[g0:g1] + [0] * pad, x.page_ids[g0:g1] + [s] * pad,
                        x.offsets[g0:g1] + [0] * pad, table, ctx + [1] * pad]

    def _prefill_inputs(self, x: StepInputs, start: int, n: int, ctx_len: int, pages: list[int]
                        ) -> tuple[tuple[int, int], list[list]]:
        t = bucket(self.prefill_buckets, n, "prefill chunk")
        need = _ceil(ctx_len, self.page_size)
        w = bucket(self.widths, need, "pages of context")
        pad, sl = t - n, slice(start, start + n)
        return (t, w), [x.ids[sl] + [0] * pad, x.positions[sl] + [0] * pad, x.page_ids[sl] + [self.scratch] * pad,
                        x.offsets[sl] + [0] * pad, pages[:need] + [pages[0]] * (w - need), [n - 1]]

    # -- running -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, x: StepInputs) -> torch.Tensor:
        rows: dict[int, torch.Tensor] = {}  # batch row -> its logits
        nd, top = len(x.decode_ctx), self.decode_buckets[-1]
        for g0 in range(0, nd, top):
            g1 = min(nd, g0 + top)
            key, inputs = self._decode_inputs(x, g0, g1)
            logits = self._run_decode(key, inputs)
            rows.update((g0 + i, logits[i]) for i in range(g1 - g0))
        wanted, top = set(x.sample_rows), self.prefill_buckets[-1]
        for q_start, q_len, ctx_len, pages in x.prefill:
            prior = ctx_len - q_len
            for s in range(0, q_len, top):
                n = min(top, q_len - s)
                key, inputs = self._prefill_inputs(x, q_start + s, n, prior + s + n, pages)
                self.used.add(("prefill", *key))
                logits = self._prefill(*(self.tensor(v) for v in inputs), self.kv)
                if q_start + s + n - 1 in wanted:
                    rows[q_start + s + n - 1] = logits[0]
        if not x.sample_rows:
            return torch.empty(0, self.vocab, device=self.device)
        return torch.stack([rows[r] for r in x.sample_rows])

    def _run_decode(self, key: tuple[int, int], inputs: list[list]) -> torch.Tensor:
        self.used.add(("decode", *key))
        if not self.cuda_graphs:
            return self._decode(*(self.tensor(v) for v in inputs), self.kv)
        if key not in self._graphs:
            self._graphs[key] = self._capture(*key)
        bufs, graph, out = self._graphs[key]
        for buf, v in zip(bufs, inputs):
            buf.copy_(torch.tensor(v, dtype=torch.long), non_blocking=True)
        graph.replay()
        return out.clone()  # the next replay of this graph (a later group, a later step) overwrites `out`

    def _padding(self, b: int, w: int) -> list[torch.Tensor]:
        """Decode inputs that are all padding: writes land in the scratch page only."""
        t = self.tensor
        return [t([0] * b), t([0] * b), t([self.scratch] * b), t([0] * b), t([[self.scratch] * w] * b), t([1] * b)]

    def _capture(self, b: int, w: int):
        """Compile and warm up bucket (b, w) on a side stream, then capture it; the graph reads its inputs
        from `bufs` and writes the logits to `out`, both at fixed addresses."""
        bufs = self._padding(b, w)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._decode(*bufs, self.kv)
        torch.cuda.current_stream().wait_stream(stream)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = self._decode(*bufs, self.kv)
        return bufs, graph, out

    @torch.no_grad()
    def warmup(self, decode: Iterable[tuple[int, int]] | None = None,
               prefill: Iterable[tuple[int, int]] | None = None) -> None:
        """Compile (and on CUDA capture) buckets ahead of traffic, on padding that writes only the scratch
        page. Default: every bucket of the point, which for a large point is a long compile."""
        decode = [(b, w) for b in self.decode_buckets for w in self.widths] if decode is None else decode
        prefill = [(t, w) for t in self.prefill_buckets for w in self.widths] if prefill is None else prefill
        for b, w in decode:
            self.used.add(("decode", b, w))
            if not self.cuda_graphs:
                self._decode(*self._padding(b, w), self.kv)
            elif (b, w) not in self._graphs:
                self._graphs[b, w] = self._capture(b, w)
        t_ = self.tensor
        for t, w in prefill:
            self.used.add(("prefill", t, w))
            self._prefill(t_([0] * t), t_([0] * t), t_([self.scratch] * t), t_([0] * t), t_([self.scratch] * w),
                          t_([0]), self.kv)
