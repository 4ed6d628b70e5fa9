"""The OpenAI request bodies the server accepts, checked field by field before anything is submitted.

`parse_completion(body, ...)` and `parse_chat(body, ...)` turn a decoded JSON body into a `GenerationPlan`, or
raise `RequestError(status, message, param)` naming the field and what is accepted (the table in
docs/serving.md). Nothing here touches the engine; the server maps a `RequestError` to an OpenAI-style error body:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Fields the server does not know are ignored (as vLLM and TensorRT-LLM's server do: clients send newer fields).
Fields it knows but does not implement (n > 1, logprobs, penalties, logit_bias, suffix, tools) are refused with
400 instead of being silently dropped: an answer that ignored them would look like their result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from echo_trtllm.runtime.request import (MAX_SEED, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOP_K, STOP_LIMITS,
                                         SamplingParams, _is_int, stop_strings_fit, stops_described)

__all__ = ["RequestError", "GenerationPlan", "parse_completion", "parse_chat", "chat_prompt_ids", "MAX_STOP_STRINGS",
           "MAX_PROMPTS", "max_token_chars"]

# (stop strings and stop ids: OpenAI caps stop sequences at 4; the limits every front end shares are in
# runtime/request.py)
MAX_PROMPTS = 64  # prompts in one /v1/completions request (each becomes an engine request)
CHAT_ROLES = ("system", "user", "assistant")


class RequestError(Exception):
    """A request the server refuses: HTTP status, a message naming what is wrong and what is accepted, the field."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass
class GenerationPlan:
    """What one HTTP request asks for: prompts (text or token ids) and how to generate each."""

    prompts: list  # str | list[int] per choice
    params: SamplingParams
    stream: bool
    include_usage: bool = False
    echo: bool = False  # completions: prepend the prompt text to the completion
    max_tokens_given: bool = True  # False: max_tokens is "the rest of the context" (chat without max_tokens)
    extra: dict = field(default_factory=dict)
    # stream_options.continuous_usage_stats (vLLM's name): every chunk carries the usage so far
    continuous_usage: bool = False


def max_token_chars(tokenizer) -> int:
    """The longest vocabulary entry in characters: a text longer than context x this cannot fit in the context,
    so a front end refuses it before tokenising it (default 64 for a tokenizer without a vocabulary listing)."""
    return max((len(t) for t in tokenizer.vocabulary()), default=64) or 64


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(v) -> bool:
    """A JSON number that is a finite float (a 400-digit integer is not: float() overflows)."""
    try:
        return _is_number(v) and math.isfinite(float(v))
    except OverflowError:
        return False


def _bad(param: str, accepted: str, value) -> RequestError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return RequestError(400, f"{param} must be {accepted}, got {shown}", param)


def _get(body: dict, name: str, check, accepted: str, default=None):
    if name not in body or body[name] is None:
        return default
    value = body[name]
    if not check(value):
        raise _bad(name, accepted, value)
    return value


def _text(param: str, value: str) -> str:
    """A string that is valid Unicode (JSON can carry lone surrogates, which no tokenizer encodes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(400, f"{param} is not valid Unicode text ({e.reason} at character {e.start})",
                           param) from None
    return value


def _unsupported(body: dict) -> None:
    """Known OpenAI fields whose non-default values this server does not implement."""
    rules = [
        ("n", lambda v: _is_int(v) and v == 1, "1 (one choice per prompt)"),
        ("best_of", lambda v: _is_int(v) and v == 1, "1 or absent"),
        ("logprobs", lambda v: v is False or (_is_int(v) and v == 0), "absent (log probabilities are not returned)"),
        ("top_logprobs", lambda v: _is_int(v) and v == 0, "absent (log probabilities are not returned)"),
        ("presence_penalty", lambda v: _is_number(v) and v == 0, "0 or absent (penalties are not implemented)"),
        ("frequency_penalty", lambda v: _is_number(v) and v == 0, "0 or absent (penalties are not implemented)"),
        ("repetition_penalty", lambda v: _is_number(v) and v == 1, "1 or absent (penalties are not implemented)"),
        ("logit_bias", lambda v: v == {}, "absent (logit bias is not implemented)"),
        ("suffix", lambda v: v == "", "absent (insertion is not implemented)"),
        ("tools", lambda v: v == [], "absent (tool calls are not implemented)"),
        ("response_format", lambda v: isinstance(v, dict) and v.get("type") == "text",
         'absent or {"type": "text"} (structured output is not implemented)'),
    ]
    for name, ok, accepted in rules:
        if body.get(name) is not None and not ok(body[name]):
            raise _bad(name, accepted, body[name])


def _sampling(body: dict, max_tokens: int, max_tokens_field: str, vocab_size: int) -> SamplingParams:
    temperature = _get(body, "temperature", lambda v: _finite(v) and v >= 0, "a finite number >= 0 (0 = greedy)", 1.0)
    top_p = _get(body, "top_p", lambda v: _finite(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)
    top_k = _get(body, "top_k", lambda v: _is_int(v) and -1 <= v <= MAX_TOP_K,
                 f"an integer in [0, {MAX_TOP_K}], or -1 / 0 for off", 0)
    seed = _get(body, "seed", lambda v: _is_int(v) and 0 <= v <= MAX_SEED, "an integer in [0, 2**63 - 1]")
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
            raise _bad("stop", "a non-empty string or a list of non-empty strings", stop)
        for s in stops:
            _text("stop", s)
        if not stop_strings_fit(stops):
            raise _bad("stop", STOP_LIMITS, stops_described(stops))
        stop = stops or None
    stop_ids = _get(body, "stop_token_ids", lambda v: isinstance(v, list) and len(v) <= MAX_STOP_TOKEN_IDS and all(
        _is_int(t) and 0 <= t < vocab_size for t in v),
        f"a list of at most {MAX_STOP_TOKEN_IDS} token ids in [0, {vocab_size})")
    ignore_eos = _get(body, "ignore_eos", lambda v: isinstance(v, bool), "true or false", False)
    return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_k=max(int(top_k), 0),
                          top_p=float(top_p), seed=seed, stop=stop, stop_token_ids=stop_ids or None,
                          ignore_eos=ignore_eos)


def _common(body, served_model: str):
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "a string", model)
    if model is not None and model != served_model:
        raise RequestError(404, f"the model {model!r} does not exist; this server serves {served_model!r} "
                                f"(GET /v1/models)", "model", "model_not_found")
    _unsupported(body)
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not stream:
            raise _bad("stream_options", "absent unless stream is true", options)
        if not isinstance(options, dict) or not all(isinstance(options.get(k, False), bool)
                                                    for k in ("include_usage", "continuous_usage_stats")):
            raise _bad("stream_options", 'an object such as {"include_usage": true} (with '
                                         '"continuous_usage_stats": true, usage in every chunk)', options)
        include_usage = options.get("include_usage", False)
        continuous = options.get("continuous_usage_stats", False)
    return stream, include_usage, continuous


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None) -> tuple[int | None, str]:
    for name in names:
        if body.get(name) is not None:
            v = body[name]
            if not (_is_int(v) and v >= 1):
                raise _bad(name, "an integer >= 1", v)
            return v, name
    return default, names[0]


def _check_length(prompt_tokens: int, max_tokens: int, context: int, field_name: str) -> None:
    if prompt_tokens + max_tokens > context:
        raise RequestError(400, f"this model's context holds {context} tokens, but the request needs "
                                f"{prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, {max_tokens} in "
                                f"{field_name}): shorten the prompt or lower {field_name}", field_name)


def parse_completion(body, served_model: str, encode, vocab_size: int, context: int,
                     max_token_chars: int = 64) -> GenerationPlan:
    """POST /v1/completions. encode(text) -> token ids (for the length check); context: tokens per request;
    max_token_chars: the longest vocabulary entry in characters (a text longer than context x that cannot fit,
    and is refused without tokenizing it)."""
    stream, include_usage, continuous = _common(body, served_model)
    if "prompt" not in body or body["prompt"] is None:
        raise RequestError(400, "prompt is required: a string, a list of strings, a list of token ids, or a list "
                                "of lists of token ids", "prompt")
    raw = body["prompt"]
    accepted = "a non-empty string, a list of them, a non-empty list of token ids, or a list of those"
    if isinstance(raw, str):
        prompts = [raw]
    elif isinstance(raw, list) and raw and all(_is_int(t) for t in raw):
        prompts = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw):
        prompts = list(raw)
    elif isinstance(raw, list) and raw and all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in raw):
        prompts = list(raw)
    else:
        raise _bad("prompt", accepted, raw)
    if len(prompts) > MAX_PROMPTS:
        raise _bad("prompt", f"at most {MAX_PROMPTS} prompts per request", f"{len(prompts)} prompts")
    max_tokens, name = _max_tokens(body, ("max_tokens",), 16)
    echo = _get(body, "echo", lambda v: isinstance(v, bool), "true or false", False)
    if echo and any(not isinstance(p, str) for p in prompts):
        raise _bad("echo", "false when the prompt is token ids (only a text prompt can be echoed)", echo)
    params = _sampling(body, max_tokens, name, vocab_size)
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise _bad("prompt", accepted, p)
            if len(p) > context * max_token_chars:
                raise RequestError(400, f"the prompt has {len(p)} characters: more than this model's context of "
                                        f"{context} tokens can hold", "prompt")
            ids = encode(_text("prompt", p))
        else:
            ids = p
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise RequestError(400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                                   "prompt")
        _check_length(len(ids), max_tokens, context, name)
    return GenerationPlan(prompts, params, stream, include_usage, echo, continuous_usage=continuous)


def _message_text(i: int, message) -> tuple[str, str]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _bad(where, 'an object such as {"role": "user", "content": "..."}', message)
    role = message.get("role")
    if role == "developer":  # OpenAI's newer name for the system role
        role = "system"
    if role not in CHAT_ROLES:
        raise _bad(f"{where}.role", f"one of {', '.join(CHAT_ROLES)}", role)
    content = message.get("content")
    if isinstance(content, str):
        return role, _text(f"{where}.content", content)
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return role, _text(f"{where}.content", "".join(p["text"] for p in content))
    raise _bad(f"{where}.content", 'a string or a list of {"type": "text", "text": "..."} parts', content)


def chat_prompt_ids(messages: list[tuple[str, str]], tokenizer) -> list[int]:
    """The conversation as prompt token ids: the tokenizer's own chat template when it has one (its special tokens
    as the template writes them), else the plain template: one `role: content` line per message, then
    `assistant:` for the reply, encoded as any prompt is."""
    hf = tokenizer.hf
    if getattr(hf, "chat_template", None):
        out = hf.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=True,
                                     add_generation_prompt=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(t) for t in ids]
    return tokenizer.encode("".join(f"{role}: {content}\n" for role, content in messages) + "assistant:")


def parse_chat(body, served_model: str, tokenizer, context: int, max_token_chars: int | None = None
               ) -> GenerationPlan:
    """POST /v1/chat/completions. tokenizer: the runtime's Tokenizer (chat template and length check);
    max_token_chars: the longest vocabulary entry in characters: messages longer together than context x that
    cannot fit and are refused before the template renders or the tokenizer reads them (as completions' prompts)."""
    stream, include_usage, continuous = _common(body, served_model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", 'a non-empty list of {"role": ..., "content": ...} objects', messages)
    turns = [_message_text(i, m) for i, m in enumerate(messages)]
    chars = sum(len(c) for _, c in turns)
    if max_token_chars is not None and chars > context * max_token_chars:
        raise RequestError(400, f"the messages have {chars} characters: more than this model's context of {context} "
                                f"tokens can hold", "messages")
    if turns[-1][0] == "assistant":
        raise _bad("messages", "a conversation whose last message is from the system or the user",
                   "the last message is from the assistant")
    prompt = chat_prompt_ids(turns, tokenizer)
    prompt_tokens = len(prompt)
    if prompt_tokens >= context:
        raise RequestError(400, f"the rendered conversation has {prompt_tokens} tokens but the context holds "
                                f"{context}: it must leave room for at least one generated token", "messages")
    max_tokens, name = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
    given = max_tokens is not None
    if not given:
        max_tokens = context - prompt_tokens
    params = _sampling(body, max_tokens, name, tokenizer.vocab_size)
    _check_length(prompt_tokens, max_tokens, context, name)
    return GenerationPlan([prompt], params, stream, include_usage, max_tokens_given=given,
                          continuous_usage=continuous)
