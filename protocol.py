"""
The OpenAI API as this server reads and writes it (vLLM keeps the same in its OpenAI entrypoint's
protocol.py): the request fields each route takes and how each is checked, how a request becomes a prompt
(a completion's text or ids; a chat's messages and tools, rendered by chat.py in GLM-5's format) and the
engine's SamplingParams, and how a reply's ids become the text a client sees, streamed or whole. serve.py
is the HTTP server around it. The fields taken, ignored and refused are listed at the request section;
streamed or whole, a reply reads the same (the reply section says how).

Run it through serve.py: python serve.py --ckpt out/ckpt.pt
Tests: python -m pytest -q tests/test_serve.py (over a real socket)
Honest limits: nothing forces a tool call or a JSON reply (no constrained decoding), so tool_choice
"required" or a named function and response_format are refused; parallel_tool_calls is accepted but not
enforced (a model may still call several tools); tool_choice "none" hides the tools from the model rather
than showing them and forbidding calls. Only text content: image and audio parts are refused.
"""

import json

import chat
from sampling import SamplingParams

# -----------------------------------------------------------------------------
# Request bodies: the fields each route accepts, each checked with an error that names it
#
# Request fields. Both routes: model, max_tokens, temperature, top_p, top_k, seed, stop, stream,
# stream_options.include_usage, n (1 only), presence_penalty, frequency_penalty (in [-2, 2]),
# return_token_ids, ignore_eos. Completions: prompt, logprobs (0..20), echo (not with logprobs). Chat:
# messages (content a string or a list of text parts; roles system, developer, user, assistant, tool),
# logprobs, top_logprobs, max_completion_tokens, chat_template_kwargs (enable_thinking, preserve_thinking),
# tools, tool_choice ("auto" or "none": then no tools are shown), parallel_tool_calls (accepted, not
# enforced). Ignored: user, metadata, store, service_tier, prompt_cache_key, safety_identifier, and
# response_format {"type": "text"} (the default). Refused by name as not supported: logit_bias,
# response_format (any other), functions, function_call, best_of, suffix, audio, modalities, prediction,
# reasoning_effort, verbosity, web_search_options, tool_choice "required" or a named function; any other field
# is an unknown field. A temperature below 1e-5 is greedy, as in vLLM.
#
# Every check raises an APIError with one sentence naming the field and what it must be; serve.py sends it as
# {"error": {message, type, param, code}}.


class APIError(Exception):
    def __init__(self, status, message, param=None, code=None, headers=None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "return_token_ids",
    "ignore_eos",
}
FIELDS = {
    "/v1/completions": COMMON | {"prompt", "logprobs", "echo"},
    "/v1/chat/completions": COMMON
    | {
        "messages",
        "logprobs",
        "top_logprobs",
        "max_completion_tokens",
        "chat_template_kwargs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    },
}
# OpenAI fields that change nothing in what a model generates: accepted and ignored
IGNORED = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
# OpenAI fields this server does not implement: refused by name rather than silently ignored
UNSUPPORTED = {
    "logit_bias": "",
    "response_format": " (no structured output; ask for JSON in the prompt)",
    "functions": " (the deprecated form; send 'tools')",
    "function_call": " (the deprecated form; send 'tool_choice')",
    "best_of": "",
    "suffix": "",
    "audio": "",
    "modalities": " (text only)",
    "prediction": "",
    "reasoning_effort": ' (switch thinking off with "chat_template_kwargs": {"enable_thinking": false})',
    "verbosity": "",
    "web_search_options": "",
}


def field(body, name, kinds, default, ok=lambda v: True, need="valid"):
    """body[name] checked against types and a predicate, or a 400 naming the field."""
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds) or not ok(v):
        raise APIError(400, f"'{name}' must be {need}, got {json.dumps(v)[:60]}", name, "invalid_value")
    return v


def check_fields(body, path):
    """A 400 for the first field this route does not take: unsupported (an OpenAI field we do not
    implement) or unknown (a typo, or another API's field). response_format {"type": "text"} is OpenAI's
    default, plain text, which is what this server writes: some clients send it on every request."""
    for name in sorted(set(body) - FIELDS[path] - IGNORED):
        if name == "response_format" and body[name] == {"type": "text"}:
            continue
        if name in UNSUPPORTED and body[name] is not None:
            message = f"'{name}' is not supported by this server{UNSUPPORTED[name]}"
            raise APIError(400, message, name, "unsupported")
        if name not in UNSUPPORTED:
            accepted = ", ".join(sorted(FIELDS[path] | IGNORED))
            message = f"unknown field '{name}' (this server accepts: {accepted})"
            raise APIError(400, message, name, "unknown_field")


def sampling_from(body, path, chat_default):
    num = (int, float)
    integer = (int,)
    at_least_1 = (lambda v: v >= 1, "an integer >= 1")
    penalty = (lambda v: -2 <= v <= 2, "a number in [-2, 2]")
    default_max = 16 if path == "/v1/completions" else chat_default
    # both are checked, though max_completion_tokens (OpenAI's newer name) wins when both are given
    max_tokens = field(body, "max_tokens", integer, default_max, *at_least_1)
    max_completion_tokens = field(body, "max_completion_tokens", integer, None, *at_least_1)
    sp = SamplingParams(
        max_tokens=max_completion_tokens or max_tokens,
        temperature=float(
            field(body, "temperature", num, 1.0, lambda v: 0 <= v <= 100, "a number in [0, 100] (0: greedy)")
        ),
        top_p=float(field(body, "top_p", num, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")),
        top_k=field(body, "top_k", integer, 0, lambda v: v >= -1, "an integer >= -1 (-1 or 0: off)"),
        seed=field(body, "seed", integer, None, lambda v: 0 <= v < 2**63, "an integer in [0, 2**63)"),
        ignore_eos=field(body, "ignore_eos", (bool,), False, need="a boolean"),
        presence_penalty=float(field(body, "presence_penalty", num, 0.0, *penalty)),
        frequency_penalty=float(field(body, "frequency_penalty", num, 0.0, *penalty)),
    )
    sp.top_k = max(sp.top_k, 0)
    if sp.temperature < 1e-5:  # as vLLM: a temperature this small is greedy (and 1/T would overflow)
        sp.temperature = 0.0
    stop = field(
        body,
        "stop",
        (str, list),
        [],
        lambda v: isinstance(v, str) or all(isinstance(s, str) and s for s in v),
        "a string or a list of non-empty strings",
    )
    sp.stop = [stop] if isinstance(stop, str) else list(stop)
    logprobs_n = (lambda v: 0 <= v <= 20, "an integer in [0, 20]")
    if path == "/v1/completions":
        sp.logprobs = field(body, "logprobs", integer, None, *logprobs_n)
    elif field(body, "logprobs", (bool,), False, need="a boolean"):
        sp.logprobs = field(body, "top_logprobs", integer, 0, *logprobs_n)
    elif body.get("top_logprobs") is not None:
        raise APIError(400, "'top_logprobs' needs \"logprobs\": true", "top_logprobs", "invalid_value")
    field(body, "n", integer, 1, lambda v: v == 1, "1 (one choice per request)")
    return sp


# -----------------------------------------------------------------------------
# Prompts: a completion's text or ids, or a chat's messages and tools through chat.render


def prompt_from(body, path, tok, tools):
    """-> the prompt's token ids: a completion's text or ids, or a chat's messages rendered with its tools."""
    if path == "/v1/completions":
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str) and p:
            return tok.encode(p)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        raise APIError(
            400,
            "'prompt' must be a non-empty string or a non-empty list of token ids",
            "prompt",
            "invalid_value",
        )
    msgs = messages_from(body)
    kw = field(
        body,
        "chat_template_kwargs",
        (dict,),
        {},
        lambda v: (
            set(v) <= {"enable_thinking", "preserve_thinking"}
            and all(isinstance(x, bool) for x in v.values())
        ),
        "an object with boolean enable_thinking / preserve_thinking",
    )
    try:
        prompt, _ = chat.render(msgs, tok, add_generation_prompt=True, tools=tools, **kw)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise APIError(400, f"invalid 'messages': {e}", "messages", "invalid_value") from None
    return prompt


def messages_from(body):
    """The request's messages for chat.render, which checks them (roles, order, tool_calls, "tool" results
    with their tool_call_id) and joins content given as text parts as the template does. Here: a content
    part of another type (an image, audio) is refused by name, and the "developer" role is the system's."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        message = "'messages' must be a non-empty list of {role, content} objects"
        raise APIError(400, message, "messages", "invalid_value")
    out = []
    for i, m in enumerate(msgs):
        if isinstance(m, dict) and m.get("role") == "developer":
            m = {**m, "role": "system"}  # OpenAI's newer name for the system role
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            kinds = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content]
            other = [k for k in kinds if k != "text"]
            if other:
                message = f"message {i} has a content part of type {other[0]!r}; this server takes only text"
                raise APIError(400, message, "messages", "unsupported")
        out.append(m)
    return out


def tools_from(body):
    """The request's function tools for chat.render, or None. tool_choice "auto" (the default) and "none"
    (no tools shown to the model) are accepted; "required" and a named function are refused, since nothing
    forces the model to call a tool. parallel_tool_calls is accepted and not enforced."""
    choice = field(body, "tool_choice", (str, dict), "auto")
    if choice not in ("auto", "none"):
        message = (
            f"'tool_choice' {json.dumps(choice)[:60]} is not supported (nothing forces the model to call a "
            "tool); use \"auto\" or \"none\""
        )
        raise APIError(400, message, "tool_choice", "unsupported")
    field(body, "parallel_tool_calls", (bool,), True, need="a boolean")
    tools = field(body, "tools", (list,), [])
    for t in tools:
        if not is_function_tool(t):
            shape = '{"type": "function", "function": {"name", "description"?, "parameters"?: a JSON schema}}'
            message = f"'tools' must be a list of {shape}, got {json.dumps(t)[:80]}"
            raise APIError(400, message, "tools", "invalid_value")
    if choice == "none" or not tools:
        return None
    return tools


def is_function_tool(t):
    """OpenAI's {"type": "function", "function": {name, description?, parameters?}}, with a usable
    schema: chat.ReplyStream reads each property's "type" to keep string arguments strings."""
    f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
    if (
        not isinstance(f, dict)
        or not isinstance(f.get("name"), str)
        or not chat.TOOL_NAME.fullmatch(f["name"])
    ):
        return False
    params = f.get("parameters")
    if params is None:
        params = {}
    props = params.get("properties") if isinstance(params, dict) else []
    if props is None:
        props = {}
    return (
        isinstance(f.get("description") or "", str)
        and isinstance(props, dict)
        and all(isinstance(p, dict) for p in props.values())
    )


# -----------------------------------------------------------------------------
# Replies as text: what a stream sends is exactly what the whole reply holds
#
# Streamed or whole, a reply reads the same: a chat reply's ids go through ChatDeltas (chat.ReplyStream, which
# splits reasoning, content and tool calls by token id and strips the text as the template does, plus the stop
# strings), fed step by step for a stream and all at once for the whole reply; a completion's text is the
# engine's, cut at a stop string, and pending_text streams it. Both hold back what could still turn out to be
# the start of a stop string, so the deltas concatenate to exactly the whole reply (OpenAI's rule).


def pending_text(r, sent):
    """-> (text of r not yet streamed, the new count of characters sent), holding back a partial UTF-8
    character or a possible start of a stop string while r runs."""
    finished = r.finish is not None
    text = r.text  # read after finish: a finished request's text is final
    end = len(text)
    if not finished:
        while end > sent and text[end - 1] == "\ufffd":
            end -= 1
        end = held_back(text, sent, end, r.sp.stop)
    return text[sent:end], max(sent, end)


def held_back(text, sent, end, stops):
    """-> where text[:end] may end for now: before the longest unsent tail that could begin a stop
    string (a shorter one inside it could not: any stop found later starts at or after that point)."""
    longest = max((len(s) for s in stops), default=1)
    for p in range(max(sent, end - longest + 1), end):
        if any(s.startswith(text[p:end]) for s in stops):
            return p
    return end


class ChatDeltas:
    """A chat reply's ids in, OpenAI deltas out: chat.ReplyStream splits the reasoning, the content and
    the tool calls by token id and strips the text at both ends as the template does (parse_reply is built
    on it); on top, a possible start of a stop string is held back and the text is cut where one appears
    (in the reasoning: no content follows), and the reply ends at its first role token (a stop token).
    The non-streamed reply is this fed all ids at once, so a stream's deltas concatenate to exactly the
    non-streamed message (OpenAI's rule), reasoning and content alike."""

    KEYS = ("reasoning_content", "content")

    def __init__(self, tok, r, tools=None):
        thinking = r.prompt[-1] == tok.special_tokens["<think>"]  # the reply starts inside <think>
        self.split = chat.ReplyStream(tok, r.stop_ids, thinking=thinking, tools=tools)
        self.role_tokens = {i for name, i in tok.special_tokens.items() if name.startswith("<|")}
        self.stops = r.sp.stop
        self.text = {key: "" for key in self.KEYS}  # what ReplyStream has sent (already stripped)
        self.sent = {key: 0 for key in self.KEYS}  # characters of it sent on
        self.calls = 0  # tool calls sent
        self.ended = False  # a stop string or a role token ended the reply: nothing more is sent

    def feed(self, ids, final=False):
        """New ids -> a delta {reasoning_content?, content?, tool_calls?}; final: the reply has ended."""
        if self.ended:
            return {}
        ids = list(ids)
        end = next((k for k, t in enumerate(ids) if t in self.role_tokens), None)
        if end is not None:
            ids = ids[:end]
            final = True
        d = self.split.feed(ids)
        if final:
            last = self.split.close()
            for key in self.KEYS:
                d[key] = d.get(key, "") + last.get(key, "")
            d["tool_calls"] = d.get("tool_calls", []) + last.get("tool_calls", [])
        delta = {}
        for key in self.KEYS:
            self.text[key] += d.get(key, "")
            text = self.text[key]
            cut = min((text.index(s) for s in self.stops if s in text), default=None)
            if cut is not None:
                text = text[:cut].rstrip()
                self.ended = True
            elif not final:
                text = text[: held_back(text, self.sent[key], len(text), self.stops)].rstrip()
            if len(text) > self.sent[key]:
                delta[key] = text[self.sent[key] :]
                self.sent[key] = len(text)
            if self.ended:
                return delta
        if d.get("tool_calls"):
            delta["tool_calls"] = d["tool_calls"]
            self.calls += len(d["tool_calls"])
        self.ended = final
        return delta
