"""Tool calling: OpenAI function tools as a prompt, as a grammar for the answer, and the answer's calls.

The format is Hermes's, the one Qwen2.5's chat template teaches. A call is

    <tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>

and calls follow each other a newline apart. The grammar (llguidance, see `grammar`) lets the answer begin with any
text (`tool_choice` "auto") or makes it a call at once ("required", or a named function); once a call begins it
forces the frame and a declared name, and constrains ARGS to that function's parameter schema, so every finished
call parses and validates. After the last call only an end-of-sequence token may follow. Lossless as any grammar:
every method masks each position as plain decoding does.

A model whose chat template takes no tools (SmolLM2's) is told the same format in its system message (TOLD), and
the history's calls and tool results are written into its messages as text (`render`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import llguidance

from swiftdecode.base.params import ParamError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = '{"name": "'  # a call's JSON begins so, its name next
HEAD = "\n" + CALL  # after OPEN
ARGS = '", "arguments": '  # after the name, before the arguments
TRAILER = "}\n" + CLOSE  # after the arguments
SEPARATOR = "\n"  # between two calls
# The arguments' JSON as the chat template's `tojson` writes the history's calls (Python's json.dumps): no newline
# in it, so the end of a call without tags (BARE_END, then SEPARATOR and the next call's CALL) is unambiguous.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
BARE_END = "}"
FENCE, FENCE_END = "```json\n", "\n```"  # a Markdown code block around calls without tags
MAX_TOOLS = 128  # as OpenAI
# The tools' parameter schemas, as JSON text, at most: the worker compiles the answer's grammar between two rounds
# of the batch (229 KB of schemas took 75 ms on a Xeon; 956 KB took 1.8 s and then failed, past llguidance's limit).
MAX_SCHEMA_CHARS = 256 * 1024
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name
CHOICES = ("none", "auto", "required")
# The system message's tools part where the template has none: Qwen2.5's own words, so both kinds read alike.
TOLD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class ArgumentsText(str):
    """A history call's arguments that are not JSON, kept as the text they are (OpenAI takes them so): a call cut by
    the token limit, sent back as the response gave it. Written into the prompt as is, not as JSON."""


@dataclass(frozen=True)
class Tools:
    """A request's tools: OpenAI function definitions ({"name", "description", "parameters"}), the choice
    ("auto", "required" or one function's name) and whether the answer may hold several calls."""

    functions: tuple[dict, ...]
    choice: str = "auto"
    parallel: bool = True

    def schemas(self) -> list[dict]:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [{"type": "function", "function": f} for f in self.functions]


def check_tools(tools: object, choice: object = None, parallel: object = None) -> Tools | None:
    """OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` -> Tools, or None (no tools, or "none": the model
    is not told of them). ParamError (field: the parameter) for a definition or choice that breaks a rule."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ParamError("tool_choice", "'tool_choice' asks for a tool, but the request has no 'tools'")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ParamError("tools", f"'tools' must be a list of at most {MAX_TOOLS} tools")
    functions = tuple(check_function(t, i) for i, t in enumerate(tools))
    if len(json.dumps([f["parameters"] for f in functions])) > MAX_SCHEMA_CHARS:
        raise ParamError("tools", f"the tools' parameter schemas take more than {MAX_SCHEMA_CHARS} characters")
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise ParamError("tools", "two tools have the same name")
    if isinstance(choice, dict):
        named = choice.get("function") if choice.get("type") == "function" else None
        choice = named.get("name") if isinstance(named, dict) else None
        if choice not in names:
            raise ParamError("tool_choice", f"'tool_choice' must name one of the tools ({', '.join(names)[:200]})")
    elif (choice := "auto" if choice is None else choice) not in CHOICES:
        raise ParamError("tool_choice", f"'tool_choice' must be one of {CHOICES} or {{'type': 'function', ...}}")
    if parallel is not None and not isinstance(parallel, bool):
        raise ParamError("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    return None if choice == "none" else Tools(functions, choice, parallel is not False)


def check_function(tool: object, i: int) -> dict:
    """tools[i] -> its function ({"name", "description"?, "parameters"}), its parameters a JSON schema that
    compiles (ParamError("tools") otherwise)."""
    where = f"tools[{i}]"
    if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict)):
        raise ParamError("tools", f"{where} must be {{'type': 'function', 'function': {{...}}}}")
    f = tool["function"]
    if not (isinstance(f.get("name"), str) and NAME.fullmatch(f["name"])):
        raise ParamError("tools", f"{where}.function.name must be 1-64 letters, digits, '_' or '-'")
    if not isinstance(f.get("description", ""), str):
        raise ParamError("tools", f"{where}.function.description must be a string")
    params = f.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ParamError("tools", f"{where}.function.parameters must be a JSON schema of an object")
    why = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(params))
    if why:
        raise ParamError("tools", f"{where}.function.parameters is not a usable JSON schema: {why.splitlines()[0]}")
    return {
        "name": f["name"],
        **({"description": f["description"]} if f.get("description") else {}),
        "parameters": params,
    }


def lark(tools: Tools, marker_token: bool) -> str:
    """The answer's grammar (llguidance's Lark). `marker_token`: OPEN and CLOSE are tokens of their own in the
    vocabulary (Qwen2.5's). With "auto", an answer that begins as a call's JSON (CALL), or as a JSON code block
    (FENCE), holds calls without their tags, as small models write them (llama.cpp's Hermes parser takes both too);
    any other text holds no OPEN, so text and calls never mix up."""
    fns = [f for f in tools.functions if tools.choice in CHOICES or f["name"] == tools.choice]
    q = json.dumps
    rules = [
        f"fn{i}: {q(f['name'] + ARGS)} %json {q({**f['parameters'], 'x-guidance': JSON_FORMAT})}"
        for i, f in enumerate(fns)
    ]
    rules.append(f"fns: {' | '.join(f'fn{i}' for i in range(len(fns)))}")
    opening, closing = ("<tool_call>", "</tool_call>") if marker_token else (q(OPEN), q(CLOSE))
    rules.append(f"body: {q(HEAD)} fns {q(TRAILER[: -len(CLOSE)])} {closing}")
    rules.append(f"bare: {q(CALL)} fns {q(BARE_END)}")
    more, bare_more = (f" ({q(SEPARATOR)} {opening} body)*", f" ({q(SEPARATOR)} bare)*") if tools.parallel else ("", "")
    if tools.choice != "auto":
        start = f"start: {opening} body{more}"
    elif marker_token:
        start = f"start: TEXT | TEXT {opening} body{more} | bare{bare_more} | {q(FENCE)} bare{bare_more} {q(FENCE_END)}"
    else:  # lazy: the text ends at the first OPEN
        start = f"start: TEXT | head body{more} | bare{bare_more} | {q(FENCE)} bare{bare_more} {q(FENCE_END)}"
        start += f"\nhead[lazy]: TEXT {q(OPEN)}"
    # any text without OPEN in it that does not begin as a call (or a code block of one)
    starts = "|".join(re.escape(s).replace("\\\n", r"\n") for s in (CALL[:-3], FENCE + CALL[0]))
    text = rf"TEXT: /(.|\n)*/ & ~/(.|\n)*{re.escape(OPEN)}(.|\n)*/ & ~/({starts})(.|\n)*/"
    return "\n".join(["%llguidance {}", start, *rules, text, ""])


def marker_token(tokenizer) -> bool:
    """Whether OPEN and CLOSE are added tokens of the tokenizer (Qwen2.5's)."""
    added = tokenizer.get_added_vocab()
    return OPEN in added and CLOSE in added


def render(messages: list[dict], tools: Tools | None, tokenizer) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) as `tokenizer`'s chat template takes them. `messages`: {"role", "content"}, an assistant's
    with "tool_calls" ([{"name", "arguments": object}]). A template that takes tools gets them and the calls as its
    own; another gets them as text (TOLD in the system message, calls in the answer, results as the user's)."""
    if "tools" in (getattr(tokenizer, "chat_template", None) or ""):
        out = [
            {**m, "tool_calls": [{"type": "function", "function": c} for c in m["tool_calls"]]}
            if m.get("tool_calls")
            else m
            for m in messages
        ]
        return out, tools.schemas() if tools else None
    out = [told(m) for m in messages]
    if tools:
        text = TOLD.format(tools="\n".join(json.dumps(s) for s in tools.schemas()))
        first = out[0]["content"] + "\n\n" if out and out[0]["role"] == "system" else None
        out = [{"role": "system", "content": (first or "") + text}] + out[first is not None :]
    return out, None


def told(message: dict) -> dict:
    """One message as text, for a template without tools: calls written out, a tool's result as the user's."""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    if not message.get("tool_calls"):
        return message
    calls = [f"{OPEN}{HEAD}{c['name']}{ARGS}{arguments_text(c['arguments'])}{TRAILER}" for c in message["tool_calls"]]
    return {"role": message["role"], "content": SEPARATOR.join(filter(None, [message["content"], *calls]))}


def arguments_text(arguments: object) -> str:
    """A history call's arguments as its prompt shows them: JSON as the template's `tojson` writes it, or the text
    that was not JSON as it is."""
    return arguments if isinstance(arguments, ArgumentsText) else json.dumps(arguments)


def is_json(text: str) -> bool:
    """Whether `text` parses as JSON (a finished call's arguments do; one cut by the token limit does not)."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def finish_reason(reason: str, calls: int) -> str:
    """OpenAI's finish reason of an answer that made `calls` calls and ended for `reason`."""
    return "tool_calls" if calls and reason == "stop" else reason


class CallParser:
    """An answer's text, fed as it streams, split into content and the calls' names and arguments: events
    ("content", text), ("call", index, name) and ("arguments", index, text). The frame is the grammar's (see
    `lark`), so the split is exact; text that may yet turn out to be frame is held back until it is known."""

    def __init__(self):
        self.state, self.held, self.calls = "text", "", 0  # text, head (before a name), arguments, between, done
        self.bare = self.fenced = False  # the calls have no tags (the answer began as a call's JSON, or FENCE)
        self.said = False  # some content went out

    def feed(self, text: str) -> list[tuple]:
        self.held += text
        out = []
        while self._advance(out):
            pass
        return out

    def close(self) -> list[tuple]:
        """The events of what is held at the end: text as content, an unfinished call's arguments as far as they
        got (an answer cut by max_tokens); the frame of an unfinished call is dropped."""
        out = self.feed("")
        keep = max(partial(self.held, end) for end, _ in self.ends())
        if self.state == "text" and self.held:
            out.append(("content", self.held))
        elif self.state == "arguments" and len(self.held) > keep:
            out.append(("arguments", self.calls - 1, self.held[: len(self.held) - keep]))
        self.held = ""
        return out

    def ends(self) -> list[tuple[str, str]]:
        """What may end a call's arguments: (the frame that follows them, the state after it)."""
        if not self.bare:
            return [(TRAILER, "between")]
        return [(BARE_END + SEPARATOR + CALL, "head")] + [(BARE_END + FENCE_END, "done")] * self.fenced

    def _advance(self, out: list) -> bool:
        """Take what the held text settles; True if the state moved (there may be more to take)."""
        if self.state == "text" and not self.said and not self.calls:  # the answer may begin as a call's JSON
            for start in (CALL, FENCE + CALL):
                if self.held.startswith(start):
                    self.state, self.bare, self.fenced = "head", True, start != CALL
                    self.held = self.held.removeprefix(FENCE)
                    return True
            if any(start.startswith(self.held) for start in (CALL, FENCE + CALL)):
                return False
        if self.state in ("text", "between"):
            return self._text(out)
        if self.state == "head":
            head = CALL if self.bare else HEAD
            name, sep, rest = self.held.removeprefix(head).partition(ARGS)
            if not (self.held.startswith(head) and sep):
                return False
            out.append(("call", self.calls, name))
            self.state, self.held, self.calls = "arguments", rest, self.calls + 1
            return True
        return self.state == "arguments" and self._arguments(out)

    def _text(self, out: list) -> bool:
        """Content up to OPEN (none between calls), holding back an end that may begin OPEN."""
        at = self.held.find(OPEN)
        end = at if at >= 0 else len(self.held) - partial(self.held, OPEN)
        if self.state == "text" and end:
            out.append(("content", self.held[:end]))
            self.said = True
        if at < 0:
            self.held = self.held[end:]
            return False
        self.state, self.held = "head", self.held[at + len(OPEN) :]
        return True

    def _arguments(self, out: list) -> bool:
        """A call's arguments up to the frame that ends them, holding back an end that may begin one."""
        found = [(self.held.find(end), end, after) for end, after in self.ends() if end in self.held]
        if not found:
            keep = max(partial(self.held, end) for end, _ in self.ends())
            if len(self.held) > keep:
                out.append(("arguments", self.calls - 1, self.held[: len(self.held) - keep]))
                self.held = self.held[len(self.held) - keep :]
            return False
        at, end, after = min(found)
        if at:
            out.append(("arguments", self.calls - 1, self.held[:at]))
        self.state, self.held = after, (CALL if after == "head" else "") + self.held[at + len(end) :]
        return True


def partial(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (it may be the marker's start)."""
    return next((k for k in range(min(len(text), len(marker) - 1), 0, -1) if marker.startswith(text[-k:])), 0)


def split_answer(text: str) -> tuple[str | None, list[dict]]:
    """A whole answer -> (its content, None if empty; its calls [{"name", "arguments": JSON text}])."""
    parser = CallParser()
    return gathered(parser.feed(text) + parser.close())


def gathered(events: list[tuple]) -> tuple[str | None, list[dict]]:
    """CallParser's events -> (the content, None if empty; the calls [{"name", "arguments": JSON text}])."""
    content, calls = [], []
    for event in events:
        if event[0] == "content":
            content.append(event[1])
        elif event[0] == "call":
            calls.append({"name": event[2], "arguments": ""})
        else:
            calls[event[1]]["arguments"] += event[2]
    return "".join(content) or None, calls
