"""Request and response bodies of the OpenAI-compatible API, as msgspec Structs.

Requests decode strictly by type (a string where a number belongs is a 400 naming the field) but
ignore unknown fields, since OpenAI clients send things we do not implement (`user`, `metadata`...).
Optional fields accept an explicit `null`, which several clients send for "unset". Value ranges are
checked in `to_sampling_params`, which raises APIError naming the param.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from trnd.api.errors import APIError, invalid
from trnd.sampling_params import SamplingParams

MAX_LOGPROBS = 20
INT64 = (-2**63, 2**63 - 1)  # JSON integers are unbounded; the engine and the control plane carry int64


# -- requests ---------------------------------------------------------------------------------------

class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class _Common(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints (OpenAI's, then vLLM's extras, then ours)."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    # trnd: requests of one conversation share a session (prefix-cache affinity, /admin/state)
    session_id: str | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[int | str]  # msgspec allows one array type in a union; shape checked below
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None


# -- validation -------------------------------------------------------------------------------------

def _finite(name: str, v: float | None) -> None:
    if v is not None and not math.isfinite(v):
        raise invalid(name, f"{name} must be a finite number, got {v}")


def _range(name: str, v: float | None, lo: float, hi: float, lo_open: bool = False) -> None:
    if v is None:
        return
    _finite(name, v)
    if v > hi or v < lo or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise invalid(name, f"{name} must be in {left}{lo}, {hi}], got {v}")


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Plain {"role", "content"} dicts for the chat template; text parts are concatenated."""
    if not req.messages:
        raise invalid("messages", "messages must contain at least one message")
    out = []
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else m.role
        if role not in ("system", "user", "assistant"):
            raise invalid(f"messages[{i}].role", f"messages[{i}].role {m.role!r} is not supported "
                                                 "(use system, user or assistant)")
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
        out.append({"role": role, "content": text})
    return out


def to_sampling_params(req: ChatCompletionRequest | CompletionRequest, max_n: int, max_stop: int = 4,
                       max_stop_chars: int = 1024) -> tuple[SamplingParams, int]:
    """Validate ranges and build the engine's SamplingParams (max_tokens still unresolved: 0 = default).
    Stop strings are matched on the engine thread for every token of every choice, so their number
    and length are capped (OpenAI allows 4)."""
    _range("temperature", req.temperature, 0.0, 2.0)
    _range("top_p", req.top_p, 0.0, 1.0, lo_open=True)
    _range("min_p", req.min_p, 0.0, 1.0)
    _range("presence_penalty", req.presence_penalty, -2.0, 2.0)
    _range("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    _finite("repetition_penalty", req.repetition_penalty)
    if req.repetition_penalty is not None and req.repetition_penalty <= 0:
        raise invalid("repetition_penalty", f"repetition_penalty must be > 0, got {req.repetition_penalty}")
    if req.top_k is not None and req.top_k < -1:
        raise invalid("top_k", f"top_k must be -1 (off) or >= 0, got {req.top_k}")
    n = 1 if req.n is None else req.n
    if not 1 <= n <= max_n:
        raise invalid("n", f"n must be in [1, {max_n}], got {n}")
    if req.seed is not None and not INT64[0] <= req.seed <= INT64[1] - (n - 1):  # choice i uses seed + i
        raise invalid("seed", f"seed must be a 64-bit signed integer in [{INT64[0]}, {INT64[1] - (n - 1)}]"
                              f"{' with n = ' + str(n) if n > 1 else ''}, got {req.seed}")

    max_tokens, max_name = req.max_tokens, "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, max_name = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise invalid(max_name, f"{max_name} must be at least 1, got {max_tokens}")
    min_tokens = req.min_tokens or 0
    if min_tokens < 0:
        raise invalid("min_tokens", f"min_tokens must be >= 0, got {min_tokens}")
    if max_tokens is not None and min_tokens > max_tokens:
        raise invalid("min_tokens", f"min_tokens ({min_tokens}) must not exceed {max_name} ({max_tokens})")

    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None:
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise invalid("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}")
            if not req.logprobs:
                raise invalid("top_logprobs", "top_logprobs requires logprobs to be true")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise invalid("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}")
        if req.echo:
            raise invalid("echo", "echo is not supported")
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
        stop_token_ids=[t for t in req.stop_token_ids or [] if 0 <= t < 2**63],
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
    )
    return params, n


# -- responses --------------------------------------------------------------------------------------

class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class ChatMessageOut(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # only on the final chunk of stream_options.include_usage


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct, omit_defaults=True):
    """Both the reply and the stream chunks (OpenAI uses one object type for both)."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelCard]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens,
                 PromptTokensDetails(cached_tokens))


def check_completion_prompt(prompt: str | list[int | str]) -> str | list[int]:
    """A string, a list of token ids, or a list of exactly one string (for batches of prompts send
    one request per prompt)."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if any(isinstance(t, str) for t in prompt):
        raise APIError(400, "prompt must be a string, a list of token ids, or a list of one string "
                            "(batches of several prompts are not supported)", param="prompt")
    return prompt  # type: ignore[return-value]
