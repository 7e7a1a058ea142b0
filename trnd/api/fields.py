"""Request fields trnd declares but refuses, the range checks, and small conversions of the fields it
takes, kept out of protocol.py (bodies only). A field is either served or a 400 naming it: never
accepted and ignored."""

from __future__ import annotations

import math

from trnd.api.errors import invalid

_LEGACY = {"guided_json": "structured_outputs.json (or response_format json_schema)",
           "guided_regex": "structured_outputs.regex", "guided_choice": "structured_outputs.choice",
           "guided_grammar": "structured_outputs.grammar", "guided_decoding_backend": "nothing (llguidance is used)",
           "guided_whitespace_pattern": "nothing (JSON is compact)"}
_UNSERVED = {"functions": "use tools", "function_call": "use tool_choice", "audio": "audio output",
             "prediction": "predicted outputs", "web_search_options": "web search",
             "reasoning_effort": "reasoning effort (use chat_template_kwargs, e.g. enable_thinking)",
             "verbosity": "verbosity", "metadata": "stored completions' metadata"}
# SGLang / vLLM extras accepted only at the value that says what trnd does anyway (SGLang-style routers
# such as vllm-router send them all, with these defaults, on every request).
_ONLY_AT = {"no_stop_trim": (False, "stop strings are always trimmed from the output"),
            "return_hidden_states": (False, "trnd returns no hidden states"),
            "continue_final_message": (False, "a reply always starts a new assistant message"),
            "separate_reasoning": (True, "reasoning is split out whenever a reasoning_parser is configured"),
            "stream_reasoning": (True, "reasoning is streamed as it comes"),
            "include_reasoning": (True, "reasoning is always returned")}


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


def check_rejected(req) -> None:
    """A 400 naming any field trnd declares but does not serve (so it is never silently ignored)."""
    for name, use in _LEGACY.items():
        if getattr(req, name) is not None:
            raise invalid(name, f"{name} is no longer supported (vLLM removed it); use {use}")
    for name, what in _UNSERVED.items():
        if getattr(req, name, None) is not None:
            raise invalid(name, f"{name} is not supported: trnd does not serve {what}")
    for name, (only, why) in _ONLY_AT.items():
        value = getattr(req, name, None)
        if value is not None and value != only:
            raise invalid(name, f"{name}: only {str(only).lower()} is supported ({why})")
    if req.store:
        raise invalid("store", "store: true is not supported (trnd keeps no completions)")
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
