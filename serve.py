"""
Serving GLM-5: an OpenAI-compatible HTTP server and a terminal chat over engine.Engine (the paged cache,
continuous batching, sampling and MTP speculative decoding live in engine.py). It serves GLM-5's own chat
format (chat.py: GLM-4.7's template, which the GLM-5 release uses; thinking modes of the GLM-5 report's
post-training, on or off through chat_template_kwargs; tools and tool calls), so a model trained here and
the public release are prompted the same way. Which request fields are taken, refused or ignored, and how
a request becomes a prompt and a reply becomes text, is protocol.py; the routes, streaming, token ids,
weight updates for RL rollouts and errors are described at the handler below.

    python serve.py --ckpt out/ckpt.pt --port 8000       # a train.py checkpoint or a save_pretrained dir
    python serve.py --ckpt out/ckpt.pt --spec 3          # with MTP speculative decoding, 3 drafts per step
    python serve.py --ckpt out/ckpt.pt --compile         # prefill and decode through torch.compile
    python serve.py --ckpt out/ckpt.pt --index_quant int8   # the DSA indexer in int8 (dsa.py)
    python serve.py --ckpt out_sft/ckpt.pt --chat        # terminal chat, thinking shown dimmed
    python serve.py --ckpt /tmp/q/w4a8                   # a W4A8 / W8A8 directory written by quantize.py
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "hi"}]}'
Tests: python -m pytest -q tests/test_serve.py
(Chat with the SFT checkpoint: a pretrained-only one continues text and never learned the chat format.
A --ckpt directory that holds a tokenizer.json, as a Hugging Face release does, is served with it.)

Honest limits: stdlib http.server, one thread per connection and one engine thread; no authentication,
no TLS, no chunked request bodies, n = 1; no constrained decoding (protocol.py says what that refuses).
Prompt logprobs (echo with logprobs) are not computed. A client that half-closes its socket after sending
(shutdown(SHUT_WR)) reads as gone, and its non-streamed request is aborted. Whoever reaches the port
can swap the weights (/update_weights_from_disk reads any directory the server can read; it never
unpickles): keep the server on localhost or a private network.
"""

import argparse
import copy
import json
import os
import queue
import re
import select
import socket
import sys
import threading
import time
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

import chat
from engine import Engine, EngineFull, VersionConflict, load_model
from protocol import (
    FIELDS,
    APIError,
    ChatDeltas,
    check_fields,
    field,
    pending_text,
    prompt_from,
    sampling_from,
    tools_from,
)
from sampling import SamplingParams
from tokenizer import Tokenizer, from_tokenizer_json, get_tokenizer

# -----------------------------------------------------------------------------
# The handler: one thread per connection; the engine runs in its own thread (make_server)
#
#     GET, HEAD  /health, /v1/models, /v1/models/{id}
#     POST       /v1/completions        {"prompt": text or token ids, ...}
#     POST       /v1/chat/completions   {"messages": [...], "tools": [...], "chat_template_kwargs": {...}}
#     POST       /update_weights_from_disk  {"model_path": a save_pretrained directory, "weight_version": N}
#     POST       /flush_cache           no body or {}: forget every cached prefix (SGLang's route)
#
# - "stream": true -> server-sent events ending `data: [DONE]`. A stream's deltas concatenate to exactly the
#   non-streamed reply (text, reasoning_content and content alike): both come from one parser
#   (protocol.ChatDeltas), which holds back a possible start of a stop string and trailing whitespace until
#   the text that follows decides them.
# - "return_token_ids": true -> the prompt's and the completion's token ids (token in, token out: an RL
#   trainer never re-tokenizes text), and "token_versions": the policy version that sampled each token.
# - Weight updates for RL rollouts (the GLM-5 report's asynchronous agentic RL infrastructure: rollout engines
#   keep serving while the trainer pushes weights): POST /update_weights_from_disk, the route and field names
#   of SGLang's, which RL frameworks built on SGLang (AReaL among them) call, takes a directory that
#   weights.save_pretrained wrote and a weight_version above the current one (409 otherwise; 400 for a missing
#   directory or other shapes, the served weights untouched). The handler thread reads the tensors while the
#   engine keeps decoding; the swap then happens between two engine steps (engine.Engine.update_weights): the
#   prefix cache is flushed, and requests in flight continue on the new weights with their cache recomputed,
#   each token tagged with the version that sampled it. /health and /v1/models report "weight_version".
# - Tools: OpenAI's "tools" list is written into the prompt as GLM-5's template writes it, the model's
#   <tool_call> blocks come back as "tool_calls" (finish_reason "tool_calls"; streamed whole, one delta per
#   call), and an assistant message with tool_calls (content may be null) followed by "tool" messages
#   continues the conversation.
# - Errors, from any layer (a bad field, a wrong method, a malformed request line, too many headers), are JSON
#   {"error": {message, type, param, code}} with the HTTP status that fits (400, 404, 405 with Allow, 411,
#   413, 414, 431, 501, 503). A client that hangs up mid-request is noticed at the next engine step: its
#   request leaves the engine, streaming or not.

GET_ROUTES = ("/health", "/v1/models")
WEIGHTS_ROUTE = "/update_weights_from_disk"
FLUSH_ROUTE = "/flush_cache"
ROUTES = (
    "/health, /v1/models, /v1/models/{id}, /v1/completions, /v1/chat/completions, "
    "/update_weights_from_disk and /flush_cache"
)


def allowed_methods(path):
    """The methods a path answers ("GET, HEAD" or "POST"), or None for a path that is no route."""
    if path in GET_ROUTES or path.startswith("/v1/models/"):
        return "GET, HEAD"
    if path in FIELDS or path in (WEIGHTS_ROUTE, FLUSH_ROUTE):
        return "POST"
    return None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "nanoGLM"

    def log_message(self, fmt, *args):  # quiet; errors are reported to the client
        pass

    def handle_one_request(self):
        try:
            super().handle_one_request()
        except ConnectionError:  # the client left before its answer was written: nothing to tell it
            self.close_connection = True

    # --- errors: every one a JSON object, whichever layer finds it ---------------------

    def send_json(self, status, obj, headers=()):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in dict(headers).items():
            self.send_header(name, value)
        if self.close_connection:  # say so: a client that reuses the connection would find it closed
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_error_json(self, e):
        if e.status == 404:
            kind = "not_found_error"
        elif e.status == 503:
            kind = "server_overloaded"
        elif e.status < 500:
            kind = "invalid_request_error"
        else:
            kind = "server_error"
        error = {"message": e.message, "type": kind, "param": e.param, "code": e.code}
        self.send_json(e.status, {"error": error}, e.headers)

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors, found before a route is chosen (a malformed request line, more than
        100 headers, a request line over 64 KB, an unknown method), as JSON with a status line."""
        self.close_connection = True  # the rest of the request was never read
        if self.request_version == "HTTP/0.9":  # unparsed: http.server would write no status line
            self.request_version = self.protocol_version
        if code == 414:
            message = "the request line is longer than 65536 bytes"
        text = message or HTTPStatus(code).phrase
        if explain:
            text += f" ({explain})"
        codes = {400: "invalid_request", 414: "request_line_too_long", 431: "headers_too_large"}
        self.send_error_json(APIError(code, text, code=codes.get(code, "invalid_request")))

    def route(self):
        """-> the request's path without its query string (which no route reads); an APIError when this
        method is not one the path answers: 404 for no such route, 405 with Allow for a known one."""
        path = urllib.parse.urlsplit(self.path).path
        allow = allowed_methods(path)
        if allow is None:
            raise APIError(404, f"no route {self.command} {path}; the routes are {ROUTES}", code="not_found")
        if self.command not in allow:
            message = f"{path} does not take {self.command}; it takes {allow}"
            raise APIError(405, message, code="method_not_allowed", headers={"Allow": allow})
        return path

    def answer(self, handle):
        """Run handle(path) and send any APIError it raises as JSON; a request body that was not read
        ends the connection (its bytes would be read as the next request)."""
        has_body = (
            self.headers.get("Content-Length", "0").strip() != "0" or "Transfer-Encoding" in self.headers
        )
        self.body_read = not has_body
        if self.command != "POST" and has_body:
            self.close_connection = True
        try:
            handle(self.route())
        except APIError as e:
            if not self.body_read:
                self.close_connection = True
            self.send_error_json(e)
        except ConnectionError:  # the client left: handle_one_request ends the connection quietly
            raise
        except Exception as e:  # a bug here must still answer, and never take the server down
            self.close_connection = True
            error = APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")
            self.send_error_json(error)

    def do_GET(self):
        self.answer(self.handle_get)

    def do_HEAD(self):  # GET's answer without its body (send_json leaves it out)
        self.answer(self.handle_get)

    def do_POST(self):
        self.answer(self.handle_post)

    def do_other(self):  # 405 (with Allow) on a route, else 404; route() raises either
        self.answer(lambda path: None)

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = do_other

    # --- GET: health and the model card -------------------------------------------------

    def handle_get(self, path):
        s = self.server
        if path == "/health":
            health = {
                "status": "ok",
                "running": len(s.engine.running),
                "waiting": len(s.engine.waiting),
                "weight_version": s.engine.version,
            }
            return self.send_json(200, health)
        card = {
            "id": s.model_name,
            "object": "model",
            "created": s.created,
            "owned_by": "nanoglm",
            "max_model_len": s.engine.max_model_len,
            "weight_version": s.engine.version,
        }
        if path == "/v1/models":
            return self.send_json(200, {"object": "list", "data": [card]})
        model = urllib.parse.unquote(path[len("/v1/models/") :])  # an id may hold slashes: the --ckpt path
        if model != s.model_name:
            message = f"model '{model}' does not exist; this server serves '{s.model_name}'"
            raise APIError(404, message, "model", "model_not_found")
        self.send_json(200, card)

    # --- POST: a completion or a chat completion ------------------------------------------

    def read_body(self):
        """-> the request's JSON object, or an APIError saying what is wrong with it."""
        length = self.headers.get("Content-Length")
        if length is None:
            message = "a Content-Length header is required (chunked request bodies are not supported)"
            raise APIError(411, message, code="invalid_request")
        if not re.fullmatch(r"[0-9]+", length.strip()):
            message = f"malformed Content-Length {length[:40]!r}: it must be a non-negative integer"
            raise APIError(400, message, code="invalid_request")
        n = int(length)
        if n > self.server.max_body:
            message = f"request body of {n} bytes exceeds the limit of {self.server.max_body}"
            raise APIError(413, message, code="request_too_large")
        raw = self.rfile.read(n)
        self.body_read = True
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise APIError(400, f"the body is not valid JSON ({e})", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        return body

    def handle_post(self, path):
        s = self.server
        if path == FLUSH_ROUTE:
            return self.flush_cache()
        body = self.read_body()
        if path == WEIGHTS_ROUTE:
            return self.update_weights(body)
        check_fields(body, path)
        if body.get("model") not in (None, s.model_name):
            message = f"model '{body['model']}' does not exist; this server serves '{s.model_name}'"
            raise APIError(404, message, "model", "model_not_found")
        eng, tok = s.engine, s.engine.tok
        sp = sampling_from(body, path, eng.default_max_tokens)
        stream = field(body, "stream", (bool,), False, need="a boolean")
        opts = field(
            body,
            "stream_options",
            (dict,),
            {},
            lambda v: set(v) <= {"include_usage"} and isinstance(v.get("include_usage", False), bool),
            "an object with a boolean include_usage",
        )
        want_ids = field(body, "return_token_ids", (bool,), False, need="a boolean")
        echo = field(body, "echo", (bool,), False, need="a boolean")
        if echo and sp.logprobs is not None:
            message = "'echo' with 'logprobs' is not supported (prompt logprobs are not computed); drop one"
            raise APIError(400, message, "echo", "unsupported")
        tools = None if path == "/v1/completions" else tools_from(body)
        prompt = prompt_from(body, path, tok, tools)
        sp.max_tokens = min(sp.max_tokens, eng.max_model_len - len(prompt))
        try:
            r = eng.submit(prompt, sp)
        except EngineFull as e:
            raise APIError(503, str(e), code="server_full") from None
        except ValueError as e:
            code = "context_length_exceeded" if "context" in str(e) else "invalid_value"
            raise APIError(400, str(e), "prompt" if path == "/v1/completions" else "messages", code) from None
        r.echo = tok.decode(prompt) if echo else ""  # completions: the prompt's text before the completion's
        r.tools = tools  # chat: their schemas say which tool-call argument values stay strings
        r.include_usage = opts.get("include_usage", False)  # streaming: a last chunk with usage, no choices
        try:
            if stream:
                self.stream(r, path, want_ids)
            else:
                self.respond(r, path, want_ids)
        finally:
            if r.finish is None:  # the client is gone: its request leaves the engine at the next step
                r.aborted = True

    def flush_cache(self):
        """POST /flush_cache (SGLang's route; vLLM's is /reset_prefix_cache), with no body or {}: forget every
        cached prefix, as a benchmark does between two runs on the same replicas."""
        has_body = self.headers.get("Content-Length", "0").strip() != "0"
        body = self.read_body() if has_body else {}
        if body:
            message = "/flush_cache takes no fields; send {} or no body"
            raise APIError(400, message, sorted(body)[0], "unknown_field")
        return self.send_json(200, {"status": "ok", "flushed_pages": self.server.engine.flush_prefix_cache()})

    def update_weights(self, body):
        """Load a new policy version (see the handler's comment: SGLang's route and field names). This thread
        reads the tensors; the engine swaps them in between two of its steps."""
        for name in sorted(set(body) - {"model_path", "weight_version"}):
            message = f"unknown field '{name}' ({WEIGHTS_ROUTE} takes model_path and weight_version)"
            raise APIError(400, message, name, "unknown_field")
        path = field(body, "model_path", (str,), None, need="a directory written by save_pretrained")
        version = field(body, "weight_version", (int,), None, need="an integer")
        for name, value in (("model_path", path), ("weight_version", version)):
            if value is None:
                raise APIError(400, f"'{name}' is required", name, "missing_field")
        eng = self.server.engine
        try:
            continued = eng.update_weights(path, version)
        except VersionConflict as e:
            raise APIError(409, str(e), "weight_version", "stale_version") from None
        except ValueError as e:
            raise APIError(400, str(e), "model_path", "invalid_checkpoint") from None
        answer = {
            "success": True,
            "message": f"serving {path} as weight_version {version}",
            "weight_version": version,
            "num_continued_requests": continued,
        }
        self.send_json(200, answer)

    # --- responses ------------------------------------------------------------------------

    def header(self, r, path):
        if path == "/v1/completions":
            id_prefix, kind = "cmpl", "text_completion"
        else:
            id_prefix, kind = "chatcmpl", "chat.completion"
        return {
            "id": f"{id_prefix}-{r.id}",
            "object": kind,
            "created": int(time.time()),
            "model": self.server.model_name,
        }

    def logprobs_obj(self, r, path, lo, hi):
        if r.sp.logprobs is None:
            return None
        tok = self.server.engine.tok

        def name(t):
            return tok.decode([t])

        tops = r.top[lo:hi] if r.top else [[] for _ in range(lo, hi)]
        if path == "/v1/completions":
            return {
                "tokens": [name(t) for t in r.out[lo:hi]],
                "token_logprobs": r.logprobs[lo:hi],
                "top_logprobs": [{name(t): v for t, v in top} for top in tops] if r.sp.logprobs else None,
            }

        def entry(t, lp):  # bytes: the token's own, so the parts of a split UTF-8 character add up
            return {"token": name(t), "logprob": lp, "bytes": list(tok.enc.decode_single_token_bytes(t))}

        content = []
        for t, lp, top in zip(r.out[lo:hi], r.logprobs[lo:hi], tops):
            content.append({**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]})
        return {"content": content}

    def usage(self, r):
        return {
            "prompt_tokens": len(r.prompt),
            "completion_tokens": len(r.out),
            "total_tokens": len(r.tokens),
            "prompt_tokens_details": {"cached_tokens": r.n_cached},
        }

    def client_gone(self):
        """True once the client has closed its connection: the socket reads as ready with nothing to read
        (a pipelined next request is data, not an end, and stays unread)."""
        ready, _, _ = select.select([self.connection], [], [], 0)
        if not ready:
            return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def next_event(self, r):
        """r's next event, or None once the client has hung up (looked at every 0.1 s while none comes:
        a request still waiting for a place in the batch has no events)."""
        while True:
            try:
                return r.events.get(timeout=0.1)
            except queue.Empty:
                if self.client_gone():
                    return None

    def wait_done(self, r):
        """Block until r is done -> True; -> False as soon as the client has hung up (looked at after every
        engine step of r too), so that an abandoned request leaves the engine within a step or two instead
        of decoding to max_tokens for nobody."""
        while True:
            event = self.next_event(r)
            if event is None or self.client_gone():
                return False
            if event[0] == "done":
                return True

    def respond(self, r, path, want_ids):
        if not self.wait_done(r):
            return  # handle_post aborts r
        if r.error:
            raise APIError(500, r.error, code="internal_error")
        choice = {
            "index": 0,
            "finish_reason": r.finish,
            "logprobs": self.logprobs_obj(r, path, 0, len(r.out)),
        }
        if path == "/v1/completions":
            choice["text"] = r.echo + r.text
        else:
            reply = ChatDeltas(self.server.engine.tok, r, r.tools)
            whole = reply.feed(r.out, final=True)
            msg = {"role": "assistant", "content": whole.get("content", "")}
            if whole.get("reasoning_content"):
                msg["reasoning_content"] = whole["reasoning_content"]
            if whole.get("tool_calls"):
                msg["tool_calls"] = [
                    {"id": f"call_{r.id}_{c['index']}", "type": c["type"], "function": c["function"]}
                    for c in whole["tool_calls"]
                ]
                msg["content"] = msg["content"] or None  # OpenAI: null content beside tool calls
                if r.finish == "stop":
                    choice["finish_reason"] = "tool_calls"
            choice["message"] = msg
        out = {**self.header(r, path), "choices": [choice], "usage": self.usage(r)}
        if want_ids:
            out["prompt_token_ids"] = r.prompt
            choice["token_ids"] = r.out
            choice["token_versions"] = r.versions
        self.send_json(200, out)

    def stream(self, r, path, want_ids):
        """Server-sent events: one chunk per engine step with something new for the client, the final
        chunk, usage, [DONE]. A step that adds nothing a client sees (a tool call still being written, text
        held back) sends no chunk; its ids and logprobs go out with the next one."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        head = self.header(r, path)
        completion = path == "/v1/completions"
        if not completion:
            head["object"] = "chat.completion.chunk"
        reply = None if completion else ChatDeltas(self.server.engine.tok, r, r.tools)
        sent_tokens = 0  # ids (and their logprobs) sent
        fed = 0  # ids fed to the chat parser
        sent_chars = 0
        done = False
        while not done:
            first = self.next_event(r)  # (kind, len(r.out) when it was recorded)
            if first is None:
                return  # the client left while r waited; handle_post aborts it
            events = [first]
            while not r.events.empty():
                events.append(r.events.get())
            done = any(kind == "done" for kind, _ in events)
            hi = events[-1][1]
            choice = {
                "index": 0,
                "finish_reason": None,
                "logprobs": self.logprobs_obj(r, path, sent_tokens, hi),
            }
            if completion:
                text, sent_chars = pending_text(r, sent_chars)
                choice["text"] = (r.echo if sent_tokens == 0 else "") + text
            else:
                delta = {"role": "assistant"} if sent_tokens == 0 else {}
                delta.update(reply.feed(r.out[fed:hi], final=done))
                fed = hi
                for call in delta.get("tool_calls", []):  # each call whole, once, as in the whole reply
                    call["id"] = f"call_{r.id}_{call['index']}"
                choice["delta"] = delta
            if done:
                tool_calls = reply is not None and reply.calls and r.finish == "stop"
                choice["finish_reason"] = "tool_calls" if tool_calls else r.finish
            if want_ids:
                choice["token_ids"] = r.out[sent_tokens:hi]
                choice["token_versions"] = r.versions[sent_tokens:hi]
                if sent_tokens == 0:
                    choice["prompt_token_ids"] = r.prompt
            seen = choice.get("text") or choice.get("delta") or choice["logprobs"] or want_ids
            if not seen and not done:
                continue
            sent_tokens = hi
            self.send_event({**head, "choices": [choice]})
        if r.error:
            error = {"message": r.error, "type": "server_error", "param": None, "code": "internal_error"}
            self.send_event({"error": error})
        if r.include_usage:
            self.send_event({**head, "choices": [], "usage": self.usage(r)})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def send_event(self, obj):
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()


def make_server(engine, host="127.0.0.1", port=8000, model_name="nanoglm", max_body=1 << 20):
    """-> (server, stop): the HTTP server (call serve_forever) with the engine thread already running."""
    srv = ThreadingHTTPServer((host, port), Handler)
    srv.daemon_threads = True
    srv.engine = engine
    srv.model_name = model_name
    srv.max_body = max_body
    srv.created = int(time.time())
    stop = threading.Event()
    threading.Thread(target=engine.loop, args=(stop,), daemon=True).start()
    return srv, stop


# -----------------------------------------------------------------------------
# The terminal chat: the engine driven from this thread, one turn at a time


def terminal(engine, sp, thinking):
    """`python serve.py --ckpt DIR --chat`: read a line, stream the engine's reply (thinking dimmed), keep
    the conversation (thinking dropped from earlier turns, as chat.render does); /think toggles thinking
    (the report's turn-level thinking), /reset clears the conversation."""
    tok = engine.tok
    msgs = []
    print("nanoGLM chat: empty line or Ctrl-D quits, /think toggles thinking, /reset clears the conversation")
    while True:
        try:
            line = input("\n> ").strip()
        except EOFError:
            line = ""
        if not line:
            return
        if line == "/think":
            thinking = not thinking
            print(f"(thinking {'on' if thinking else 'off'})")
            continue
        if line == "/reset":
            msgs = []
            print("(cleared)")
            continue
        msgs.append({"role": "user", "content": line, "thinking": thinking})
        r = engine.submit(chat.render(msgs, tok, add_generation_prompt=True)[0], copy.copy(sp))
        reply = ChatDeltas(tok, r)
        shown = 0
        while shown < len(r.out) or r.finish is None:
            if r.finish is None:
                engine.step()
            for t in r.out[shown:]:  # one id at a time, so thinking and content never share a delta
                shown += 1
                show_delta(reply.feed([t], final=shown == len(r.out) and r.finish is not None))
        print("\033[0m")
        msgs.append(chat.parse_reply(r.out, tok, thinking=thinking))


def show_delta(d):
    """One delta on the terminal: the reasoning dimmed, then the content, then any tool call."""
    text = ""
    if d.get("reasoning_content"):
        text += "\033[2m" + d["reasoning_content"] + "\033[0m"
    text += d.get("content", "")
    for c in d.get("tool_calls", []):
        text += f"\n[tool call] {c['function']['name']} {c['function']['arguments']}"
    print(text, end="", flush=True)


# -----------------------------------------------------------------------------
# CLI: the server, or the terminal chat


def load_tokenizer(path, ckpt, vocab_size):
    """--tokenizer if given; else the checkpoint directory's tokenizer.json (a Hugging Face release's,
    read by tokenizer.from_tokenizer_json); else the project's own BPE with the model's vocab_size."""
    if path:
        return Tokenizer.load(path)
    released = os.path.join(ckpt, "tokenizer.json")
    if os.path.isdir(ckpt) and os.path.isfile(released):
        return from_tokenizer_json(released)
    return get_tokenizer(vocab_size)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Serve a nanoGLM checkpoint (OpenAI-compatible API) or chat with it."
    )
    arg = ap.add_argument
    arg(
        "--ckpt",
        required=True,
        help="train.py's ckpt.pt, a save_pretrained directory or a quantize.py (W4A8 / W8A8) directory",
    )
    arg(
        "--tokenizer",
        default=None,
        help="a tokenizer saved by tokenizer.py (default: --ckpt's tokenizer.json if it has one, "
        "else data/tokenizer_<vocab_size>.json)",
    )
    arg("--host", default="127.0.0.1")
    arg("--port", type=int, default=8000)
    arg("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    arg(
        "--num_pages",
        type=int,
        default=2048,
        help="cache pages (memory = pages x page_size x layers x 704 values)",
    )
    arg("--page_size", type=int, default=16)
    arg("--max_batch", type=int, default=32)
    arg("--max_model_len", type=int)
    arg("--default_max_tokens", type=int, default=1024, help="a chat request's max_tokens when it sets none")
    arg("--spec", type=int, default=0, help="MTP speculative decoding: draft this many tokens (0: off)")
    arg("--no_prefix_cache", action="store_true")
    arg(
        "--index_quant",
        choices=["none", "int8"],
        default=None,
        help="int8: the DSA indexer scores int8 q and k and the cache keeps its keys in int8 (dsa.py); "
        "default: the checkpoint's setting (float)",
    )
    arg(
        "--compile",
        action="store_true",
        help="run the decode step (batches padded to powers of two) and the prefill forward through "
        "torch.compile (engine.py)",
    )
    arg(
        "--weight_version",
        type=int,
        default=0,
        help="the policy version of --ckpt (an RL run restarting a replica passes its current step)",
    )
    arg(
        "--served_model_name",
        default=None,
        help="the model id clients send (default: the --ckpt path, as vLLM)",
    )
    arg("--chat", action="store_true", help="a terminal chat instead of the server")
    arg("--temperature", type=float, default=0.7, help="--chat's sampling temperature")
    arg("--no_thinking", action="store_true", help="--chat starts with thinking off")
    a = ap.parse_args(argv)
    try:
        m = load_model(a.ckpt, device=a.device)
        tok = load_tokenizer(a.tokenizer, a.ckpt, m.config.vocab_size)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        sys.exit(f"serve.py: {e}")
    if a.index_quant:
        m.config.index_quant = a.index_quant  # before the Engine, whose cache takes its layout from it
    eng = Engine(
        m,
        tok,
        num_pages=a.num_pages,
        page_size=a.page_size,
        max_batch=a.max_batch,
        max_model_len=a.max_model_len,
        spec_tokens=a.spec,
        prefix_cache=not a.no_prefix_cache,
        default_max_tokens=a.default_max_tokens,
        version=a.weight_version,
        compile=a.compile,
    )
    if a.compile:  # every graph built before the first request, so none waits for a compile
        print("compiling the prefill and decode graphs (engine.warm_up) ...", flush=True)
        print(f"compiled in {eng.warm_up():.0f}s", flush=True)
    if a.chat:
        return terminal(eng, SamplingParams(max_tokens=512, temperature=a.temperature), not a.no_thinking)
    srv, stop = make_server(eng, a.host, a.port, a.served_model_name or a.ckpt)
    print(
        f"serving {a.ckpt} on http://{a.host}:{a.port} (pages {a.num_pages} x {a.page_size}, spec {a.spec})"
    )
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        stop.set()


if __name__ == "__main__":
    main()
