"""Malformed and hostile requests against the real HTTP server: each gets a 4xx with an OpenAI
error body (`error.message`, `type`, `param`, `code`, and the `request_id` the server logged
it under) that carries no internal detail, and the server is healthy and correct afterwards.

The requests are of every kind a client or a web page can send: JSON nested or sized to break
a parser, numbers out of every field's range, text that is not Unicode, bodies of the wrong
type, encoding or size, wrong methods and paths, and missing or wrong credentials (against the
session cluster's second app, which requires a key).
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.cluster.conftest import MODEL, TIMEOUT_S

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SECURE = "/secure/v1"
KEY = "sekret"  # the session cluster's secure app
OK_COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
JSON = {"content-type": "application/json"}

# What an error body must never show: tracebacks, source lines, pids, actor and object ids,
# Ray's exception names, terminal colour codes.
INTERNALS = re.compile(r"Traceback|File \"|\.py\b|\bpid\b|actor|Ray[A-Z]\w*Error|ObjectRef|0x[0-9a-f]{6,}"
                       r"|\x1b\[|site-packages|[0-9a-f]{32}", re.IGNORECASE)


def raw(template: dict, **replacements: str) -> bytes:
    """`template` as JSON with some values spliced in verbatim (JSON `json.dumps` cannot write:
    NaN-free bare tokens, numbers beyond Python's printable int size, lone surrogate escapes)."""
    text = json.dumps({**template, **{k: f"@@{k}@@" for k in replacements}})
    for key, value in replacements.items():
        text = text.replace(f'"@@{key}@@"', value)
    return text.encode()


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (name, method, path, headers, body bytes, status, error code or param expected, or None)
CASES = [
    # -- depth and size ---------------------------------------------------------------------
    ("arrays 50,000 deep", "POST", COMPLETIONS, JSON, nested(50_000).encode(), 400, None),
    ("objects 20,000 deep in an unknown field", "POST", COMPLETIONS, JSON,
     raw(OK_COMPLETION, extra='{"a":' * 20_000 + "1" + "}" * 20_000), 400, None),
    ("content parts 40 deep", "POST", CHAT, JSON,
     raw(OK_CHAT, messages='[{"role":"user","content":' + nested(40) + "}]"), 400, None),
    ("integer of 5,000 digits", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, max_tokens="9" * 5000), 400, None),
    ("integer of 100 digits in an unknown field", "POST", COMPLETIONS, JSON,
     raw(OK_COMPLETION, whatever="1" * 100), 400, None),
    ("float of 1e999", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, temperature="1e999"), 400, None),
    ("NaN", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, temperature="NaN"), 400, None),
    ("Infinity", "POST", CHAT, JSON, raw(OK_CHAT, top_p="Infinity"), 400, None),
    ("-Infinity", "POST", CHAT, JSON, raw(OK_CHAT, temperature="-Infinity"), 400, None),
    ("body over the size limit", "POST", COMPLETIONS, JSON, b'{"prompt": "' + b"a" * (5 << 20) + b'"}', 413,
     "request_too_large"),
    ("prompt over the context", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, prompt=json.dumps("hello " * 9000)),
     400, "context_length_exceeded"),
    ("10,000 chat messages", "POST", CHAT, JSON,
     raw(OK_CHAT, messages=json.dumps([{"role": "user", "content": "hi there"}] * 10_000)), 400,
     "context_length_exceeded"),
    # -- ranges -----------------------------------------------------------------------------
    ("seed 2**64", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, seed=str(2**64)), 400, "seed"),
    ("seed -1", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, seed="-1"), 400, "seed"),
    ("max_tokens 2**64", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, max_tokens=str(2**64)), 400, "max_tokens"),
    ("max_tokens over the context", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, max_tokens="100000"), 400,
     "context_length_exceeded"),
    ("max_completion_tokens 0", "POST", CHAT, JSON, raw(OK_CHAT, max_completion_tokens="0"), 400,
     "max_completion_tokens"),
    ("top_k 2**31", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, top_k=str(2**31)), 400, "top_k"),
    ("top_k -2", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, top_k="-2"), 400, "top_k"),
    ("min_tokens 2**40", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, min_tokens=str(2**40)), 400, "min_tokens"),
    ("min_tokens over max_tokens", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, min_tokens="50"), 400, None),
    ("token id negative", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, prompt="[1, -5]"), 400, "prompt"),
    ("token id 2**31", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, prompt=f"[{2**31}]"), 400, "prompt"),
    ("token id past the vocabulary", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, prompt="[10000000]"), 400, None),
    ("presence_penalty 5", "POST", CHAT, JSON, raw(OK_CHAT, presence_penalty="5"), 400, "presence_penalty"),
    # -- types ------------------------------------------------------------------------------
    ("max_tokens a float", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, max_tokens="4.0"), 400, "max_tokens"),
    ("max_tokens a bool", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, max_tokens="true"), 400, "max_tokens"),
    ("temperature a string", "POST", CHAT, JSON, raw(OK_CHAT, temperature='"0.5"'), 400, "temperature"),
    ("stream a string", "POST", CHAT, JSON, raw(OK_CHAT, stream='"true"'), 400, "stream"),
    ("stream_options wrong", "POST", CHAT, JSON, raw(OK_CHAT, stream_options='{"include_usage": "yes"}'), 400,
     "stream_options"),
    ("stop of 17 strings", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, stop=json.dumps(["x"] * 17)), 400, None),
    ("stop not strings", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, stop="[1, 2]"), 400, "stop"),
    ("message content a number", "POST", CHAT, JSON, raw(OK_CHAT, messages='[{"role":"user","content":5}]'),
     400, "messages"),
    ("message not an object", "POST", CHAT, JSON, raw(OK_CHAT, messages='["hi"]'), 400, "messages"),
    ("no messages", "POST", CHAT, JSON, raw(OK_CHAT, messages="[]"), 400, "messages"),
    ("image content part", "POST", CHAT, JSON,
     raw(OK_CHAT, messages='[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]'),
     400, "messages"),
    ("two prompts", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, prompt='["a", "b"]'), 400, None),
    ("n of 17", "POST", CHAT, JSON, raw(OK_CHAT, n="17"), 400, "n"),
    ("duplicate key, the last one bad", "POST", COMPLETIONS, JSON,
     b'{"model": "' + MODEL.encode() + b'", "prompt": "x", "max_tokens": 4, "max_tokens": -1}', 400, "max_tokens"),
    # -- encoding ---------------------------------------------------------------------------
    ("lone surrogate in the prompt", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, prompt='"a\\ud800b"'), 400, None),
    ("lone low surrogate in a message", "POST", CHAT, JSON,
     raw(OK_CHAT, messages='[{"role":"user","content":"\\udfff"}]'), 400, None),
    ("lone surrogate in the model name", "POST", CHAT, JSON, raw(OK_CHAT, model='"\\ud83d"'), 400, None),
    ("invalid UTF-8", "POST", COMPLETIONS, JSON, b'{"model": "' + MODEL.encode() + b'", "prompt": "\xff\xfe"}', 400,
     None),
    ("UTF-16 body", "POST", COMPLETIONS, JSON, json.dumps(OK_COMPLETION).encode("utf-16"), 400, None),
    ("UTF-8 byte order mark", "POST", COMPLETIONS, JSON, b"\xef\xbb\xbf" + json.dumps(OK_COMPLETION).encode(), 400,
     None),
    # -- not a JSON object ------------------------------------------------------------------
    ("empty body", "POST", COMPLETIONS, JSON, b"", 400, None),
    ("null", "POST", COMPLETIONS, JSON, b"null", 400, None),
    ("a JSON string", "POST", CHAT, JSON, b'"hello"', 400, None),
    ("truncated JSON", "POST", CHAT, JSON, json.dumps(OK_CHAT).encode()[:-7], 400, None),
    ("trailing garbage", "POST", CHAT, JSON, json.dumps(OK_CHAT).encode() + b" x", 400, None),
    ("a model that does not exist", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, model='"gpt-9"'), 404,
     "model_not_found"),
    ("a model name of 100 kB", "POST", COMPLETIONS, JSON, raw(OK_COMPLETION, model=json.dumps("m" * 100_000)), 404,
     "model_not_found"),
    # -- content types ----------------------------------------------------------------------
    ("text/plain", "POST", COMPLETIONS, {"content-type": "text/plain"}, json.dumps(OK_COMPLETION).encode(), 415,
     "unsupported_media_type"),
    ("no content type", "POST", CHAT, {}, json.dumps(OK_CHAT).encode(), 415, "unsupported_media_type"),
    ("form encoded", "POST", COMPLETIONS, {"content-type": "application/x-www-form-urlencoded"}, b"prompt=hi", 415,
     "unsupported_media_type"),
    ("multipart", "POST", CHAT, {"content-type": "multipart/form-data; boundary=x"}, b"--x--", 415,
     "unsupported_media_type"),
    ("json in latin-1", "POST", COMPLETIONS, {"content-type": "application/json; charset=latin-1"},
     json.dumps(OK_COMPLETION).encode(), 415, "unsupported_media_type"),
    ("application/jsonp", "POST", COMPLETIONS, {"content-type": "application/jsonp"},
     json.dumps(OK_COMPLETION).encode(), 415, "unsupported_media_type"),
    # -- methods and paths ------------------------------------------------------------------
    ("GET a POST route", "GET", COMPLETIONS, {}, b"", 405, None),
    ("PUT a POST route", "PUT", CHAT, JSON, json.dumps(OK_CHAT).encode(), 405, None),
    ("DELETE the model list", "DELETE", "/v1/models", {}, b"", 405, None),
    ("OPTIONS a POST route", "OPTIONS", COMPLETIONS, {}, b"", 405, None),
    ("unknown route", "GET", "/v1/nothing", {}, b"", 404, None),
    ("unknown POST route", "POST", "/v1/engines/x/completions", JSON, json.dumps(OK_COMPLETION).encode(), 404, None),
    ("path of 6 kB", "GET", "/v1/" + "x" * 6000, {}, b"", 404, None),
    ("encoded traversal", "GET", "/v1/%2e%2e/%2e%2e/etc/passwd", {}, b"", 404, None),
    # -- credentials (the app that requires a key) -------------------------------------------
    ("no key", "POST", SECURE + "/completions", JSON, json.dumps(OK_COMPLETION).encode(), 401, "invalid_api_key"),
    ("wrong key", "POST", SECURE + "/chat/completions", {**JSON, "authorization": "Bearer wrong"},
     json.dumps(OK_CHAT).encode(), 401, "invalid_api_key"),
    ("key in capitals", "POST", SECURE + "/completions", {**JSON, "authorization": f"Bearer {KEY.upper()}"},
     json.dumps(OK_COMPLETION).encode(), 401, "invalid_api_key"),
    ("basic auth", "GET", SECURE + "/models", {"authorization": "Basic c2VrcmV0Og=="}, b"", 401, "invalid_api_key"),
    ("no key, unknown route", "GET", SECURE + "/nothing", {}, b"", 401, "invalid_api_key"),
    ("no key, wrong method", "GET", SECURE + "/completions", {}, b"", 401, "invalid_api_key"),
    ("no key, text/plain", "POST", SECURE + "/completions", {"content-type": "text/plain"},
     json.dumps(OK_COMPLETION).encode(), 401, "invalid_api_key"),
    ("key, unknown route", "GET", SECURE + "/nothing", {"authorization": f"Bearer {KEY}"}, b"", 404, None),
]


@pytest.fixture(scope="module")
def before(tandem):
    """The backends' instance ids before the hostile requests (none may restart)."""
    return httpx.get(tandem.url + "/health", timeout=TIMEOUT_S).json()["backends"]


def test_there_are_at_least_forty_cases():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name, method, path, headers, body, status, expected", CASES, ids=[c[0] for c in CASES])
def test_hostile_request_gets_a_clean_openai_error(tandem, before, name, method, path, headers, body, status,
                                                   expected):
    with httpx.Client(base_url=tandem.url, timeout=TIMEOUT_S) as http:
        r = http.request(method, path, content=body, headers=headers)
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code", "request_id"}, error
    assert error["message"] and error["type"] and len(error["message"]) < 400, error
    assert error["request_id"] == r.headers["x-tandem-request-id"]
    assert not INTERNALS.search(error["message"]), error["message"]
    if expected is not None:
        assert expected in (error["code"], error["param"]) or (error["param"] or "").startswith(expected), error
    if status in (429, 503):
        assert r.headers["retry-after"]


def test_a_declared_length_over_the_limit_is_refused_before_the_body(tandem, before):
    """Content-Length says 1 GB and only a byte follows: the 413 comes without waiting for the
    rest (a client that never sends it cannot hold the request open)."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(tandem.url)
    head = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {1 << 30}\r\n\r\n{{")
    with socket.create_connection((url.hostname, url.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(head.encode())
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    assert status_line.split()[1] == b"413", reply[:300]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_too_large"


def test_server_is_healthy_and_correct_after_them(tandem, before, http):
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["backends"] == before, "a backend restarted"
    first = http.post(COMPLETIONS, json=OK_COMPLETION)
    assert first.status_code == 200 and first.json()["choices"][0]["text"]
    with_charset = http.post(COMPLETIONS, content=json.dumps(OK_COMPLETION).encode(),
                             headers={"content-type": "Application/JSON; charset=UTF-8"})
    assert with_charset.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    largest_seed = http.post(COMPLETIONS, json={**OK_COMPLETION, "temperature": 1.0, "seed": 2**64 - 1})
    assert largest_seed.status_code == 200 and largest_seed.json()["usage"]["completion_tokens"] == 4
    authorised = http.post(SECURE + "/completions", json=OK_COMPLETION, headers={"authorization": f"Bearer {KEY}"})
    assert authorised.status_code == 200
