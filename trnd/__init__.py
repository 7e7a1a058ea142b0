"""trnd: an LLM serving daemon (OpenAI API, paged KV cache, disaggregated prefill/decode)."""

import os

# OpenMP (libgomp, torch's CPU runtime) threads wait at barriers between ops. Measured on the 2-core
# CI machine, bf16 1x768 @ 768x2048: spinning forever (OMP_WAIT_POLICY=ACTIVE-like default) is fast
# alone (143 us) but 47x slower when another process wants the cores (6.7 ms); sleeping at once
# (PASSIVE) survives sharing (282 us) but adds ~100 us per op alone. A short spin (20k iterations)
# keeps the alone speed (137 us) and degrades gently (675 us). Processes that know they share the
# cores (a local prefill + decode deployment, TP ranks) are started with PASSIVE. Set before torch
# loads its OpenMP runtime; an operator's own settings win.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")
