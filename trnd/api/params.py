"""A decoded request body -> what the engine takes: the messages for the chat template, the prompt,
and SamplingParams; every value range checked here, each refusal a 400 naming its param."""

from __future__ import annotations

import msgspec

from trnd.api import protocol as P
from trnd.api.errors import APIError, invalid
from trnd.api.fields import check_finite, check_range, check_rejected, logit_bias, stop_token_ids
from trnd.sampling_params import SamplingParams

MAX_LOGPROBS = 20
MAX_REQUEST_ID = 128
INT64 = (-2**63, 2**63 - 1)  # JSON integers are unbounded; the engine and the control plane carry int64


def chat_messages(req: P.ChatCompletionRequest) -> list[dict]:
    """Plain {"role", "content"} dicts for the chat template; text parts are concatenated."""
    if not req.messages:
        raise invalid("messages", "messages must contain at least one message")
    out = []
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else m.role
        if role not in ("system", "user", "assistant", "tool"):
            raise invalid(f"messages[{i}].role", f"messages[{i}].role {m.role!r} is not supported "
                                                 "(use system, user, assistant or tool)")
        if m.tool_calls is not None and role != "assistant":
            raise invalid(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls: only assistant messages call tools")
        if role == "tool" and not m.tool_call_id:
            raise invalid(f"messages[{i}].tool_call_id", f"messages[{i}].tool_call_id is required for role tool")
        if m.content is None:
            if role != "assistant":
                raise invalid(f"messages[{i}].content", f"messages[{i}].content is required for role {role}")
            text = ""
        elif isinstance(m.content, str):
            text = m.content
        else:
            parts = []
            for j, p in enumerate(m.content):
                if p.type != "text" or p.text is None:
                    raise invalid(f"messages[{i}].content[{j}]", f"messages[{i}].content[{j}]: only parts "
                                                                 f"of type 'text' with a 'text' string are supported")
                parts.append(p.text)
            text = "".join(parts)
        msg = {"role": role, "content": text}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(f"messages[{i}].tool_calls[{j}].function.arguments",
                                                                 c.function.arguments)}}
                for j, c in enumerate(m.tool_calls)]
        if role == "tool":
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _arguments(param: str, args: str | dict) -> dict:
    """Tool-call arguments as the template wants them (a mapping), from OpenAI's JSON string."""
    if isinstance(args, dict):
        return args
    try:
        value = msgspec.json.decode(args or "{}")
    except msgspec.DecodeError:
        raise invalid(param, f"{param} must be a JSON object encoded as a string") from None
    if not isinstance(value, dict):
        raise invalid(param, f"{param} must be a JSON object encoded as a string")
    return value


def to_sampling_params(req: P.ChatCompletionRequest | P.CompletionRequest, max_n: int, max_stop: int = 4,
                       max_stop_chars: int = 1024, max_logit_bias: int = 300,
                       max_stop_token_ids: int = 128) -> tuple[SamplingParams, int]:
    """Validate ranges and build the engine's SamplingParams (max_tokens still unresolved: 0 = default).
    Stop strings are matched on the engine thread for every token of every choice, so their number
    and length are capped (OpenAI allows 4)."""
    check_rejected(req)
    check_range("temperature", req.temperature, 0.0, 2.0)
    check_range("top_p", req.top_p, 0.0, 1.0, lo_open=True)
    check_range("min_p", req.min_p, 0.0, 1.0)
    check_range("presence_penalty", req.presence_penalty, -2.0, 2.0)
    check_range("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    check_finite("repetition_penalty", req.repetition_penalty)
    if req.repetition_penalty is not None and req.repetition_penalty <= 0:
        raise invalid("repetition_penalty", f"repetition_penalty must be > 0, got {req.repetition_penalty}")
    if req.top_k is not None and req.top_k < -1:
        raise invalid("top_k", f"top_k must be -1 (off) or >= 0, got {req.top_k}")
    if req.truncate_prompt_tokens is not None and req.truncate_prompt_tokens < -1:
        raise invalid("truncate_prompt_tokens", f"truncate_prompt_tokens must be -1 (the model's context) or >= 0, "
                                                f"got {req.truncate_prompt_tokens}")
    if req.priority is not None and not INT64[0] <= req.priority < INT64[1]:
        raise invalid("priority", f"priority must be a 64-bit signed integer, got {req.priority}")
    request_id(req)
    n = 1 if req.n is None else req.n
    if not 1 <= n <= max_n:
        raise invalid("n", f"n must be in [1, {max_n}], got {n}")
    if req.seed is not None and not INT64[0] <= req.seed <= INT64[1] - (n - 1):  # choice i uses seed + i
        raise invalid("seed", f"seed must be a 64-bit signed integer in [{INT64[0]}, {INT64[1] - (n - 1)}]"
                              f"{' with n = ' + str(n) if n > 1 else ''}, got {req.seed}")

    max_tokens, max_name = req.max_tokens, "max_tokens"
    if isinstance(req, P.ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, max_name = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise invalid(max_name, f"{max_name} must be at least 1, got {max_tokens}")
    min_tokens = req.min_tokens or 0
    if min_tokens < 0:
        raise invalid("min_tokens", f"min_tokens must be >= 0, got {min_tokens}")
    if max_tokens is not None and min_tokens > max_tokens:
        raise invalid("min_tokens", f"min_tokens ({min_tokens}) must not exceed {max_name} ({max_tokens})")

    if isinstance(req, P.ChatCompletionRequest):
        if req.top_logprobs is not None:
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise invalid("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}")
            if not req.logprobs:
                raise invalid("top_logprobs", "top_logprobs requires logprobs to be true")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise invalid("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}")
        if req.echo and req.logprobs is not None:
            raise invalid("echo", "echo with logprobs is not supported (prompt logprobs are not computed)")
        if req.best_of is not None and req.best_of != n:
            raise invalid("best_of", "best_of is not supported (it must be absent or equal to n)")
        logprobs = req.logprobs

    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    stop = [s for s in stop if s]  # "" would match everywhere; OpenAI ignores it too
    if len(stop) > max_stop:
        raise invalid("stop", f"stop has {len(stop)} sequences; at most {max_stop} are allowed")
    if sum(len(s) for s in stop) > max_stop_chars:
        raise invalid("stop", f"stop sequences total {sum(len(s) for s in stop)} characters; at most "
                              f"{max_stop_chars} are allowed")
    top_k = -1 if req.top_k is None else req.top_k
    if top_k >= 2**31:  # beyond any vocabulary: off (and it must fit the sampler's int64 tensor)
        top_k = -1
    params = SamplingParams(
        max_tokens=max_tokens or 0,
        min_tokens=min_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=req.seed,
        stop=stop,
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        stop_token_ids=stop_token_ids(req, max_stop_token_ids),
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
        logit_bias=logit_bias(req, max_logit_bias),
        priority=req.priority or 0,
    )
    return params, n


def request_id(req) -> str | None:
    """The client's request id (vLLM's request_id, SGLang's rid): it names the reply and every engine
    request, so it is short and printable."""
    rid, name = (req.request_id, "request_id") if req.request_id is not None else (req.rid, "rid")
    if rid is not None and not (0 < len(rid) <= MAX_REQUEST_ID and rid.isprintable() and " " not in rid
                                and "/" not in rid):
        raise invalid(name, f"{name} must be 1 to {MAX_REQUEST_ID} printable characters without spaces or '/'")
    return rid


def completion_prompts(prompt: str | list) -> list[str | list[int]]:
    """The prompts of one /v1/completions request: a string, a list of token ids, or a batch (a list of
    strings or a list of token-id lists), as OpenAI and vLLM take them."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if prompt and all(isinstance(p, list) for p in prompt):
        return list(prompt)
    if any(not isinstance(t, int) for t in prompt):
        raise APIError(400, "prompt must be a string, a list of token ids, a list of strings or a list of token-id "
                            "lists (not a mix)", param="prompt")
    return [prompt]


def truncate(ids: list[int], req, max_model_len: int) -> list[int]:
    """truncate_prompt_tokens: keep the last N tokens (the first N with truncation_side "right"); -1 keeps
    what the context holds."""
    n = req.truncate_prompt_tokens
    if n is None:
        return ids
    n = max_model_len if n == -1 else n
    if len(ids) <= n:
        return ids
    return ids[:n] if req.truncation_side == "right" else ids[len(ids) - n:]
