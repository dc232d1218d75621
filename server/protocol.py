"""Wire types: every request and response body the server speaks, as msgspec Structs.

Requests tolerate unknown OpenAI fields (msgspec ignores them), so new SDK
versions keep working. Responses use ``omit_defaults`` so optional extensions
stay off the wire unless set. Encoders and decoders are created once, here.

dualserve's own request hints ride along as extra body fields, which the
OpenAI SDK sends through ``extra_body``: ``decoder``, ``priority``,
``latency_budget_ms``, ``draft`` (the ``eagle`` decoder's draft sources), plus
vLLM-style sampling extras (``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Struct, field

# Response headers that name the decoder that served a request and why; a request may name its
# decoder in the first as well (the ``decoder`` body field wins).
DECODER_HEADER = "x-dualserve-decoder"
ROUTE_REASON_HEADER = "x-dualserve-route-reason"

Role = Literal["system", "user", "assistant", "tool", "developer"]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]

# Bounds on the arrays and maps of a request body, so that no field's size is limited only by the
# body size (8 MB holds a million tiny items, each a Python object, then a loop or a template
# pass). They follow OpenAI's own where it states one (2048 messages, 128 tools, 16 metadata
# pairs) and are generous elsewhere; a body past one is a 400 (``array_above_max_length``) naming
# the field. Prompts, stops and stop token ids are bounded in the service (``ServiceLimits``).
MAX_MESSAGES = 2048        # messages, and /v1/responses input items
MAX_CONTENT_PARTS = 256    # content parts in one message
MAX_TOOLS = 128            # tools, and tool calls in one message
MAX_LOGIT_BIAS = 300       # logit_bias entries
MAX_INPUT_EXTRA = 256      # /infill input_extra chunks
MAX_SMALL_LIST = 16        # include, metadata pairs


def bounded(kind: Any, length: int) -> Any:
    return Annotated[kind, msgspec.Meta(max_length=length)]


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class SamplingFields(Struct, kw_only=True):
    """Fields shared by both generation endpoints: sampling, stopping and dualserve's hints."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: bounded(dict[str, float], MAX_LOGIT_BIAS) | None = None
    seed: Seed | None = None
    user: str | None = None
    ignore_eos: bool = False
    decoder: str | None = None
    priority: str | None = None
    latency_budget_ms: float | None = None
    # eagle's draft sources: "head" (the EAGLE head), "block" (the DFlash drafter), "suffix" (lookup),
    # "both" or "auto" (the preferred model and lookup)
    draft: str | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]: checked in the service (msgspec allows one array type).
    prompt: str | list[Any] | None = None
    suffix: str | None = None
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None


class FunctionCall(Struct, kw_only=True):
    name: str
    arguments: str = ""


class ToolCall(Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(Struct, kw_only=True):
    role: Role
    content: str | bounded(list[dict[str, Any]], MAX_CONTENT_PARTS) | None = None
    name: str | None = None
    tool_calls: bounded(list[dict[str, Any]], MAX_TOOLS) | None = None
    tool_call_id: str | None = None


class ResponseFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: bounded(list[ChatMessage], MAX_MESSAGES) | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: bounded(list[dict[str, Any]], MAX_TOOLS) | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ResponsesTextFormat(Struct, kw_only=True):
    """``text.format`` of a /v1/responses request: plain text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponsesText(Struct, kw_only=True):
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(SamplingFields, kw_only=True):
    """POST /v1/responses. ``input`` items (messages, ``function_call``, ``function_call_output``)
    and ``tools`` keep OpenAI's shapes and are checked item by item in ``server.responses.to_chat``."""

    input: str | bounded(list[dict[str, Any]], MAX_MESSAGES) | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: bounded(list[dict[str, Any]], MAX_TOOLS) | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesText | None = None
    store: bool = True
    previous_response_id: str | None = None
    include: bounded(list[str], MAX_SMALL_LIST) | None = None
    top_logprobs: int | None = None
    metadata: bounded(dict[str, str], MAX_SMALL_LIST) | None = None
    truncation: str | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None


class InfillRequest(Struct, kw_only=True):
    """llama.cpp's POST /infill body (as sent by llama.vscode and similar plugins)."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: bounded(list[dict[str, Any]], MAX_INPUT_EXTRA) = field(default_factory=list)
    prompt: str = ""
    n_predict: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    stream: bool = False
    stop: list[str] | None = None
    seed: Seed | None = None
    model: str | None = None
    decoder: str | None = None


# ---- responses ------------------------------------------------------------------


class Usage(Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None
    # dualserve extension: decoder statistics (forwards, tokens per forward, acceptance...)
    dualserve: dict[str, Any] | None = None


class CompletionLogprobs(Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct, kw_only=True):
    content: list[ChatTokenLogprob] | None


class ChatResponseMessage(Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(Struct, kw_only=True):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    object: str = "chat.completion"
    usage: Usage | None = None
    system_fingerprint: str | None = None


class DeltaToolCall(Struct, kw_only=True, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: dict[str, str] | None = None


class ChatDelta(Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None


class OutputText(Struct, kw_only=True, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = field(default_factory=list)


class OutputMessage(Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]
    role: str = "assistant"


class FunctionCallItem(Struct, kw_only=True, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ResponsesUsage(Struct, kw_only=True, omit_defaults=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens_details: dict[str, int]
    # dualserve extension: decoder statistics, as in chat's ``usage.dualserve``
    dualserve: dict[str, Any] | None = None


class ResponseObject(Struct, kw_only=True):
    """The body of a /v1/responses answer (and of ``response.*`` stream events)."""

    id: str
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    output: list[OutputMessage | FunctionCallItem]
    object: str = "response"
    error: dict[str, str] | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = field(default_factory=list)
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}})
    store: bool = True
    truncation: str = "disabled"
    background: bool = False
    metadata: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    usage: ResponsesUsage | None = None


class ModelCard(Struct, kw_only=True):
    id: str
    created: int
    owned_by: str = "dualserve"
    object: str = "model"
    # dualserve extension: which decoders this model serves, and its context length.
    decoders: list[str] | None = None
    max_model_len: int | None = None


class ModelList(Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"


class ErrorBody(Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct, kw_only=True):
    error: ErrorBody


encoder = msgspec.json.Encoder()
completion_decoder = msgspec.json.Decoder(CompletionRequest)
chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
infill_decoder = msgspec.json.Decoder(InfillRequest)
responses_decoder = msgspec.json.Decoder(ResponsesRequest)


# ---- llama.cpp's native endpoints and the Mistral / DeepSeek FIM endpoint -------------------------
# Shapes from llama.cpp's tools/server/README.md and server-task.cpp (``to_json_non_oaicompat``,
# ``result_timings::to_json``); the FIM body from Mistral's /v1/fim/completions reference. Served by
# server/tokenize.py, server/llamacpp.py, server/llamacpp_completion.py and server/fim_completions.py.

# llama.cpp's seed for "pick one at random" (LLAMA_DEFAULT_SEED); -1 says the same.
LLAMA_RANDOM_SEED = 0xFFFFFFFF


class TokenizeRequest(Struct, kw_only=True):
    content: str
    add_special: bool = False    # BOS (and EOS) as the model's metadata asks
    parse_special: bool = True   # false: special-token text is tokenized as plain text
    with_pieces: bool = False
    model: str | None = None


class TokenPiece(Struct, kw_only=True):
    id: int
    piece: str | list[int]       # the token's bytes, as a list where they are not valid UTF-8 alone


class TokenizeResponse(Struct, kw_only=True):
    tokens: list[int] | list[TokenPiece]


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[int] = field(default_factory=list)
    model: str | None = None


class DetokenizeResponse(Struct, kw_only=True):
    content: str


class ApplyTemplateResponse(Struct, kw_only=True):
    prompt: str


class InputTokensResponse(Struct, kw_only=True):
    input_tokens: int


class LlamaCompletionRequest(Struct, kw_only=True):
    """llama.cpp's POST /completion. ``prompt``: a string, token ids, token ids mixed with strings, or a
    list of those (several prompts), checked in ``server.llamacpp_completion``. ``cache_prompt`` and
    ``id_slot`` are accepted: every prompt is prefix-cached, and there are no slots."""

    prompt: str | list[Any] | None = None
    n_predict: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool = False
    cache_prompt: bool = True
    id_slot: int = -1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float | None = None
    ignore_eos: bool = False
    return_tokens: bool = False
    model: str | None = None
    decoder: str | None = None


class LlamaTimings(Struct, kw_only=True):
    cache_n: int                 # prompt tokens reused from the prefix cache
    prompt_n: int                # prompt tokens computed
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class LlamaPartial(Struct, kw_only=True):
    """One streamed chunk of /completion or /infill while generating."""

    index: int
    content: str
    tokens: list[int]
    stop: bool
    tokens_predicted: int
    tokens_evaluated: int


class LlamaResult(Struct, kw_only=True):
    """The answer of /completion or /infill, and the last chunk of their stream (``content`` empty there)."""

    index: int
    content: str
    tokens: list[int]
    stop: bool
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    generation_settings: dict[str, Any]
    prompt: str
    has_new_line: bool
    truncated: bool
    stop_type: Literal["none", "eos", "limit", "word"]
    stopping_word: str
    tokens_cached: int
    timings: LlamaTimings


class FimCompletionRequest(Struct, kw_only=True):
    """POST /v1/fim/completions, as Mistral (Codestral) and DeepSeek serve it and Continue sends it."""

    model: str | None = None
    prompt: str | None = None
    suffix: str | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    random_seed: Seed | None = None  # Mistral's name
    seed: Seed | None = None         # DeepSeek's and OpenAI's
    decoder: str | None = None


tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)
llama_completion_decoder = msgspec.json.Decoder(LlamaCompletionRequest)
fim_completion_decoder = msgspec.json.Decoder(FimCompletionRequest)


# ---- Embeddings and rerank (server/embeddings.py, server/rerank.py) -----------------------------


class EmbeddingRequest(Struct, kw_only=True):
    """POST /v1/embeddings (OpenAI). ``input``: a string, a list of strings, a token-id list or a
    list of token-id lists; its shape is checked by the handler, to answer in OpenAI's words."""

    input: Any = None
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EmbeddingUsage(Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(Struct, kw_only=True):
    index: int
    embedding: list[float] | str  # base64: the little-endian float32 bytes, as OpenAI's SDK decodes them
    object: str = "embedding"


class EmbeddingResponse(Struct, kw_only=True):
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
    object: str = "list"


class RerankDocument(Struct, kw_only=True):
    text: str


class RerankRequest(Struct, kw_only=True):
    """POST /v1/rerank (also /rerank, /v1/reranking): llama.cpp's, Jina's and Cohere's body.
    ``instruction``: the ``<Instruct>`` line of Qwen3-Reranker's prompt (its default when unset)."""

    query: str | None = None
    documents: list[str | RerankDocument] | None = None
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = False
    instruction: str | None = None


class RerankResult(Struct, kw_only=True, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(Struct, kw_only=True):
    id: str
    model: str
    results: list[RerankResult]
    usage: EmbeddingUsage
    object: str = "list"


embedding_decoder = msgspec.json.Decoder(EmbeddingRequest)
rerank_decoder = msgspec.json.Decoder(RerankRequest)


# ---- Several models in one server: /v1/models states, /models, /models/load, /models/unload ----
# llama.cpp's router shapes (tools/server/README.md, "Using multiple models"): a model's
# ``status`` is an object whose ``value`` is loaded / loading / unloaded.


class ModelStatus(Struct, kw_only=True, omit_defaults=True):
    value: Literal["loaded", "loading", "unloaded"]
    failed: bool = False                # its last load failed (``error`` says why)
    error: str | None = None


class ServedModelCard(ModelCard, kw_only=True):
    """A ``/v1/models`` (and ``/models``) entry: OpenAI's card, with where the model loads from
    and its state. ``decoders`` and ``max_model_len`` are those of its last load (None before)."""

    path: str | None = None
    status: ModelStatus | None = None


class ModelAction(Struct, kw_only=True):
    """POST /models/load and /models/unload."""

    model: str


class ModelActionResult(Struct, kw_only=True):
    success: bool = True


model_action_decoder = msgspec.json.Decoder(ModelAction)
