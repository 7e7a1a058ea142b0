"""trnd: an LLM serving daemon (OpenAI API, paged KV cache, disaggregated prefill/decode)."""

import os

# Several trnd processes share a node's cores (prefill + decode roles, TP ranks). OpenMP threads that
# spin at barriers while another process holds the core make a 1 ms matmul take 13 ms (measured on the
# 2-core CI machine), so by default threads sleep when idle. Set before torch loads its OpenMP runtime;
# an operator's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
