"""CompiledDecode: the decode-only step as one Inductor graph on the CPU, for any batch and context.

Eager, a decode step of the `small` model runs ~110 ops from Python, and every op after a linear pays
for the linear's weight stream: the weights (MBs per call) evict the interpreter's and the dispatcher's
working set from L2, so the next small op costs 15-20 us instead of 1-3 (measured: torch.empty(2048)
takes 0.8 us alone, 15 us right after a 768 x 4096 linear). Compiled with Inductor (`freezing`: the
weights become constants, prepacked by Inductor for oneDNN; `cpp_wrapper`: the graph is called from C++,
not Python; `emulate_precision_casts`: bf16 rounded where eager rounds), the step is one call: measured
13-20% faster than the eager runner at batch 1-16, logits bit-identical (docs/RESULTS.md).

Batch size and page-table width are symbols, so two graphs (batch 1, batch > 1) cover every step;
`warmup` compiles both before READY. Prefill and mixed steps stay eager: their GEMMs dominate and the
compiled prefill kernels (kernels/cpu/) are already one call each.

Costs, why it is opt-in (`compile_decode`): the compile takes ~30 s at start for `small` on 2 cores
(Inductor's graph cache does not serve frozen graphs again), and the weights are held twice (the eager
path's plain copy and the graph's packed constants). One rank only, model-dtype KV pages.
"""

from __future__ import annotations

import time

import torch
import torch._inductor.config

from trnd_kernels.attention import AttnMeta


class CompiledDecode:
    def __init__(self, model):
        self.model = model
        fwd = type(model).forward  # without its inference_mode: AOTAutograd refuses inference tensors made inside
        self._forward = getattr(fwd, "__wrapped__", fwd)  # a compiled region (as engine/static.py); no_grad instead
        self._graph = torch.compile(self._step, backend="inductor", dynamic=True, fullgraph=True)

    def _step(self, ids, positions, page_ids, offsets, pages, ctx, kv):
        meta = AttnMeta(page_ids, offsets, ids.shape[0], pages, ctx, [])
        return self._forward(self.model, ids, positions, kv, meta, torch.arange(ids.shape[0], device=ids.device))

    @torch.no_grad()
    def __call__(self, ids, positions, page_ids, offsets, pages, ctx, kv) -> torch.Tensor:
        if pages.shape[1] == 1:  # a table one page wide gets a second, unread column: no graph of its own
            pages = pages.expand(-1, 2).contiguous()
        # Inductor reads these when it compiles (the first call of a shape); passed as torch.compile's
        # `options` they measured no faster than eager, so they are set around the call instead.
        with torch._inductor.config.patch(freezing=True, cpp_wrapper=True, emulate_precision_casts=True):
            return self._graph(ids, positions, page_ids, offsets, pages, ctx, kv)

    def warmup(self, runner, page: int) -> float:
        """Compile the graphs a server meets (batch 1 and batch > 1, any page-table width) with steps on the
        runner's pool that write only into `page`, a page the caller holds for the duration. Returns the
        seconds it took."""
        t0, t = time.perf_counter(), runner.tensor
        for b in (3, 1):  # sizes of no dimension of kv (dynamo ties equal sizes together)
            self(t([0] * b), t(list(range(b))), t([page] * b), t(list(range(b))), t([[page] * 5] * b), t([b] * b),
                 runner.kv)
        return time.perf_counter() - t0
