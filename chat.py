"""
GLM-5's chat format: the template with its three thinking modes and tool calls, the loss mask, the reply
parser and the streaming parser (GLM-5 report, arXiv 2602.15763, its post-training sections: SFT with
interleaved, preserved and turn-level thinking; tool results come back as observation turns).

GLM-5 uses GLM-4.7's chat template (the chat_template.jinja published with the weights; SGLang serves both
models with one tool-call detector, glm47_moe_detector.py). render() writes it exactly, its markers special
tokens of our tokenizer (tokenizer.py) as in GLM-5's, with a loss mask True exactly on what the model writes
after the generation prompt; parse_reply() and ReplyStream read generated ids back into an OpenAI message.
The format, the thinking modes and the mask are described at the template section below.

Run it:
    python sft_data.py              # one rendered example per thinking mode, trained spans in ⟦ ⟧
    python serve.py --ckpt out_sft/ckpt.pt --chat   # chat with a trained model, thinking dimmed
Tests: python -m pytest -q tests/test_chat.py
Honest limits: this is GLM-5's (and GLM-4.7's) format, not GLM-4.5/4.6's (newlines after role tokens, tool
arguments on their own lines) nor GLM-5.1's (an empty <think></think> on the last reply, tools written
without their {"type": "function"} envelope). Text in a message that spells a special token is encoded as
text, never as the token (a Hugging Face tokenizer would make it the token: an injection), so render_text()
can look ambiguous where the ids are not; parse_reply() reads ids. Tool results given as a list of
{"output": ...} (the template's other branch) and images are not supported.
"""

import json
import re

# -----------------------------------------------------------------------------
# Messages and tools: check them once, with one clear sentence per mistake

ROLES = ("system", "user", "assistant", "observation")
ROLE_ALIASES = {"tool": "observation"}  # OpenAI's name for a tool result
# An assistant turn ends with the token of whoever speaks next, and the model learns to emit it (GLM's stop
# tokens): <|observation|> after tool calls (the environment runs them), <|user|> after a reply, and
# <|endoftext|> when the conversation ends there. serve.py stops generating on any of the three.
STOP_TOKENS = ("<|observation|>", "<|user|>", "<|endoftext|>")
TOOL_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
ARG_MARKERS = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


def visible_text(content, where):
    """A message's text: a string, or OpenAI's list of text parts [{"type": "text", "text": ...}] joined
    (the template's visible_text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ValueError(
        f"{where} needs a 'content' string (or a list of {{'type': 'text', 'text': ...}} parts)."
    )


def tool_call_args(call, i=0):
    """An OpenAI tool call {"function": {"name", "arguments"}} -> (name, arguments as a dict)."""
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not TOOL_NAME.fullmatch(f["name"]):
        raise ValueError(
            f"message {i} has a tool call that is not {{'function': {{'name': 'a_name', 'arguments': ...}}}}."
        )
    args = f.get("arguments", {})
    if isinstance(args, str) and not args.strip():
        args = {}  # a call with no arguments, as some clients send it back ("" rather than "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            args = None
        if not isinstance(args, dict):
            raise ValueError(f"message {i}: the arguments of tool call {f['name']!r} are not a JSON object.")
    elif not isinstance(args, dict):
        raise ValueError(
            f"message {i}: the arguments of tool call {f['name']!r} must be a dict or a JSON string."
        )
    return f["name"], args


def check_tools(tools):
    """Validate a tool list in OpenAI's request shape; returns it as a list (empty for None)."""
    if tools is None:
        return []
    if not isinstance(tools, (list, tuple)):
        raise ValueError("tools must be a list of {'type': 'function', 'function': {'name': ...}} dicts.")
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ValueError(f"tools[{i}] is not {{'type': 'function', 'function': {{'name': ...}}}}.")
        f = t.get("function")
        if (
            not isinstance(f, dict)
            or not isinstance(f.get("name"), str)
            or not TOOL_NAME.fullmatch(f["name"])
        ):
            raise ValueError(f"tools[{i}] has no valid function name ({{'function': {{'name': 'a_name'}}}}).")
    return list(tools)


def check_messages(messages):
    """Validate a conversation; returns [(role, message)] with aliases resolved and text parts joined.
    Raises ValueError."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts.")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {i} is a {type(m).__name__}, not a dict with 'role' and 'content'.")
        role = ROLE_ALIASES.get(m.get("role"), m.get("role"))
        if role not in ROLES:
            raise ValueError(
                f"message {i} has unknown role {m.get('role')!r}; use system, user, assistant or "
                f"observation (or tool)."
            )
        for key, allowed in (
            ("tool_calls", "assistant"),
            ("reasoning_content", "assistant"),
            ("thinking", "user"),
        ):
            if m.get(key) is not None and role != allowed:
                raise ValueError(
                    f"message {i} ({role}) has {key!r}, which only {allowed} messages may carry."
                )
        if m.get("thinking") is not None and not isinstance(m["thinking"], bool):
            raise ValueError(f"message {i} has 'thinking': {m['thinking']!r}; use True or False.")
        if role != "assistant":
            m = dict(m, content=visible_text(m.get("content"), f"message {i} ({role})"))
        else:
            content = m.get("content")
            if content is not None and not isinstance(content, str):
                raise ValueError(
                    f"message {i} (assistant) has a {type(content).__name__} 'content'; use a string."
                )
            if not isinstance(m.get("reasoning_content") or "", str):
                raise ValueError(f"message {i} (assistant) has a non-string 'reasoning_content'.")
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ValueError(f"message {i} has 'tool_calls' that is not a list.")
            for c in calls:
                tool_call_args(c, i)  # raises on a malformed call
            if not (content or "").strip() and not calls:
                raise ValueError(f"message {i} (assistant) has neither content nor tool_calls.")
        prev = out[-1][0] if out else None
        called = prev == "assistant" and out[-1][1].get("tool_calls")
        if role == "assistant" and prev not in ("user", "observation"):
            raise ValueError(
                f"message {i} (assistant) must follow a user or observation message, not {prev or 'nothing'}."
            )
        if role == "observation" and not (prev == "observation" or called):
            raise ValueError(f"message {i} (observation) must follow an assistant message with tool_calls.")
        if role in ("user", "system") and called:
            raise ValueError(
                f"message {i} ({role}) follows tool calls; their results must come first, as "
                f"observation messages."
            )
        out.append((role, m))
    if not any(r == "user" for r, _ in out):
        raise ValueError("the conversation has no user message.")
    return out


# -----------------------------------------------------------------------------
# The template: pieces of (text, is_special, trained), then text or ids
#
# A conversation with one tool call, its result and the reply (one line in the real thing: no newline follows
# a role token or a tag):
#
#     [gMASK]<sop><|system|>Be brief.<|user|>List the files.<|assistant|><think>I need ls.</think>
#     <tool_call>ls<arg_key>path</arg_key><arg_value>.</arg_value></tool_call><|observation|>
#     <tool_response>a.py
#     b.py</tool_response><|assistant|><think>Two files.</think>a.py and b.py<|endoftext|>
#
# - Every prompt starts with [gMASK]<sop>; a role token (<|system|>, <|user|>, <|assistant|>, <|observation|>)
#   is followed directly by its text. System and user text is written as given, assistant reasoning and
#   content stripped. A system message is written where it stands, mid-conversation too.
# - Tool calls: <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call> right after the
#   content, one after another, no newlines; a string value is written raw, any other value as JSON.
# - Tool results: consecutive ones share one <|observation|>, each wrapped in <tool_response>...
#   </tool_response>, written as given.
# - A tool list (render(tools=...), OpenAI's request shape [{"type": "function", "function": {"name",
#   "description", "parameters"}}]) becomes a system block right after [gMASK]<sop>, before the conversation's
#   own system message, exactly (lines broken here for the page only):
#
#     <|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n
#     You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n
#     {tool 1 as JSON}\n{tool 2 as JSON}\n...</tools>\n\nFor each function call, output the function
#     name and arguments within the following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}
#     </arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}
#     </arg_value>...</tool_call>
#
# Each tool is the whole {"type": "function", ...} object as JSON with ", " and ": " separators and its keys
# in the given order (the template's tojson); the markers in the last line are special tokens, as GLM-5's
# tokenizer makes them.

TOOLS_HEADER = (
    "\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_FOOTER = (
    "</tools>\n\nFor each function call, output the function name and arguments within the following XML "
    "format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
    "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
)
FOOTER_MARKERS = re.compile(
    "(" + "|".join(re.escape(s) for s in ("<tool_call>", "</tool_call>") + ARG_MARKERS) + ")"
)


def tools_pieces(tools):
    """The tool list's system block. The tools' own JSON is text; the template's markers are tokens."""
    text = TOOLS_HEADER + "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tools)
    out = [("<|system|>", True, False), (text, False, False)]
    for j, part in enumerate(FOOTER_MARKERS.split(TOOLS_FOOTER)):
        if part:
            out.append((part, j % 2 == 1, False))  # odd parts are the captured markers
    return out


def tool_call_pieces(call, i, trained):
    """<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>"""
    name, args = tool_call_args(call, i)
    out = [("<tool_call>", True, trained), (name, False, trained)]
    for k, v in args.items():
        value = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        out += [("<arg_key>", True, trained), (k, False, trained), ("</arg_key>", True, trained)]
        out += [("<arg_value>", True, trained), (value, False, trained), ("</arg_value>", True, trained)]
    out.append(("</tool_call>", True, trained))
    return out


def reasoning_and_content(m):
    """The template's split: reasoning_content if given, else what a content string holds before
    </think>."""
    content = m.get("content") or ""
    if m.get("reasoning_content") is not None or "</think>" not in content:
        return (m.get("reasoning_content") or "").strip(), content.strip()
    before, after = content.split("</think>")[0], content.split("</think>")[-1]
    return before.rstrip("\n").split("<think>")[-1].lstrip("\n").strip(), after.lstrip("\n").strip()


# Thinking, in the template's terms:
# - Interleaved thinking: an assistant message after the last user message (each reply, and each tool-calling
#   step after an observation) shows its reasoning as <think>R</think>.
# - Preserved thinking: an assistant message before the last user message shows a bare </think> (its reasoning
#   is dropped), unless preserve_thinking=True (the template's clear_thinking=False, for agentic sessions):
#   then every message keeps its <think>R</think>. A message with no reasoning shows a bare </think> either
#   way.
# - Turn-level thinking: the template has one switch per request (enable_thinking): the generation prompt is
#   <|assistant|><think> with thinking on, <|assistant|></think> with it off. Ours is per user turn: a user
#   message with "thinking": False switches thinking off for its turn, whose assistant messages then show a
#   bare </think> (reasoning_content there is an error) and whose generation prompt is <|assistant|></think>,
#   which is what the template writes for that request with enable_thinking false. enable_thinking is the
#   default for turns that do not say.
#
# Loss mask: True exactly on the tokens the model writes after the generation prompt: its reasoning and
# </think> (thinking on; the <think> is the prompt's), content, tool calls, and the token that ends its turn,
# which is the next message's role token (GLM's stop tokens): <|observation|> after tool calls, <|user|> after
# a reply. The template writes nothing after the last message; a conversation that ends with an assistant
# message ends with <|endoftext|> (one of GLM-5's eos ids), or <|observation|> after tool calls, so the model
# learns to stop. False on everything else, and on a whole message shown with a bare </think> while thinking
# was on (reasoning dropped or never given): that rendering no longer shows what the model wrote, so it is
# context, not a target.
def pieces(messages, tools=None, enable_thinking=True, preserve_thinking=False, add_generation_prompt=False):
    """The conversation as a list of (text, is_special_token, trained) in order, empty texts left out."""
    msgs = check_messages(messages)
    out = [("[gMASK]", True, False), ("<sop>", True, False)]
    out += tools_pieces(check_tools(tools)) if tools else []
    last_user = max(i for i, (r, _) in enumerate(msgs) if r == "user")
    thinking = enable_thinking  # the switch of the current turn; a user message may flip it
    trained = False  # whether the previous assistant message is a target (its stop token is the next header)
    for i, (role, m) in enumerate(msgs):
        after_assistant = i > 0 and msgs[i - 1][0] == "assistant"
        stop_trained = after_assistant and trained
        if role == "user":
            thinking = enable_thinking if m.get("thinking") is None else m["thinking"]
        if role == "observation":
            if msgs[i - 1][0] != "observation":
                out.append(("<|observation|>", True, stop_trained))
            out += [("<tool_response>", True, False), (m["content"], False, False)]
            out.append(("</tool_response>", True, False))
            continue
        if role != "assistant":
            # a system message may come mid-conversation (the template writes it in place), but <|system|>
            # is no stop token: an assistant message followed by one is not taught where it ends
            header_trained = stop_trained and role == "user"
            out += [(f"<|{role}|>", True, header_trained), (m["content"], False, False)]
            continue
        reasoning, content = reasoning_and_content(m)
        if not thinking and reasoning:
            raise ValueError(f"message {i} (assistant) has reasoning_content in a turn with thinking off.")
        out.append(("<|assistant|>", True, False))
        if thinking and reasoning and (i > last_user or preserve_thinking):
            trained = True  # the prompt ends with <think>; the model writes the rest
            out += [("<think>", True, False), (reasoning, False, True), ("</think>", True, True)]
        else:
            # Thinking off: the prompt ends with </think> and the model writes what follows. Thinking on: the
            # reasoning was dropped (or never given), so this no longer shows what the model wrote.
            trained = not thinking
            out.append(("</think>", True, False))
        out.append((content, False, trained))
        for call in m.get("tool_calls") or []:
            out += tool_call_pieces(call, i, trained)
        if i + 1 == len(msgs):
            out.append(("<|observation|>" if m.get("tool_calls") else "<|endoftext|>", True, trained))
    if add_generation_prompt:
        if msgs[-1][0] == "assistant":
            raise ValueError(
                "add_generation_prompt needs a conversation that ends with a user or observation message."
            )
        out += [("<|assistant|>", True, False), ("<think>" if thinking else "</think>", True, False)]
    return [p for p in out if p[0]]


def render_text(messages, **kw):
    """The rendered conversation as one string (display, debugging); same options as render()."""
    return "".join(text for text, _, _ in pieces(messages, **kw))


def render(
    messages,
    tok,
    *,
    tools=None,
    enable_thinking=True,
    preserve_thinking=False,
    add_generation_prompt=False,
):
    """messages -> (ids, mask): token ids and, per token, True where the model is trained to produce it.
    tools: OpenAI's request shape, written into the system block the template writes for them."""
    ps = pieces(
        messages,
        tools=tools,
        enable_thinking=enable_thinking,
        preserve_thinking=preserve_thinking,
        add_generation_prompt=add_generation_prompt,
    )
    ids, mask = [], []
    j = 0
    while j < len(ps):
        text, special, trained = ps[j]
        if special:
            ids.append(tok.encode_chat_token(text))
            mask.append(trained)
            j += 1
            continue
        # Neighbouring text pieces are encoded as one run, as tiktoken would encode the whole string.
        while j + 1 < len(ps) and not ps[j + 1][1]:
            assert ps[j + 1][2] == trained, "a text run must not change its mask midway"
            text += ps[j + 1][0]
            j += 1
        new = tok.encode_ordinary(text)
        ids += new
        mask += [trained] * len(new)
        j += 1
    return ids, mask


# -----------------------------------------------------------------------------
# Reading replies: the stream parser, and parse_reply built on it
#
# parse_reply() reads generated ids back into an OpenAI message; ReplyStream does the same incrementally for
# streaming, and parse_reply is built on it, so the two agree. Both take thinking=True when the prompt ended
# with <think> (the reply then starts inside its think block). A tool-call value becomes JSON when it parses
# as JSON and the tool's schema (tools=) does not say "string"; otherwise it stays text (SGLang's detector
# reads it the same way, using the schema the same way).


class ReplyStream:
    """Generated ids in, text out as it becomes whole characters: feed(ids) -> {"reasoning_content": ...,
    "content": ..., "tool_calls": [...]} (keys present only when they grew), split at <think> / </think> by
    token id, other special tokens and `stop_ids` dropped. Each of reasoning and content is sent stripped, as
    the template writes it back: leading whitespace is dropped and trailing whitespace held until more text
    follows, so the deltas add up to parse_reply's strings exactly. A tool call is held back until its
    </tool_call> (or any other special token, or close()) and then sent whole, with its index, as OpenAI
    streams tool_calls. thinking: the prompt ended with <think>, so the reply starts inside its think block.
    tools: the request's tool list, whose schemas say which argument values stay strings."""

    def __init__(self, tok, stop_ids=(), thinking=False, tools=None):
        self.tok = tok
        s = tok.special_tokens
        self.specials = set(s.values()) | set(stop_ids)
        self.marker = {s[name]: name for name in ("<think>", "</think>", "<tool_call>", "</tool_call>")}
        self.marker.update({s[name]: name for name in ARG_MARKERS})
        self.types = {}  # tool name -> {argument: JSON schema type}
        for t in check_tools(tools):
            props = (t["function"].get("parameters") or {}).get("properties") or {}
            self.types[t["function"]["name"]] = {k: p.get("type") for k, p in props.items()}
        self.section = "reasoning_content" if thinking else "content"
        self.text = {"reasoning_content": "", "content": ""}  # decoded text of closed runs
        self.sent = {"reasoning_content": 0, "content": 0}  # characters of the stripped text already sent
        self.buf = []  # ids of the open text run
        self.call = None  # ids inside an open <tool_call>, argument markers included
        self.calls = 0  # tool calls sent so far

    def feed(self, ids):
        delta = {}
        for t in ids:
            if self.call is not None:
                if t not in self.specials or self.marker.get(t) in ARG_MARKERS:
                    self.call.append(t)
                    continue
                delta.setdefault("tool_calls", []).append(self.finish_call())
                if self.marker.get(t) == "</tool_call>":
                    continue
            if t not in self.specials:
                self.buf.append(t)
                continue
            self.text[self.section] += self.tok.decode(self.buf)
            self.buf = []
            name = self.marker.get(t)
            if name == "<think>":
                self.section = "reasoning_content"
            elif name == "</think>":
                self.section = "content"
            elif name == "<tool_call>":
                self.call = []
        self.send(delta, closing=False)
        return delta

    def close(self):
        """The end of the reply: a call left open and a partial character are sent as they are."""
        delta = {"tool_calls": [self.finish_call()]} if self.call is not None else {}
        self.send(delta, closing=True)
        return delta

    def send(self, delta, closing):
        for key in ("reasoning_content", "content"):
            full = self.text[key]
            if key == self.section:
                tail = self.tok.decode(self.buf)
                # hold back a partial UTF-8 character until the next id completes it
                full += tail if closing else tail.rstrip("\ufffd")
            new = full.strip()[self.sent[key] :]
            if new:
                delta[key] = delta.get(key, "") + new
                self.sent[key] += len(new)

    def finish_call(self):
        """The ids of one <tool_call> body -> an OpenAI tool call. A body that is not NAME followed by
        <arg_key>K</arg_key><arg_value>V</arg_value> pairs keeps its raw text as the arguments (not a JSON
        object, so chat.check_messages and the client both see it is malformed)."""
        ids, self.call = self.call, None
        runs = [[]]  # text runs between markers, and the markers themselves
        for t in ids:
            if t in self.marker:
                runs += [self.marker[t], []]
            else:
                runs[-1].append(t)
        texts = [r if isinstance(r, str) else self.tok.decode(r) for r in runs]
        name = texts[0].strip()
        pairs = list(zip(texts[1::2], texts[2::2]))  # (marker, the text after it)
        args, ok = {}, len(pairs) % 4 == 0
        for j in range(0, len(pairs) if ok else 0, 4):
            (m1, key), (m2, gap), (m3, value), (m4, gap2) = pairs[j : j + 4]
            ok = ok and (m1, m2, m3, m4) == ARG_MARKERS and not gap.strip() and not gap2.strip()
            args[key.strip()] = self.value(name, key.strip(), value)
        arguments = json.dumps(args, ensure_ascii=False) if ok else self.tok.decode(ids)
        call = {"index": self.calls, "type": "function", "function": {"name": name, "arguments": arguments}}
        self.calls += 1
        return call

    def value(self, name, key, text):
        if self.types.get(name, {}).get(key) == "string":
            return text
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            return text


def parse_reply(ids, tok, stop=None, thinking=False, tools=None):
    """Generated ids (after the prompt) -> an assistant message dict, up to the first role token (a stop
    token). It reads ids, not text, so text that merely looks like <tool_call> cannot forge a call. stop: a
    stop string that ended generation; the reply is cut where it first appears (in the thinking: no content
    follows). thinking, tools: as for ReplyStream."""
    names = {i: s for s, i in tok.special_tokens.items()}
    ids = list(ids)
    end = next((k for k, t in enumerate(ids) if names.get(t, "").startswith("<|")), len(ids))
    stream = ReplyStream(tok, thinking=thinking, tools=tools)
    deltas = [stream.feed(ids[:end]), stream.close()]
    msg = {"role": "assistant", "content": "".join(d.get("content", "") for d in deltas)}
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    for d in deltas:
        for c in d.get("tool_calls", []):
            msg.setdefault("tool_calls", []).append({"type": "function", "function": c["function"]})
    if stop and stop in reasoning:
        reasoning = reasoning[: reasoning.index(stop)].strip()
        msg["content"] = ""  # nothing after the stop string survives
    elif stop and stop in msg["content"]:
        msg["content"] = msg["content"][: msg["content"].index(stop)].strip()
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg


def show(ids, mask, tok):
    """Decode with the trained spans in ⟦ ⟧, for eyes only."""
    out, j = [], 0
    while j < len(ids):
        k = j
        while k < len(ids) and mask[k] == mask[j]:
            k += 1
        text = tok.decode(ids[j:k])
        out.append(f"⟦{text}⟧" if mask[j] else text)
        j = k
    return "".join(out)
