"""Every kind of bad request gets a 4xx with an OpenAI-style error body naming the field, and the server keeps
serving. The table is docs/serving.md's (a test checks that each case is listed there)."""

import http.client
import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

MODEL = "echo-test"
C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL, "prompt": "To be", "max_tokens": 4}
MSG = [{"role": "user", "content": "Hi"}]

# (case, method, path, body: dict | bytes | None, expected status, expected param, words the message must contain)
CASES = [
    ("body is not JSON", "POST", C, b"{not json", 400, None, "not valid JSON"),
    ("body is empty", "POST", C, b"", 400, None, "empty"),
    ("body is a JSON array", "POST", C, [1, 2], 400, None, "JSON object"),
    ("prompt missing", "POST", C, {"model": MODEL}, 400, "prompt", "required"),
    ("prompt of the wrong type", "POST", C, {**OK, "prompt": 3}, 400, "prompt", "must be"),
    ("prompt empty", "POST", C, {**OK, "prompt": ""}, 400, "prompt", "non-empty"),
    ("prompt mixes strings and ids", "POST", C, {**OK, "prompt": ["a", 1]}, 400, "prompt", "must be"),
    ("prompt token id outside the vocabulary", "POST", C, {**OK, "prompt": [1, 10**9]}, 400, "prompt", "vocabulary"),
    ("too many prompts", "POST", C, {**OK, "prompt": ["a"] * 65}, 400, "prompt", "at most 64"),
    ("max_tokens zero", "POST", C, {**OK, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("max_tokens not an integer", "POST", C, {**OK, "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ("prompt + max_tokens beyond the context", "POST", C, {**OK, "max_tokens": 100000}, 400, "max_tokens", "context"),
    ("temperature negative", "POST", C, {**OK, "temperature": -1}, 400, "temperature", ">= 0"),
    ("temperature not a number", "POST", C, {**OK, "temperature": "hot"}, 400, "temperature", "number"),
    ("top_p out of (0, 1]", "POST", C, {**OK, "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("top_k below -1", "POST", C, {**OK, "top_k": -5}, 400, "top_k", "integer"),
    ("top_k beyond 64 bits", "POST", C, {**OK, "top_k": 2**63}, 400, "top_k", "integer in"),
    ("temperature a 401-digit integer", "POST", C, {**OK, "temperature": 10**400}, 400, "temperature", "finite"),
    ("too many stop_token_ids", "POST", C, {**OK, "stop_token_ids": [1] * 257}, 400, "stop_token_ids", "at most 256"),
    ("stop_token_ids outside the vocabulary", "POST", C, {**OK, "stop_token_ids": [10**6]}, 400, "stop_token_ids",
     "token ids in"),
    ("n given as true", "POST", C, {**OK, "n": True}, 400, "n", "one choice"),
    ("prompt too long to tokenise", "POST", C, {**OK, "prompt": "ab " * 400000}, 400, "prompt", "characters"),
    ("seed not an integer", "POST", C, {**OK, "seed": 1.5}, 400, "seed", "integer"),
    ("seed out of range", "POST", C, {**OK, "seed": 2**64}, 400, "seed", "2**63"),
    ("stop of the wrong type", "POST", C, {**OK, "stop": 5}, 400, "stop", "string"),
    ("stop with an empty string", "POST", C, {**OK, "stop": [""]}, 400, "stop", "non-empty"),
    ("too many stop strings", "POST", C, {**OK, "stop": ["x"] * 17}, 400, "stop", "at most 16"),
    ("stop strings too long together", "POST", C, {**OK, "stop": ["x" * 300] * 16}, 400, "stop", "4096 characters"),
    ("stream not a boolean", "POST", C, {**OK, "stream": "yes"}, 400, "stream", "true or false"),
    ("stream_options without stream", "POST", C, {**OK, "stream_options": {"include_usage": True}}, 400,
     "stream_options", "stream is true"),
    ("ignore_eos not a boolean", "POST", C, {**OK, "ignore_eos": 1}, 400, "ignore_eos", "true or false"),
    ("n > 1", "POST", C, {**OK, "n": 2}, 400, "n", "one choice"),
    ("logprobs asked for", "POST", C, {**OK, "logprobs": 5}, 400, "logprobs", "not returned"),
    ("penalty asked for", "POST", C, {**OK, "presence_penalty": 0.5}, 400, "presence_penalty", "not implemented"),
    ("logit_bias asked for", "POST", C, {**OK, "logit_bias": {"1": 5}}, 400, "logit_bias", "not implemented"),
    ("echo with token-id prompt", "POST", C, {**OK, "prompt": [1, 2], "echo": True}, 400, "echo", "text prompt"),
    ("unknown model", "POST", C, {**OK, "model": "gpt-5"}, 404, "model", "does not exist"),
    ("model not a string", "POST", C, {**OK, "model": 7}, 400, "model", "string"),
    ("messages missing", "POST", CHAT, {"model": MODEL}, 400, "messages", "non-empty list"),
    ("messages empty", "POST", CHAT, {"model": MODEL, "messages": []}, 400, "messages", "non-empty list"),
    ("message without a known role", "POST", CHAT, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
     400, "messages[0].role", "one of"),
    ("message content of the wrong type", "POST", CHAT,
     {"model": MODEL, "messages": [{"role": "user", "content": {"a": 1}}]}, 400, "messages[0].content", "string"),
    ("conversation ending with the assistant", "POST", CHAT,
     {"model": MODEL, "messages": MSG + [{"role": "assistant", "content": "Hello"}]}, 400, "messages", "last message"),
    ("messages too long to tokenise", "POST", CHAT, {"model": MODEL, "messages": [{"role": "user",
                                                                                  "content": "ab " * 400000}]},
     400, "messages", "characters"),
    ("max_completion_tokens zero", "POST", CHAT, {"model": MODEL, "messages": MSG, "max_completion_tokens": 0}, 400,
     "max_completion_tokens", ">= 1"),
    ("tools asked for", "POST", CHAT, {"model": MODEL, "messages": MSG, "tools": [{"type": "function"}]}, 400,
     "tools", "not implemented"),
    ("unknown path", "POST", "/v1/embeddings", OK, 404, None, "no such endpoint"),
    ("wrong method", "GET", C, None, 405, None, "not allowed"),
    ("body too large", "POST", C, b"{" + b" " * (5 << 20) + b"}", 413, None, "bytes"),
    ("body nested too deeply", "POST", C, b"[" * 100000 + b"]" * 100000, 400, None, "nests too deeply"),
    ("prompt with a lone surrogate", "POST", C, b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt", "Unicode"),
    ("message content with a lone surrogate", "POST", CHAT,
     b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages[0].content", "Unicode"),
]


def _request(port: int, method: str, path: str, body) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, json.loads(raw) if raw else {}


@pytest.mark.parametrize("case,method,path,body,status,param,words", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_a_clear_4xx(served, case, method, path, body, status, param, words):
    got, answer = _request(served.port, method, path, body)
    assert got == status, f"{case}: HTTP {got}, {answer}"
    err = answer["error"]
    assert err["param"] == param, err
    assert words in err["message"], err
    assert err["type"] in ("invalid_request_error", "model_not_found")


def test_the_server_keeps_serving_after_every_bad_request(served):
    for case, method, path, body, *_ in CASES:
        _request(served.port, method, path, body)
    status, answer = _request(served.port, "POST", C, {**OK, "temperature": 0})
    assert status == 200 and answer["choices"][0]["finish_reason"] in ("length", "stop")
    assert served.idle()


def test_the_table_is_documented():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    missing = [c[0] for c in CASES if f"| {c[0]} |" not in doc]
    assert not missing, f"docs/serving.md lacks rows for: {missing}"
    assert len(CASES) >= 20
