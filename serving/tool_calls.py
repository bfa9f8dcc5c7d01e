"""Tool calling for ``/v1/chat/completions``: OpenAI's ``tools``, ``tool_choice`` and
``parallel_tool_calls``, assistant ``tool_calls`` and ``role: "tool"`` messages.

How a request goes (``plan``):

* the tools are validated (a name, parameters that are a JSON schema the grammar engine
  compiles); ``tool_choice`` is ``none`` (tools are neither shown nor parsed), ``auto``
  (shown; the reply is parsed for calls), ``required`` or a named function (shown, and the
  reply is decoded under a grammar that admits only calls, of that function for a named
  one, with arguments valid against its parameters: even a model never trained for tools
  returns a valid call);
* rendering: a chat template that renders ``tools`` itself (it names the variable, as
  Qwen2.5's, Hermes' and Llama 3.1's do) gets them as HF templates take them, with the
  history's calls and results as messages; for a template that does not (SmolLM2's), the
  tools go into the system message in the format of the call parser (``FORMATS``), the
  history's calls become the assistant's text in that format and tool results become
  ``tool`` messages wrapped the same way;
* the reply is parsed by the format (``--tool-call-parser``: ``hermes``, the
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` form of Qwen/Hermes
  templates; ``llama3_json``, Llama 3's ``{"name": ..., "parameters": ...}``; ``auto``
  picks from the template) into ``tool_calls``, ``finish_reason: "tool_calls"``; streamed,
  text outside calls streams as content and each call goes out as one ``tool_calls`` delta
  once complete (held text that could start a call is released when it cannot).

What ``auto`` does with a model not trained for tools (SmolLM2-135M): it sees the tools
and the format, and rarely uses them; use ``required`` or a named function there.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from strata_jax.api import InvalidRequestError
from strata_jax.structured import StructuredOutput

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def for_template(self) -> dict:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def parse_tools(raw: Any) -> list[Tool]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InvalidRequestError("tools must be a list")
    tools: list[Tool] = []
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if (
            not isinstance(t, dict)
            or t.get("type", "function") != "function"
            or not isinstance(t.get("function"), dict)
        ):
            raise InvalidRequestError(f'{where} must be {{"type": "function", "function": {{...}}}}')
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidRequestError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema object")
        StructuredOutput.json_schema(params, f"{where}.function.parameters").grammar()  # compiles, or a 400 naming it
        description = f.get("description") or ""
        if not isinstance(description, str):
            raise InvalidRequestError(f"{where}.function.description must be a string")
        if any(x.name == name for x in tools):
            raise InvalidRequestError(f"{where}.function.name {name!r} is declared twice")
        tools.append(Tool(name, description, params))
    return tools


def resolve_choice(choice: Any, tools: list[Tool]) -> str | None:
    """``"none"``, ``"auto"``, ``"required"`` or a tool's name; None when no tools are sent."""
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools")
        return None
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not any(t.name == name for t in tools):
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools")
        return name
    raise InvalidRequestError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
    )


# ---------------------------------------------------------------------------- formats
@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict

    def openai(self, index: int | None = None) -> dict:
        call: dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }
        if index is not None:
            call["index"] = index
        return call


class HermesFormat:
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call."""

    name = "hermes"
    opener = "<tool_call>"
    closer = "</tool_call>"

    def system_prompt(self, tools: list[Tool]) -> str:
        listing = "\n".join(json.dumps(t.for_template()) for t in tools)
        return (
            "You can call functions. Their signatures, one JSON object per line, are between <tools> and </tools>:\n"
            f"<tools>\n{listing}\n</tools>\n"
            "To call one, answer with a JSON object holding the function's name and its arguments "
            "between <tool_call> and </tool_call>, one block per call:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>'
        )

    def render_call(self, name: str, arguments: dict) -> str:
        """A call as the grammar writes it (so a history re-renders what the model produced)."""
        return f'{self.opener}\n{{"name": {json.dumps(name)}, "arguments": {_dense(arguments)}}}\n{self.closer}'

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        """Lark (llguidance): only calls of ``tools``, arguments valid against their parameters."""
        rules, alternatives = _call_rules(tools, "arguments")
        repeat = '("\\n" block)*' if parallel else ""
        return "\n".join(
            [
                f"start: block {repeat}",
                f'block: "{self.opener}\\n" ({" | ".join(alternatives)}) "\\n{self.closer}"',
                *rules,
            ]
        )

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        pattern = re.compile(re.escape(self.opener) + r"\s*(\{.*?\})\s*" + re.escape(self.closer), re.S)
        for m in pattern.finditer(text):
            call = _call_from_json(m.group(1), "arguments")
            if call is not None:
                calls.append(call)
        content = pattern.sub("", text).strip() if calls else text
        return content, calls


class Llama3JsonFormat:
    """Llama 3's JSON tool calls: ``{"name": ..., "parameters": {...}}`` (several joined by ``; ``)."""

    name = "llama3_json"
    opener = "{"
    closer = None

    def system_prompt(self, tools: list[Tool]) -> str:
        listing = "\n".join(json.dumps(t.for_template()) for t in tools)
        return (
            "You can call functions. Their signatures:\n" + listing + "\n"
            'To call one, answer only with {"name": "<function name>", "parameters": {<arguments as JSON>}}.'
        )

    def render_call(self, name: str, arguments: dict) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": {_dense(arguments)}}}'

    def render_result(self, content: str) -> str:
        return content

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        rules, alternatives = _call_rules(tools, "parameters")
        repeat = '("; " call)*' if parallel else ""
        return "\n".join([f"start: call {repeat}", f"call: {' | '.join(alternatives)}", *rules])

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = [c for part in body.split("; ") if (c := _call_from_json(part, "parameters")) is not None]
        return ("", calls) if calls else (text, [])


FORMATS = {"hermes": HermesFormat(), "llama3_json": Llama3JsonFormat()}
PARSERS = ("auto", *FORMATS)


def pick_format(name: str, template_source: str | None) -> Any:
    """The format of ``--tool-call-parser`` (``auto``: Llama 3's if the template speaks it, else Hermes')."""
    if name != "auto":
        return FORMATS[name]
    if template_source and ("<|python_tag|>" in template_source or "ipython" in template_source):
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def _dense(value: Any) -> str:
    """JSON without padding whitespace, as the grammar's ``%json`` writes it."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _compact(schema: dict) -> str:
    """The schema for an embedded ``%json``: compact JSON (no padding whitespace), as structured outputs."""
    return json.dumps({**schema, "x-guidance": {**schema.get("x-guidance", {}), "whitespace_flexible": False}})


def _call_rules(tools: list[Tool], arguments_key: str) -> tuple[list[str], list[str]]:
    """Lark rules ``call_i`` (``{"name": <tool i>, <arguments_key>: <its parameters>}``, compact
    JSON) and ``args_i`` for each tool, and the ``call_i`` names to choose among."""
    rules, alternatives = [], []
    for i, t in enumerate(tools):
        head = json.dumps('{"name": ' + json.dumps(t.name) + f', "{arguments_key}": ')
        rules.append(f'call_{i}: {head} args_{i} "}}"')
        rules.append(f"args_{i}: %json {_compact(t.parameters)}")
        alternatives.append(f"call_{i}")
    return rules, alternatives


def _call_from_json(text: str, arguments_key: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


# ---------------------------------------------------------------------------- a request's plan
@dataclass
class ToolPlan:
    """What tools change about one chat request."""

    messages: list[dict]
    template_tools: list[dict] | None  # for a template that renders tools itself
    constraint: StructuredOutput | None  # required / named: decode only calls
    fmt: Any  # the format replies are parsed with; None: not parsed (no tools, or tool_choice none)


def plan(req: Any, tokenizer: Any, parser: str = "auto") -> ToolPlan:
    tools = parse_tools(req.tools)
    choice = resolve_choice(req.tool_choice, tools)
    messages = [m.for_template() for m in req.messages]
    if choice is None or choice == "none":
        messages = _history_as_text(messages, FORMATS["hermes"]) if _has_tool_history(messages) else messages
        return ToolPlan(messages, None, None, None)
    handles = tokenizer.handles_tools(req.chat_template)
    source = _template_source(tokenizer, req.chat_template)
    fmt = pick_format(parser, source)
    constraint = None
    if choice != "auto":
        allowed = tools if choice == "required" else [t for t in tools if t.name == choice]
        parallel = choice == "required" and req.parallel_tool_calls is not False
        constraint = StructuredOutput("grammar", fmt.grammar(allowed, parallel), "tool_choice", json_like=True)
        constraint.grammar()  # compile now: a 400 here, not in the engine
    if handles:
        return ToolPlan(_history_for_template(messages), [t.for_template() for t in tools], constraint, fmt)
    messages = _history_as_text(messages, fmt)
    prompt = fmt.system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}
    else:
        messages = [{"role": "system", "content": prompt}, *messages]
    return ToolPlan(messages, None, constraint, fmt)


def _has_tool_history(messages: list[dict]) -> bool:
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def _history_for_template(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    "type": "function",
                    "id": c.get("id"),
                    "function": {"name": c["function"]["name"], "arguments": _args(c)},
                }
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def _history_as_text(messages: list[dict], fmt: Any) -> list[dict]:
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join(fmt.render_call(c["function"]["name"], _args(c)) for c in m["tool_calls"])
            text = (m.get("content") or "").strip()
            out.append({"role": "assistant", "content": (text + "\n" + calls) if text else calls})
        elif m["role"] == "tool":
            out.append({"role": "tool", "content": fmt.render_result(m.get("content") or "")})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    return out


def _args(call: dict) -> dict:
    raw = call["function"].get("arguments", "{}")
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except ValueError:
        raise InvalidRequestError(f"tool call {call['function'].get('name')!r}: arguments are not valid JSON") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"tool call {call['function'].get('name')!r}: arguments must be a JSON object")
    return value


def _template_source(tokenizer: Any, name: str | None) -> str | None:
    templates = getattr(tokenizer, "chat_templates", None)
    if templates is None:
        return None
    try:
        return templates.select(name).source
    except InvalidRequestError:
        return None


# ---------------------------------------------------------------------------- streaming
class CallStream:
    """Turns streamed text into content deltas and complete tool calls (hermes-style formats)."""

    def __init__(self, fmt: Any) -> None:
        self.fmt = fmt
        self.buffer = ""
        self.call_count = 0  # tool calls sent so far
        self.held_space = ""  # whitespace after a call: the format's line break, unless text follows

    def push(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """(content to send now, tool-call deltas to send now)."""
        self.buffer += text
        if self.fmt.closer is None:  # a whole-reply format (llama3_json): decided at the end
            if not final:
                return "", []
            content, calls = self.fmt.parse(self.buffer)
            self.buffer = ""
            return content, self._deltas(calls)
        content, deltas = "", []
        opener = self.fmt.opener

        def emit(segment: str) -> None:
            nonlocal content
            if self.call_count and not segment.strip():  # after a call: the format's line break, unless text follows
                self.held_space += segment
            elif segment:
                content += self.held_space + segment
                self.held_space = ""

        while True:
            start = self.buffer.find(opener)
            if start < 0:
                keep = 0 if final else _prefix_overlap(self.buffer, opener)
                emit(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            emit(self.buffer[:start])
            self.buffer = self.buffer[start:]
            calls, used = self._first_call(self.buffer)
            if calls:  # the shortest block that parses (an argument may contain the closing tag)
                deltas += self._deltas(calls)
                self.held_space = ""
                self.buffer = self.buffer[used:]
                continue
            if final:  # an unfinished call: it is text after all
                emit(self.buffer)
                self.buffer = ""
            break
        return content, deltas

    def _first_call(self, text: str) -> tuple[list[ToolCall], int]:
        """The calls of the first complete block at the start of ``text`` and its length, or ([], 0)."""
        closer = self.fmt.closer
        end = text.find(closer)
        while end >= 0:
            _, calls = self.fmt.parse(text[: end + len(closer)])
            if calls:
                return calls, end + len(closer)
            end = text.find(closer, end + 1)
        return [], 0

    def _deltas(self, calls: list[ToolCall]) -> list[dict]:
        out = []
        for call in calls:
            out.append(call.openai(index=self.call_count))
            self.call_count += 1
        return out


def _prefix_overlap(text: str, marker: str) -> int:
    """Longest tail of ``text`` that begins ``marker`` (held back: a call may be starting)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
