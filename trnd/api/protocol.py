"""Request and response bodies of the OpenAI-compatible API, as msgspec Structs.

Requests decode strictly by type (a string where a number belongs is a 400 naming the field) and
refuse unknown fields (a 400 naming it): a field we do not implement must never be a silent 200.
Every OpenAI / vLLM field is declared; the ones trnd does not serve are refused in `check_rejected`
(api/fields.py), and vLLM's and SGLang's extras that trnd takes only at their defaults are declared from
fields.AT_DEFAULT. Optional fields accept an explicit `null`, which several clients send for "unset".
Value ranges are checked in `to_sampling_params` (api/params.py), which raises APIError naming the param.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from trnd.api.fields import AT_DEFAULT

# -- requests ---------------------------------------------------------------------------------------

class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class FunctionCallIn(msgspec.Struct):
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(msgspec.Struct, forbid_unknown_fields=True):
    function: FunctionCallIn
    id: str | None = None
    type: str = "function"


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # role "tool": the call this result answers
    reasoning_content: str | None = None  # an earlier turn's reasoning (accepted, not rendered)
    reasoning: str | None = None
    refusal: str | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM; refused when true


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    function: FunctionDef
    type: str = "function"


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    function: NamedFunction
    type: str = "function"


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: str | None = None
    description: str | None = None
    schema: dict | bool | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: str  # text | json_object | json_schema
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` extra field: exactly one of these."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# Any JSON value decodes; fields.check_at_default refuses all but the defaults.
_AtDefault = msgspec.defstruct("_AtDefault", [(name, object, None) for name in AT_DEFAULT], kw_only=True,
                               forbid_unknown_fields=True)


class _Common(_AtDefault, kw_only=True, forbid_unknown_fields=True):
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
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # recorded in the request log line
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    include_stop_str_in_output: bool | None = None
    spaces_between_special_tokens: bool | None = None  # no effect with a fast tokenizer, as in vLLM
    truncate_prompt_tokens: int | None = None  # keep the last N prompt tokens (-1: max_model_len)
    truncation_side: Literal["left", "right"] | None = None  # right: keep the first N instead
    add_special_tokens: bool | None = None  # chat: false (the template writes them); completions: true
    echo: bool | None = None
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:{id}"
    request_id: str | None = None  # the reply's id is "{chatcmpl,cmpl}-{request_id}" (vLLM)
    rid: str | None = None  # SGLang's name for request_id
    regex: str | None = None  # SGLang: structured_outputs.regex
    ebnf: str | None = None  # SGLang: structured_outputs.grammar
    # trnd: requests of one conversation share a session (prefix-cache affinity, /admin/state)
    session_id: str | None = None
    priority: int | None = None  # vLLM's: lower is scheduled first (engine/scheduler.py)
    # vLLM's: this request's prefix cache is shared only with requests of the same salt (and API key:
    # http/tenant.py), in every tier
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    # Declared so they are refused by name (check_rejected), never ignored.
    guided_json: object = None
    guided_regex: object = None
    guided_choice: object = None
    guided_grammar: object = None
    guided_decoding_backend: object = None
    guided_whitespace_pattern: object = None
    metadata: object = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # OpenAI's name for a session: taken as session_id
    safety_identifier: str | None = None  # like user


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None  # a Jinja template for this request instead of the model's
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None  # the reply continues the final (assistant) message
    documents: list[dict] | None = None  # for templates that render RAG documents
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    functions: object = None
    function_call: object = None
    audio: object = None
    modalities: list[str] | None = None
    prediction: object = None
    web_search_options: object = None
    verbosity: object = None


class CompletionRequest(_Common, kw_only=True):
    # a string, token ids, or a batch of either; msgspec allows one array type in a union, so the shape is
    # checked in params.completion_prompts
    prompt: str | list[int | str | list[int]]
    logprobs: int | None = None
    json_schema: str | None = None  # SGLang: structured_outputs.json
    best_of: int | None = None
    suffix: str | None = None


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


class FunctionOut(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct):
    id: str
    type: str
    function: FunctionOut


class ChatMessageOut(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None
    reasoning_content: str | None = None  # both names: clients read one or the other
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] | None = None


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


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """OpenAI's stream shape: the first delta of a call has id, type and name (arguments ""),
    the next ones only index and argument fragments."""
    index: int
    function: FunctionDelta
    id: str | None = None
    type: str | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


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


class ModelCard(msgspec.Struct, omit_defaults=True):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    point: str | None = None  # a disaggregated role's decode point, and what its pool really holds under it
    capacity: dict | None = None  # as /admin/state `capacity` (trnd/points.py: Capacity)
    static: bool | None = None  # steps padded to the point's buckets (engine/static.py)
    # total and active parameters (a MoE reads top_k of its experts a token) and the weights' bytes as stored
    # (trnd/model/size.py)
    parameters: dict | None = None


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelCard]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens,
                 PromptTokensDetails(cached_tokens))
