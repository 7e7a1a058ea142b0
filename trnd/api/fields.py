"""Request fields trnd declares but does not serve, the range checks, and small conversions of the fields
it takes, kept out of protocol.py (bodies only). A field is either served or a 400 naming it: never
accepted and ignored.

`AT_DEFAULT` lists the vLLM and SGLang request fields trnd accepts only at the value that says what trnd
does anyway: clients and routers written for those servers send them (often every one, with its
default), so their defaults must pass, and any other value is refused by name. protocol.py declares
each of them from this table.
"""

from __future__ import annotations

import math

import msgspec

from trnd.api.errors import invalid

_LEGACY = {"guided_json": "structured_outputs.json (or response_format json_schema)",
           "guided_regex": "structured_outputs.regex", "guided_choice": "structured_outputs.choice",
           "guided_grammar": "structured_outputs.grammar", "guided_decoding_backend": "nothing (llguidance is used)",
           "guided_whitespace_pattern": "nothing (JSON is compact)"}
_UNSERVED = {"functions": "use tools", "function_call": "use tool_choice", "audio": "audio output",
             "prediction": "predicted outputs", "web_search_options": "web search",
             "verbosity": "verbosity", "metadata": "stored completions' metadata"}

# name -> (the values accepted besides null, what trnd does instead). vLLM's protocol (chat and completion
# requests, sampling and extra params), then SGLang's extras.
AT_DEFAULT: dict[str, tuple[tuple, str]] = {
    # vLLM
    "use_beam_search": ((False,), "trnd samples; it has no beam search"),
    "length_penalty": ((1.0,), "no beam search"),
    "watermarking": ((False,), "no watermarking"),
    "prompt_logprobs": ((), "prompt logprobs are not computed"),
    "logprob_token_ids": ((), "logprobs are of the sampled and top tokens"),
    "allowed_token_ids": ((), "use logit_bias or structured_outputs"),
    "bad_words": (([],), "use logit_bias"),
    "return_token_ids": ((False,), "token ids are not returned (use logprobs with return_tokens_as_token_ids)"),
    "return_token_offsets": ((False,), "no token offsets"),
    "return_prompt_text": ((False,), "the rendered prompt is not returned (POST /tokenize shows it as tokens)"),
    "routed_experts_prompt_start": ((0,), "no routed-expert data"),
    "return_mm_kwargs": ((True,), "text only"),
    "media_io_kwargs": (({},), "text only"),
    "mm_processor_kwargs": (({},), "text only"),
    "kv_transfer_params": (({},), "trnd moves KV between its own roles (trnd serve, decode --prefill)"),
    "ec_transfer_params": (({},), "text only"),
    "vllm_xargs": (({},), "no custom extensions"),
    "repetition_detection": ((), "no repetition detection"),
    "stream_interval": ((1,), "every token is streamed as it comes"),
    "thinking_token_budget": ((-1,), "no thinking budget"),
    "prompt_embeds": ((), "prompts are text or token ids"),
    # SGLang
    "no_stop_trim": ((False,), "stop strings are trimmed unless include_stop_str_in_output is true"),
    "return_hidden_states": ((False,), "trnd returns no hidden states"),
    "return_routed_experts": ((False,), "no routed-expert data"),
    "routed_experts_start_len": ((0,), "no routed-expert data"),
    "return_cached_tokens_details": ((False,), "usage.prompt_tokens_details.cached_tokens counts them"),
    "return_prompt_token_ids": ((False,), "token ids are not returned"),
    "return_meta_info": ((False,), "no meta info"),
    "stop_regex": ((), "stop strings are literal"),
    "lora_path": ((), "no LoRA adapters"),
    "session_params": ((), "sessions are session_id (prefix-cache affinity)"),
    "custom_params": ((), "no custom logit processors"),
    "custom_logit_processor": ((), "no custom logit processors"),
    "custom_labels": ((), "metrics are labelled by model_name"),
    "extra_key": ((), "no request classification"),
    "ngram_corpus_id": ((), "no n-gram speculation"),
    "bootstrap_host": ((), "trnd's prefill peers come from its config, not the request"),
    "bootstrap_port": ((), "trnd's prefill peers come from its config, not the request"),
    "bootstrap_room": ((), "trnd's prefill peers come from its config, not the request"),
    "routed_dp_rank": ((), "no data parallelism inside a server"),
    "disagg_prefill_dp_rank": ((), "no data parallelism inside a server"),
    "data_parallel_rank": ((), "no data parallelism inside a server"),
    "images_config": ((), "text only"),
    "max_dynamic_patch": ((), "text only"),
    "min_dynamic_patch": ((), "text only"),
    "use_audio_in_video": ((False,), "text only"),
    "input_ids": ((), "send messages (or token ids to /v1/completions)"),
    "task": ((), "no quick-instruction tasks"),
    "separate_reasoning": ((True,), "reasoning is split out whenever a reasoning_parser is configured"),
    "stream_reasoning": ((True,), "reasoning is streamed as it comes"),
    "include_reasoning": ((True,), "reasoning is always returned"),
}


def _is(value, accepted) -> bool:
    """JSON equality with types: true is not 1, 1 is 1.0."""
    if isinstance(accepted, bool) or isinstance(value, bool):
        return value is accepted
    if isinstance(accepted, (int, float)):
        return isinstance(value, (int, float)) and value == accepted
    return value == accepted


def check_finite(name: str, v: float | None) -> None:
    if v is not None and not math.isfinite(v):
        raise invalid(name, f"{name} must be a finite number, got {v}")


def check_range(name: str, v: float | None, lo: float, hi: float, lo_open: bool = False) -> None:
    if v is None:
        return
    check_finite(name, v)
    if v > hi or v < lo or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise invalid(name, f"{name} must be in {left}{lo}, {hi}], got {v}")


def check_at_default(req) -> None:
    """A 400 naming the first AT_DEFAULT field given at a value trnd does not serve."""
    for name, (accepted, why) in AT_DEFAULT.items():
        value = getattr(req, name, None)
        if value is not None and not any(_is(value, a) for a in accepted):
            shown = " or ".join(["null", *(msgspec.json.encode(a).decode() for a in accepted)])
            raise invalid(name, f"{name}: only {shown} is supported ({why})")


def check_rejected(req) -> None:
    """A 400 naming any field trnd declares but does not serve (so it is never silently ignored)."""
    for name, use in _LEGACY.items():
        if getattr(req, name) is not None:
            raise invalid(name, f"{name} is no longer supported (vLLM removed it); use {use}")
    for name, what in _UNSERVED.items():
        if getattr(req, name, None) is not None:
            raise invalid(name, f"{name} is not supported: trnd does not serve {what}")
    check_at_default(req)
    if req.store:
        raise invalid("store", "store: true is not supported on this route (trnd keeps no completions; "
                               "POST /v1/responses stores responses)")
    if req.service_tier not in (None, "auto", "default"):
        raise invalid("service_tier", f"service_tier {req.service_tier!r} is not supported (auto or default)")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise invalid("stream_options.continuous_usage_stats", "continuous_usage_stats is not supported")
    if hasattr(req, "messages"):
        if req.modalities not in (None, ["text"]):
            raise invalid("modalities", "modalities: only [\"text\"] is supported")
    else:
        if req.suffix is not None:
            raise invalid("suffix", "suffix is not supported (no fill-in-the-middle)")


def shown(value: str, limit: int = 40) -> str:
    """A client's string as an error message or a log line shows it: repr, cut to `limit` characters."""
    return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} characters)"


def logit_bias(req, max_entries: int) -> dict[int, float] | None:
    """Token id (an ASCII decimal string: "²" is str.isdigit but no int) -> bias in [-100, 100]; the ids are
    checked against the vocabulary once it is known (api/server.py Job). The sampler adds every entry to its
    row's logits each step, so the count is capped."""
    if not req.logit_bias:
        return None
    if len(req.logit_bias) > max_entries:
        raise invalid("logit_bias", f"logit_bias has {len(req.logit_bias)} entries; at most {max_entries} are "
                                    f"allowed (max_logit_bias)")
    out = {}
    for k, v in req.logit_bias.items():
        if not (k.isascii() and k.isdigit()) or len(k) > 19:
            raise invalid("logit_bias", f"logit_bias keys must be token ids (non-negative integers), got {shown(k)}")
        check_range("logit_bias", v, -100.0, 100.0)
        out[int(k)] = float(v)
    return out


def stop_token_ids(req, max_ids: int) -> list[int]:
    """Checked against the vocabulary with the logit_bias ids (api/server.py Job); the count is capped: every
    new token is looked up among them."""
    ids = req.stop_token_ids or []
    if len(ids) > max_ids:
        raise invalid("stop_token_ids", f"stop_token_ids has {len(ids)} ids; at most {max_ids} are allowed "
                                        f"(max_stop_token_ids)")
    bad = next((t for t in ids if t < 0), None)
    if bad is not None:
        raise invalid("stop_token_ids", f"stop_token_ids must be token ids (non-negative integers), got {bad}")
    return list(dict.fromkeys(ids))


def check_vocabulary(params, vocab: int) -> None:
    """logit_bias and stop_token_ids name tokens of this model: an id past its vocabulary is a 400 (OpenAI and
    vLLM answer so), never a bias silently dropped."""
    for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise invalid(name, f"{name}: token id {bad} is out of range: this model's vocabulary has {vocab} "
                                f"tokens (ids 0 to {vocab - 1})")
