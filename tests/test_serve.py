"""serve.py and protocol.py: the OpenAI-compatible HTTP API over a real socket: completions, chat,
streaming (its deltas equal to the whole reply, byte for byte), token ids in and out, tools in and tool
calls out, penalties, every method on every route, errors from http.server's own layer as JSON, a client
that leaves (no traceback; its request aborted), a full queue, a checkpoint's tokenizer.json, weight
updates under concurrent requests (per-token policy versions, refusals that change nothing); and the
terminal chat. The engine under it is tested in test_engine.py.
Run: python -m pytest -q tests/test_serve.py"""

import contextlib
import http.client
import json
import socket
import threading
import time
import types

import pytest
import requests
import torch

import chat
import engine
import model
import sampling
import serve
import tokenizer
import weights
from conftest import tiny_config
from test_engine import PROMPTS, ckpt, ckpt_v1, make_engine, one_thread  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def server_engine(ckpt):
    return make_engine(ckpt, num_pages=128, max_model_len=200)


@pytest.fixture(scope="module")
def server(server_engine, one_thread):
    eng = server_engine
    srv, stop = serve.make_server(eng, port=0, model_name="tiny", max_body=4096)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    stop.set()
    srv.shutdown()


def test_http_api(server, ckpt):
    assert requests.get(server + "/health").json()["status"] == "ok"
    assert requests.get(server + "/v1/models").json()["data"][0]["id"] == "tiny"
    r = requests.post(
        server + "/v1/completions",
        json={"prompt": "def hello", "max_tokens": 5, "temperature": 0, "logprobs": 2, "ignore_eos": True},
    ).json()
    assert r["usage"]["completion_tokens"] == 5 and len(r["choices"][0]["logprobs"]["token_logprobs"]) == 5
    # token in, token out: the same prompt as ids gives the same completion, with ids back
    prompt = ckpt[1].encode("def hello")
    ids = requests.post(
        server + "/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": 5,
            "temperature": 0,
            "return_token_ids": True,
            "ignore_eos": True,
        },
    ).json()
    assert ids["prompt_token_ids"] == prompt and len(ids["choices"][0]["token_ids"]) == 5
    assert ids["choices"][0]["text"] == r["choices"][0]["text"]
    echo = requests.post(
        server + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 5, "temperature": 0, "echo": True, "ignore_eos": True},
    ).json()
    assert echo["choices"][0]["text"] == "def hello" + r["choices"][0]["text"]
    c = requests.post(
        server + "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    ).json()
    assert c["choices"][0]["message"]["role"] == "assistant" and c["object"] == "chat.completion"
    assert len(c["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


def test_flush_cache_empties_the_prefix_cache(server, server_engine):
    """POST /flush_cache (SGLang's route), with no body or {}: the next request finds no cached prefix; a
    field in the body is a 400 naming it, and changes nothing."""
    body = {"prompt": list(range(40, 90)), "max_tokens": 2, "temperature": 0, "ignore_eos": True}

    def cached():
        r = requests.post(server + "/v1/completions", json=body).json()
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() > 0
    r = requests.post(server + "/flush_cache")  # no body at all
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["flushed_pages"] > 0
    assert cached() == 0
    assert cached() > 0
    bad = requests.post(server + "/flush_cache", json={"everything": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "everything"
    assert cached() > 0
    assert requests.post(server + "/flush_cache", json={}).status_code == 200 and cached() == 0


def test_http_streaming(server):
    body = {
        "prompt": [100, 101, 102, 103],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    with requests.post(server + "/v1/completions", json=body, stream=True) as r:
        lines = [l for l in r.iter_lines() if l]
    assert lines[-1] == b"data: [DONE]"
    chunks = [json.loads(l[6:]) for l in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    ids = sum((c["choices"][0]["token_ids"] for c in chunks if c["choices"]), [])
    del body["stream"]
    del body["stream_options"]
    whole = requests.post(server + "/v1/completions", json=body).json()
    assert text == whole["choices"][0]["text"] and ids == whole["choices"][0]["token_ids"]
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True, "seed": 1}
    with requests.post(server + "/v1/chat/completions", json=chat, stream=True) as r:
        lines = [l for l in r.iter_lines() if l]
    assert (
        lines[-1] == b"data: [DONE]"
        and json.loads(lines[0][6:])["choices"][0]["delta"]["role"] == "assistant"
    )
    assert all(json.loads(l[6:])["choices"] for l in lines[:-1])  # no usage chunk unless include_usage


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ("/v1/completions", {"prompt": []}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 2, 999999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": list(range(1, 250))}, 400, "prompt"),  # longer than max_model_len 200
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
        ("/v1/completions", {"prompt": "x", "temperature": -1e-40}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "temperature": 101}, 400, "temperature"),
        ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
            400,
            "top_logprobs",
        ),
        ("/v1/completions", b"[" * 100000 + b"]" * 100000, 413, None),
        ("/v1/completions", b"[" * 2000 + b"]" * 2000, 400, None),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"},
            400,
            "stream",
        ),
        ("/v1/embeddings", {"input": "x"}, 404, None),
        (
            "/v1/chat/completions",
            {"messages": HI, "max_tokens": -1, "max_completion_tokens": 5},
            400,
            "max_tokens",
        ),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ("/v1/completions", {"prompt": "x", "frequency_penalty": "a lot"}, 400, "frequency_penalty"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 100}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "tools": []}, 400, "tools"),  # a chat field
        (
            "/v1/chat/completions",
            {"messages": HI, "response_format": {"type": "json_object"}},
            400,
            "response_format",
        ),
        ("/v1/chat/completions", {"messages": HI, "tool_choice": "required"}, 400, "tool_choice"),
        ("/v1/chat/completions", {"messages": HI, "tool_choice": {"type": "function"}}, 400, "tool_choice"),
        ("/v1/chat/completions", {"messages": HI, "parallel_tool_calls": "yes"}, 400, "parallel_tool_calls"),
        ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function"}]}, 400, "tools"),
        ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "retrieval"}]}, 400, "tools"),
        (
            "/v1/chat/completions",
            {"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            400,
            "tools",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            400,
            "messages",
        ),
        ("/v1/completions", {"prompt": "x" * 5000}, 413, None),
    ],
)
def test_http_malformed(server, path, body, status, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = requests.post(server + path, data=data, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param
    ok = requests.post(server + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})  # still serving
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_http_keepalive_and_bad_lengths(server):
    with requests.Session() as s:  # an error before the body is read must not poison the pooled connection
        assert s.post(server + "/v1/embeddings", json={"input": "x" * 100}).status_code == 404
        assert s.post(server + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}).status_code == 200
    host, port = server[len("http://") :].split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    c.putrequest("POST", "/v1/completions")
    c.putheader("Content-Length", "-5")
    c.endheaders()
    r = c.getresponse()
    assert r.status == 400 and "Content-Length" in json.loads(r.read())["error"]["message"]
    c.close()
    for length, status, says in (("58.0", 400, "malformed Content-Length"), (None, 411, "is required")):
        c = http.client.HTTPConnection(host, int(port), timeout=10)
        c.putrequest("POST", "/v1/completions")
        if length is not None:
            c.putheader("Content-Length", length)
        c.endheaders()
        r = c.getresponse()
        assert r.status == status and says in json.loads(r.read())["error"]["message"]
        c.close()


def test_chat_reply_is_cut_at_the_stop_string(ckpt):
    tok = ckpt[1]
    think, end = tok.special_tokens["<think>"], tok.special_tokens["</think>"]
    r = engine.Request([1], sampling.SamplingParams(stop=["lazy"]), set())
    r.out = [think] + tok.encode("the quick fox") + [end] + tok.encode("return 'hi' + lazy dog")
    r.stop_str = "lazy"
    assert chat.parse_reply(r.out, tok, stop=r.stop_str) == {
        "role": "assistant",
        "content": "return 'hi' +",
        "reasoning_content": "the quick fox",
    }
    r.stop_str = "quick"  # in the thinking: the reasoning is cut there and no content follows
    assert chat.parse_reply(r.out, tok, stop=r.stop_str) == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "the",
    }
    r.stop_str = None
    assert chat.parse_reply(r.out, tok, stop=r.stop_str)["content"] == "return 'hi' + lazy dog"


def test_http_concurrent_clients_and_full(server, ckpt):
    out = [None] * 6

    def go(i):
        out[i] = requests.post(
            server + "/v1/completions",
            json={"prompt": PROMPTS[i % 4], "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        ).json()

    ts = [threading.Thread(target=go, args=(i,)) for i in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    ref = make_engine(ckpt).generate(
        PROMPTS, sampling.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )
    assert [o["choices"][0]["text"] for o in out] == [ckpt[1].decode(ref[i % 4].out) for i in range(6)]
    assert requests.get(server + "/health").status_code == 200


def test_http_full_queue_is_503_then_recovers(server, server_engine):
    server_engine.max_waiting = 0  # a queue with no room: what a flood of clients leads to
    try:
        r = requests.post(server + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_full"
    finally:
        server_engine.max_waiting = 256
    assert (
        requests.post(server + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}).status_code == 200
    )


def test_terminal_chat_keeps_the_conversation(ckpt, one_thread, monkeypatch, capsys):
    """serve.terminal (serve.py --chat): two turns, thinking toggled off between them; the second turn's
    prompt holds the first (a prefix-cache hit), replies are streamed, an empty line quits."""
    eng = make_engine(ckpt, num_pages=256)
    lines = iter(["hello there", "/think", "and again", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    submitted = []
    submit = eng.submit

    def recording_submit(prompt, sp):
        submitted.append(prompt)
        return submit(prompt, sp)

    monkeypatch.setattr(eng, "submit", recording_submit)
    serve.terminal(eng, sampling.SamplingParams(max_tokens=6, temperature=0), thinking=True)
    out = capsys.readouterr().out
    assert "(thinking off)" in out and len(submitted) == 2
    assert "\033[2m\033[0m" not in out  # no empty dim spans
    assert eng.stats["cached_tokens"] >= 4 and len(submitted[1]) > len(submitted[0])
    tok = ckpt[1]
    assert tok.decode(submitted[1]).count("hello there") == 1 and "and again" in tok.decode(submitted[1])
    assert submitted[1][-1] == tok.special_tokens["</think>"]  # thinking off: the prompt ends in </think>


# -----------------------------------------------------------------------------
# Scripted replies: the model's tokens chosen by the test, so the HTTP layer is checked on known text


@contextlib.contextmanager
def scripted_server(ckpt, script_for):
    """A server whose engine appends script_for(request)[i] as its i-th token instead of sampling."""
    m = weights.from_pretrained(ckpt[0], max_position_embeddings=2048)  # room for a tool list's prompt
    eng = engine.Engine(m.eval(), ckpt[1], num_pages=512, page_size=4)
    real = eng.append

    def scripted(r, token, logprob=None, top=None):
        return real(r, script_for(r)[len(r.out)], logprob, top)

    eng.append = scripted
    srv, stop = serve.make_server(eng, port=0, model_name="tiny")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", eng
    finally:
        stop.set()
        srv.shutdown()
        srv.server_close()


def reply_ids(tok, msgs, reply, **kw):
    """The ids a model that follows the template writes for `reply` after the prompt for `msgs`."""
    prompt, _ = chat.render(msgs, tok, add_generation_prompt=True, **kw)
    ids, _ = chat.render(msgs + [reply], tok, **kw)
    assert ids[: len(prompt)] == prompt
    return ids[len(prompt) :]


def chat_both_ways(url, body):
    """-> (the non-streamed choice, the streamed one rebuilt from its deltas), the same keys in each."""
    whole = requests.post(url, json=body).json()["choices"][0]
    with requests.post(url, json={**body, "stream": True}, stream=True) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line and line != b"data: [DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert all(deltas[:-1])  # a step with nothing to show (a tool call being written) sends no chunk
    message = {
        "content": "".join(d.get("content", "") for d in deltas),
        "reasoning_content": "".join(d.get("reasoning_content", "") for d in deltas),
        "tool_calls": [c for d in deltas for c in d.get("tool_calls", [])],
    }
    streamed = {"message": message, "finish_reason": chunks[-1]["choices"][0]["finish_reason"]}
    msg = whole["message"]
    message = {
        "content": msg["content"] or "",
        "reasoning_content": msg.get("reasoning_content", ""),
        "tool_calls": msg.get("tool_calls", []),
    }
    return {"message": message, "finish_reason": whole["finish_reason"]}, streamed


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "open",
            "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}},
        },
    },
]


def test_http_tools_round_trip(ckpt, one_thread):
    """tools in (rendered into the prompt as the template writes them), two tool calls out (ids,
    finish_reason "tool_calls", the same calls streamed whole), the assistant message and two "tool"
    results sent back (content null allowed), and the next reply."""
    tok = ckpt[1]
    ask = [{"role": "user", "content": "find the fox"}]
    calls = [
        {"type": "function", "function": {"name": "search", "arguments": '{"q": "fox"}'}},
        {"type": "function", "function": {"name": "open", "arguments": '{"id": 2}'}},
    ]
    off = {"enable_thinking": False}
    calling = reply_ids(
        tok, ask, {"role": "assistant", "content": "let me look", "tool_calls": calls}, tools=TOOLS, **off
    )
    answering = tok.encode("it is in the box") + [tok.special_tokens["<|endoftext|>"]]
    observation = tok.special_tokens["<|observation|>"]

    def script_for(r):
        return answering if observation in r.prompt else calling

    body = {"messages": ask, "tools": TOOLS, "max_tokens": 120, "temperature": 0, "chat_template_kwargs": off}
    with scripted_server(ckpt, script_for) as (url, _):
        url += "/v1/chat/completions"
        got = requests.post(url, json={**body, "return_token_ids": True}).json()
        want_prompt, _ = chat.render(ask, tok, tools=TOOLS, add_generation_prompt=True, **off)
        assert got["prompt_token_ids"] == want_prompt  # the tools are in the prompt ...
        assert want_prompt != chat.render(ask, tok, add_generation_prompt=True, **off)[0]  # ... and show
        whole, streamed = chat_both_ways(url, body)
        msg = got["choices"][0]["message"]
        assert got["choices"][0]["finish_reason"] == "tool_calls" and msg["content"] == "let me look"
        got_calls = [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]
        ]
        assert got_calls == [("search", {"q": "fox"}), ("open", {"id": 2})]
        ids = [c["id"] for c in msg["tool_calls"]]
        assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
        assert streamed["finish_reason"] == whole["finish_reason"] == "tool_calls"
        assert [c.pop("index") for c in streamed["message"]["tool_calls"]] == [0, 1]
        assert [c["function"] for c in streamed["message"]["tool_calls"]] == [c["function"] for c in calls]
        assert streamed["message"]["content"] == whole["message"]["content"] == "let me look"
        results = [
            {"role": "tool", "tool_call_id": ids[0], "content": "a fox page"},
            {"role": "tool", "tool_call_id": ids[1], "content": "the fox is in the box"},
        ]
        assistant = {**msg, "content": None}  # as some clients send it back
        follow = {**body, "messages": ask + [assistant] + results}
        whole, streamed = chat_both_ways(url, follow)
        assert whole == streamed
        assert whole["message"]["content"] == "it is in the box" and whole["finish_reason"] == "stop"


def test_http_stream_equals_whole_on_scripted_whitespace_and_stops(ckpt, one_thread):
    """The concatenated deltas are the non-streamed message byte for byte, thinking on and off, on replies
    that start with a newline after </think> (the case that differed), end in whitespace, or hit a stop
    string in the reasoning or the content."""
    tok = ckpt[1]
    s = tok.special_tokens
    end = [s["<|endoftext|>"]]
    thinking = tok.encode("\n  weigh it  \n") + [s["</think>"]] + tok.encode("\n\nthe answer  \n") + end
    plain = tok.encode("\n the answer is 42 \n\n") + end
    script = {True: thinking, False: plain}
    think_id = s["<think>"]
    with scripted_server(ckpt, lambda r: script[r.prompt[-1] == think_id]) as (url, _):
        url += "/v1/chat/completions"
        want = {  # (thinking, stop) -> (reasoning, content): stripped, and cut at the stop string
            (True, None): ("weigh it", "the answer"),
            (True, "answer"): ("weigh it", "the"),
            (True, "eigh"): ("w", ""),  # a stop in the reasoning: no content follows
            (False, None): ("", "the answer is 42"),
            (False, "42"): ("", "the answer is"),
            (False, " is"): ("", "the answer"),
        }
        for (on, stop), (reasoning, content) in want.items():
            body = {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 40,
                "temperature": 0,
                "stop": stop,
                "chat_template_kwargs": {"enable_thinking": on},
            }
            whole, streamed = chat_both_ways(url, body)
            assert whole == streamed, (on, stop)
            assert whole["message"] == {"content": content, "reasoning_content": reasoning, "tool_calls": []}


def test_http_stream_equals_whole_greedy(server, one_thread):
    """Greedy replies of the (random) model itself: completions and chat, thinking on and off, with and
    without a stop string; the stream's text is the whole reply's, byte for byte."""
    url = server + "/v1/completions"
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        whole = requests.post(url, json=body).json()["choices"][0]["text"]
        with requests.post(url, json={**body, "stream": True}, stream=True) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line and line != b"data: [DONE]"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    url = server + "/v1/chat/completions"
    for content in ("hi", "def hello(name):", "the quick brown fox"):
        for on in (True, False):
            for ignore_eos in (False, True):
                body = {
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": 16,
                    "temperature": 0,
                    "ignore_eos": ignore_eos,
                    "chat_template_kwargs": {"enable_thinking": on},
                }
                whole, streamed = chat_both_ways(url, body)
                assert whole == streamed, (content, on, ignore_eos)


# -----------------------------------------------------------------------------
# Every route, every method, and errors from http.server's own layer


ROUTE_METHODS = {
    "/health": ("GET", "HEAD"),
    "/v1/models": ("GET", "HEAD"),
    "/v1/models/tiny": ("GET", "HEAD"),
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
    "/update_weights_from_disk": ("POST",),
    "/flush_cache": ("POST",),
    "/nope": (),
}


@pytest.mark.parametrize(
    "method", ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "BREW"]
)
def test_http_every_method_on_every_route(server, method):
    """JSON for each: 200 (GET and HEAD on the GET routes, HEAD without a body), 400 for an empty POST
    body ({} is a whole /flush_cache request: 200), 405 with Allow for a known route, 404 for an unknown one,
    501 for a method HTTP does not define; a query string is ignored."""
    host, port = server[len("http://") :].split(":")
    for path, allowed in ROUTE_METHODS.items():
        c = http.client.HTTPConnection(host, int(port), timeout=30)
        c.request(method, path + "?x=1&y", body=b"{}" if method == "POST" else None)
        r = c.getresponse()
        data = r.read()
        c.close()
        if method == "BREW":
            want = 501
        elif method in allowed:
            want = 400 if method == "POST" and path != "/flush_cache" else 200
        else:
            want = 405 if allowed else 404
        assert r.status == want, (method, path, data)
        assert r.getheader("Content-Type") == "application/json"
        if want == 405:
            assert r.getheader("Allow") == ", ".join(allowed)
        if method == "HEAD":
            assert data == b"" and int(r.getheader("Content-Length")) > 0
            continue
        body = json.loads(data)
        if want == 200:
            assert body.get("status") == "ok" or body.get("object") in ("list", "model")
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]


def raw_request(server, data):
    """Send raw bytes -> (status line, headers, body bytes), reading until the server closes."""
    host, port = server[len("http://") :].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while True:
            part = s.recv(65536)
            if not part:
                break
            got += part
    head, _, body = got.partition(b"\r\n\r\n")
    status, *headers = head.decode().split("\r\n")
    return status, dict(h.split(": ", 1) for h in headers), body


@pytest.mark.parametrize(
    "data,status",
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /health HTTP/1.1 extra\r\n\r\n", 400),
        (b"GET /health HTTP/9.9\r\n\r\n", 505),
        (b"GET /" + b"a" * 65 * 1024 + b" HTTP/1.1\r\n\r\n", 414),
        (b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101)) + b"\r\n", 431),
        (b"GET /health HTTP/1.1\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n", 431),
    ],
)
def test_http_layer_errors_are_json_with_a_status_line(server, data, status):
    line, headers, body = raw_request(server, data)
    assert line.startswith(f"HTTP/1.1 {status} "), line
    assert headers["Content-Type"] == "application/json" and headers["Connection"] == "close"
    assert json.loads(body)["error"]["message"]
    assert requests.get(server + "/health").status_code == 200


def test_a_client_gone_before_its_error_leaves_no_traceback(server_engine, capsys):
    """The handler writes its answer to a client that has already closed: the BrokenPipeError ends that
    connection quietly (an exception escaping the handler is what ThreadingHTTPServer prints as a
    traceback)."""
    srv = types.SimpleNamespace(engine=server_engine, model_name="tiny", max_body=4096, created=0)
    for request in (b"PUT /health HTTP/1.1\r\n\r\n", b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\n\r\n"):
        ours, theirs = socket.socketpair()
        theirs.sendall(request)
        theirs.close()
        serve.Handler(ours, ("client", 0), srv)  # reads the request, then fails to write: must not raise
        ours.close()
    err = capsys.readouterr().err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_http_abandoned_request_leaves_the_engine(ckpt, one_thread):
    """A non-streaming client that hangs up mid-decode: its request is aborted within a couple of engine
    steps (the handler looks at the socket at every step), not decoded to max_tokens for nobody; and a
    request still queued behind a full batch, streamed or not, leaves before it is ever admitted."""
    eng = make_engine(ckpt, num_pages=64, max_model_len=200)
    submitted = []
    submit = eng.submit
    step = eng.step

    def recording_submit(prompt, sp):
        submitted.append(submit(prompt, sp))
        return submitted[-1]

    def slow_step():  # steps slower than the handler thread wakes, so "a step or two" is what we see
        time.sleep(0.02)
        return step()

    eng.submit = recording_submit
    eng.step = slow_step
    srv, stop = serve.make_server(eng, port=0, model_name="tiny")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 150, "ignore_eos": True}).encode()
        s = socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        while not submitted or len(submitted[0].out) < 5:
            time.sleep(0.01)
        s.close()
        r = submitted[0]
        n = len(r.out)
        while r.finish is None:
            time.sleep(0.01)
        assert r.finish == "abort" and len(r.out) - n <= 3, (n, len(r.out))
        assert not eng.running and eng.cache.available() == eng.cache.num_pages
        # streamed or not, a request still queued behind a full batch leaves when its client does
        eng.max_batch = 1
        busy = eng.submit([8, 9], sampling.SamplingParams(max_tokens=150, ignore_eos=True))
        for stream in (False, True):
            count = len(submitted)
            body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 5, "stream": stream}).encode()
            s = socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=30)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            while len(submitted) == count:
                time.sleep(0.01)
            s.close()
            queued = submitted[-1]
            while queued.finish is None:
                time.sleep(0.01)
            assert queued.finish == "abort" and queued.out == [], stream  # never admitted
        busy.aborted = True
    finally:
        stop.set()
        srv.shutdown()
        srv.server_close()


# -----------------------------------------------------------------------------
# What OpenAI accepts and clients send


def test_http_text_parts_models_retrieve_and_ignored_fields(server, ckpt):
    url = server + "/v1/chat/completions"
    base = {"max_tokens": 3, "temperature": 0, "return_token_ids": True}
    as_text = requests.post(url, json={**base, "messages": [{"role": "user", "content": "hi there"}]}).json()
    parts = [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]
    as_parts = requests.post(url, json={**base, "messages": [{"role": "user", "content": parts}]}).json()
    assert as_parts["prompt_token_ids"] == as_text["prompt_token_ids"]
    assert as_parts["choices"][0]["token_ids"] == as_text["choices"][0]["token_ids"]
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    r = requests.post(url, json={**base, "messages": [{"role": "user", "content": image}]})
    assert r.status_code == 400 and "'image_url'" in r.json()["error"]["message"]
    ignored = {"user": "u1", "store": False, "metadata": {"a": "b"}, "service_tier": "auto"}
    r = requests.post(url, json={**base, **ignored, "messages": [{"role": "user", "content": "hi there"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == as_text["choices"][0]["token_ids"]
    card = requests.get(server + "/v1/models/tiny").json()
    assert card["id"] == "tiny" and card["object"] == "model"
    r = requests.get(server + "/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_http_what_real_clients_send(server, ckpt):
    """Found by driving the server with the official openai client and agent-framework habits: a
    temperature too small to divide by (1e-40, some harnesses' "deterministic") is greedy, not a 400;
    response_format {"type": "text"} (the default) is accepted; a system message mid-conversation and a
    no-argument tool call sent back with arguments "" render; logprobs' bytes are each token's own, top
    alternatives included, so a UTF-8 character split across tokens adds up."""
    url = server + "/v1/chat/completions"
    base = {"messages": HI, "max_tokens": 6, "return_token_ids": True, "ignore_eos": True}
    greedy = requests.post(url, json={**base, "temperature": 0}).json()["choices"][0]["token_ids"]
    tiny = requests.post(url, json={**base, "temperature": 1e-40}).json()["choices"][0]["token_ids"]
    assert tiny == greedy
    r = requests.post(url, json={**base, "temperature": 0, "response_format": {"type": "text"}})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == greedy
    call = {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": ""}}
    msgs = HI + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "and now?"},
    ]
    r = requests.post(url, json={**base, "messages": msgs})
    assert r.status_code == 200, r.text
    prompt = ckpt[1].decode(r.json()["prompt_token_ids"])
    assert "<tool_call>now</tool_call>" in prompt and "</tool_response><|system|>be brief<|user|>" in prompt
    body = {**base, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    lp = requests.post(url, json=body).json()["choices"][0]["logprobs"]["content"]
    out = ckpt[1].enc.decode_tokens_bytes(greedy)
    assert [bytes(e["bytes"]) for e in lp] == out
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in lp)  # greedy: the top one is the token
    assert all(len(e["top_logprobs"]) == 3 and all(t["bytes"] for t in e["top_logprobs"]) for e in lp)


def test_http_penalties_reach_the_engine(server, server_engine, ckpt):
    """presence_penalty / frequency_penalty go to the engine's sampling (tested there against a hand
    computation): a greedy reply under a strong frequency penalty is what the engine gives alone."""
    body = {"prompt": [7, 7, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 2.0}
    got = requests.post(server + "/v1/completions", json={**body, **penalties, "return_token_ids": True})
    sp = sampling.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, **penalties)
    assert got.json()["choices"][0]["token_ids"] == make_engine(ckpt).generate([[7, 7, 7]], sp)[0].out


def test_a_checkpoint_with_a_tokenizer_json_is_served_with_it(ckpt, tmp_path):
    """A --ckpt directory holding a tokenizer.json (as a Hugging Face release does) is served with the
    tokenizer built from it; --tokenizer still wins. Here a byte-level tokenizer.json with no merges: its
    ids are the bytes, its specials the ids it lists."""
    char = tokenizer.bytes_to_unicode()
    specials = {s: 256 + i for i, s in enumerate(tokenizer.CHAT_TOKENS)}
    released = {
        "added_tokens": [{"id": i, "content": s, "special": True} for s, i in specials.items()],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
        "model": {"type": "BPE", "vocab": {char[b]: b for b in range(256)}, "merges": []},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(released))
    tok = serve.load_tokenizer(None, str(tmp_path), 300)
    assert tok.encode("hi!") == [104, 105, 33] and tok.special_tokens == specials
    assert tok.decode(tok.encode("<think>", allowed_special="all")) == "<think>"
    ours = tmp_path / "ours.json"
    ckpt[1].save(ours)
    assert serve.load_tokenizer(str(ours), str(tmp_path), 300).special_tokens == ckpt[1].special_tokens


# -----------------------------------------------------------------------------
# Weight updates: a replica under concurrent requests while its weights are swapped


def versions_split(versions):
    """-> how many tokens carry the old version 0, asserting every later one carries 1 (never a decrease)."""
    n = versions.count(0)
    assert versions == [0] * n + [1] * (len(versions) - n), versions
    return n


def test_weight_update_under_concurrent_requests(ckpt, ckpt_v1, one_thread):
    """Requests stream and wait over a real socket while /update_weights_from_disk swaps the weights: each
    request's tokens carry version 0 up to the swap and 1 after it; its old part is the old model's greedy
    output and its new part the new model's greedy continuation; the prefix cache is empty when the engine
    resumes; a request sent after the swap equals an engine built on the new weights; /health and
    /v1/models report the version."""
    eng = make_engine(ckpt, num_pages=128, max_model_len=200)
    old = make_engine(ckpt)
    new = make_engine(ckpt_v1)
    # the engine pauses once, before the first step that finds the streamed request holding some but not all
    # of its tokens, until the swap: some tokens are old, the rest are new, whatever the machine's speed and
    # the order the requests arrive in (the wait's bound only keeps a broken update from hanging the test)
    n_tokens = 20
    real_step = eng.step
    cached_at_resume = []

    def step():
        streamed = [r for r in eng.running if r.prompt == PROMPTS[0]]
        if not cached_at_resume and streamed and 0 < len(streamed[0].out) < n_tokens:
            deadline = time.time() + 60
            while eng.version == 0 and time.time() < deadline:
                time.sleep(0.01)
            cached_at_resume.append(len(eng.cache.cached))
        return real_step()

    eng.step = step
    srv, stop = serve.make_server(eng, port=0, model_name="tiny")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"

    def body(prompt, **kw):
        return {
            "prompt": prompt,
            "max_tokens": n_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            **kw,
        }

    def check(prompt, ids, versions):
        n = versions_split(versions)
        assert len(ids) == n_tokens
        sp = sampling.SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
        assert ids[:n] == old.generate([prompt], sp)[0].out[:n]
        sp.max_tokens = n_tokens - n
        assert ids[n:] == new.generate([prompt + ids[:n]], sp)[0].out
        return n

    try:
        results = {}

        def complete(i):
            r = requests.post(url + "/v1/completions", json=body(PROMPTS[i]), timeout=120).json()
            results[i] = r["choices"][0]

        threads = [threading.Thread(target=complete, args=(i,)) for i in (1, 2)]
        for t in threads:
            t.start()
        with requests.post(url + "/v1/completions", json=body(PROMPTS[0], stream=True), stream=True) as r:
            lines = r.iter_lines(chunk_size=1)  # each line as it comes, not after 512 bytes
            first = json.loads(next(line for line in lines if line)[6:])["choices"][0]
            update = {"model_path": ckpt_v1[0], "weight_version": 1}
            swap = requests.post(url + "/update_weights_from_disk", json=update, timeout=120)
            rest = [json.loads(line[6:]) for line in lines if line and line != b"data: [DONE]"]
        assert swap.status_code == 200 and swap.json()["weight_version"] == 1, swap.text
        for t in threads:
            t.join()
        chunks = [first] + [c["choices"][0] for c in rest if c["choices"]]
        ids = sum((c["token_ids"] for c in chunks), [])
        versions = sum((c["token_versions"] for c in chunks), [])
        assert 0 < check(PROMPTS[0], ids, versions) < n_tokens  # the stream straddled the swap
        for i in (1, 2):
            check(PROMPTS[i], results[i]["token_ids"], results[i]["token_versions"])
        assert cached_at_resume == [0]
        assert requests.get(url + "/health").json()["weight_version"] == 1
        assert requests.get(url + "/v1/models").json()["data"][0]["weight_version"] == 1
        after = requests.post(url + "/v1/completions", json=body(PROMPTS[3])).json()["choices"][0]
        sp = sampling.SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
        assert after["token_ids"] == new.generate([PROMPTS[3]], sp)[0].out
        assert after["token_versions"] == [1] * n_tokens

    finally:
        stop.set()
        srv.shutdown()


def test_refused_weight_updates_are_json_and_change_nothing(server, server_engine, ckpt, tmp_path):
    """A stale version (409), a missing directory, other shapes, a version that is no integer and unknown
    or missing fields (400) are refused with a JSON error naming the field; the served weights stay bit for
    bit, the version too, and the server answers as before."""
    eng = server_engine
    served = {k: v.clone() for k, v in eng.model.state_dict().items()}
    body = {"prompt": PROMPTS[3], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    first = requests.post(server + "/v1/completions", json=body).json()["choices"][0]["text"]
    other = tmp_path / "other"
    weights.save_pretrained(model.GLM5(tiny_config(vocab_size=280)), other, dtype=torch.float64)
    refusals = [
        ({"model_path": ckpt[0], "weight_version": 0}, 409, "weight_version"),
        ({"model_path": ckpt[0], "weight_version": -1}, 409, "weight_version"),
        ({"model_path": str(tmp_path / "nope"), "weight_version": 2}, 400, "model_path"),
        ({"model_path": str(other), "weight_version": 2}, 400, "model_path"),
        ({"model_path": ckpt[0], "weight_version": "2"}, 400, "weight_version"),
        ({"model_path": ckpt[0], "weight_version": True}, 400, "weight_version"),
        ({"model_path": ckpt[0]}, 400, "weight_version"),
        ({"model_path": ckpt[0], "weight_version": 2, "flush": True}, 400, "flush"),
    ]
    for update, status, param in refusals:
        r = requests.post(server + "/update_weights_from_disk", json=update)
        assert r.status_code == status, (update, r.text)
        assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
    assert all(torch.equal(v, served[k]) for k, v in eng.model.state_dict().items())
    assert requests.get(server + "/health").json()["weight_version"] == 0
    assert requests.post(server + "/v1/completions", json=body).json()["choices"][0]["text"] == first
