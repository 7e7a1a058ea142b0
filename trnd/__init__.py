"""trnd: an LLM serving daemon (OpenAI API, paged KV cache, disaggregated prefill/decode).

Importing it changes nothing in the process: the commands that run an engine tune themselves first
(trnd/tuning.py, called from cli.py)."""
