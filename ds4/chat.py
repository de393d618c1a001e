"""DeepSeek V4 chat format: messages to prompt (text or ids) and completions back to messages.

Follows DeepSeek's published V4 encoding (the `encoding` folder of the DeepSeek-V4-Flash model repo);
docs/chat.md walks through the rules. Messages are OpenAI-shaped dicts: roles system, developer, user,
assistant (content, reasoning_content, tool_calls), tool (content, tool_call_id) and latest_reminder.

Only this module inserts control tokens: `prompt_ids` tokenizes every text a caller supplied (contents,
reasoning, tool arguments and results, tool schemas) as plain text, so a marker typed by a user such as
`<｜User｜>` never becomes the control token.
"""
from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from ds4.errors import UsageError
from ds4.formats.vocab import ASSISTANT, BOS, DSML, EOS, THINK_END, THINK_START, USER
from ds4.tokenizer import Tokenizer

LATEST_REMINDER = "<｜latest_reminder｜>"
THINKING_MODES = ("chat", "thinking")
REASONING_EFFORTS = (None, "high", "max")
ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
# quick-instruction tasks: a message's `task` asks for one of these instead of a reply; the encoding ends the
# prompt with the task's token (action: after `<｜Assistant｜>` and the thinking marker) and the answer follows it
TASKS = {"action": "<｜action｜>", "query": "<｜query｜>", "authority": "<｜authority｜>", "domain": "<｜domain｜>",
         "title": "<｜title｜>", "read_url": "<｜read_url｜>"}

# reasoning_effort="max": DeepSeek's fixed instruction (DeepSeek recommends it only with >= 384K tokens of context).
MAX_EFFORT_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
    "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n")

TOOL_CALLS_START = f"\n\n<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"
INVOKE_END = f"</{DSML}invoke>"
TOOLS_PROMPT = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, \
booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside \
{THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

"""
TOOLS_PROMPT_END = ("\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
                    "tool calls.\n")
RESPONSE_FORMAT_PROMPT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


class ChatFormatError(UsageError):
    """A chat message or tool definition that cannot be encoded."""


@dataclass
class Prompt:
    """A rendered prompt as pieces: template text (may hold control tokens) and caller text (never does)."""

    parts: list[tuple[str, bool]] = field(default_factory=list)

    def template(self, text: str) -> None:
        """Append template text; control-token strings in it become control tokens."""
        self.parts.append((text, True))

    def plain(self, text: str) -> None:
        """Append caller-supplied text, always tokenized as plain text; it must be valid Unicode."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ChatFormatError(f"a lone surrogate at character {e.start} of {text[:40]!r}: text must be valid "
                                  "Unicode") from None
        self.parts.append((text, False))

    @property
    def text(self) -> str:
        """The prompt as one string (what DeepSeek's reference encoder returns)."""
        return "".join(text for text, _ in self.parts)


def to_json(value: Any) -> str:
    """JSON as the encoding writes it: `", "` and `": "` separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


def _fail(n: int, message: str) -> ChatFormatError:
    return ChatFormatError(f"messages[{n}]: {message}")


def _text(n: int, msg: dict, key: str = "content") -> str:
    """A text field: a string, null, or a list of OpenAI text parts (joined)."""
    value = msg.get(key)
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list):
        parts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _fail(n, f"{key} parts must be {{'type': 'text', 'text': str}} (no images), got {part!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise _fail(n, f"{key} must be a string, a list of text parts or null, got {type(value).__name__}")


def _arguments(n: int, call: Any) -> tuple[str, dict]:
    """(name, arguments dict) of one OpenAI tool call; arguments may be a JSON string or an object."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise _fail(n, f"each tool call needs function.name, got {call!r}")
    args = function.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError:
            args = {"arguments": args}  # the published encoding keeps non-JSON arguments as one string
    if not isinstance(args, dict):
        raise _fail(n, f"tool call {function['name']!r}: arguments must be a JSON object")
    return function["name"], args


def _tool_list(n: int, msg: dict) -> list:
    """A message's `tools` (an empty list when it has none)."""
    tools = msg.get("tools") or []
    if not isinstance(tools, list):
        raise _fail(n, "tools must be a list")
    return tools


def _tool_schemas(n: int, msg: dict) -> list[dict]:
    """The function definitions of a message's OpenAI `tools` list."""
    out = []
    for tool in _tool_list(n, msg):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _fail(n, f"each tool must be {{'type': 'function', 'function': {{'name': ...}}}}, got {tool!r}")
        out.append(fn)
    return out


@dataclass
class Block:
    """A piece of a user turn: the user's text, or one tool result (with the id of the call it answers)."""

    text: str
    is_result: bool = False
    call_id: str | None = None


@dataclass
class Turn:
    """One message to render; tool results and the user text after them are folded into one user turn."""

    role: str
    n: int  # index of the message it comes from (the first one, for a folded user turn)
    message: dict
    blocks: list[Block] = field(default_factory=list)


def _turns(messages: list[dict]) -> list[Turn]:
    """Check roles, fold tool results and following user texts into user turns, results in call order."""
    turns: list[Turn] = []
    call_order: dict[str, int] = {}
    for n, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise _fail(n, f"role must be one of {', '.join(ROLES)}, got {msg!r}")
        role = msg["role"]
        if msg.get("task") is not None and not (isinstance(msg["task"], str) and msg["task"] in TASKS):
            raise _fail(n, f"task must be one of {', '.join(TASKS)} or null, got {msg['task']!r}")
        if role == "assistant" and msg.get("tool_calls") is not None:
            if not isinstance(msg["tool_calls"], list):
                raise _fail(n, "tool_calls must be a list")
            call_order = {c["id"]: i for i, c in enumerate(msg["tool_calls"])
                          if isinstance(c, dict) and isinstance(c.get("id"), str)}
        if role not in ("tool", "user"):
            turns.append(Turn(role, n, msg))
            continue
        starts_turn = role == "user" and turns and turns[-1].message.get("task") is not None
        if not (turns and turns[-1].role == "user") or starts_turn:  # a task's message ends its turn
            turns.append(Turn("user", n, msg))
        blocks = turns[-1].blocks
        call_id = msg.get("tool_call_id")
        blocks.append(Block(_text(n, msg), role == "tool", call_id if isinstance(call_id, str) else None))
        results = sorted((b for b in blocks if b.is_result), key=lambda b: call_order.get(b.call_id, 0))
        blocks[:] = [results.pop(0) if b.is_result else b for b in blocks]
    return turns


def _last_user(turns: list[Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)


def _render_tool_calls(p: Prompt, n: int, calls: list) -> None:
    """An assistant's tool calls as a DSML block (string parameters as is, others as JSON)."""
    p.template(TOOL_CALLS_START + "\n")
    for i, call in enumerate(calls):
        name, args = _arguments(n, call)
        p.template(("\n" if i else "") + f'<{DSML}invoke name="')
        p.plain(name)
        p.template('">\n')
        for j, (key, value) in enumerate(args.items()):
            p.template(("\n" if j else "") + f'<{DSML}parameter name="')
            p.plain(str(key))
            p.template(f'" string="{"true" if isinstance(value, str) else "false"}">')
            p.plain(value if isinstance(value, str) else to_json(value))
            p.template(f"</{DSML}parameter>")
        p.template("\n" + INVOKE_END)
    p.template("\n" + TOOL_CALLS_END)


def _render_instructions(p: Prompt, n: int, msg: dict) -> None:
    """A system/developer text followed by its tool schemas and response format, if any."""
    p.plain(_text(n, msg))
    if msg.get("tools"):
        p.template("\n\n" + TOOLS_PROMPT)
        p.plain("\n".join(to_json(t) for t in _tool_schemas(n, msg)))
        p.template(TOOLS_PROMPT_END)
    if msg.get("response_format"):
        p.template("\n\n" + RESPONSE_FORMAT_PROMPT)
        p.plain(to_json(msg["response_format"]))


def build_prompt(messages: list[dict], thinking_mode: str = "chat", *, tools: list | None = None,
                 response_format: dict | None = None, reasoning_effort: str | None = None,
                 drop_thinking: bool = True, add_bos: bool = True) -> Prompt:
    """The prompt of a conversation, ending with `<｜Assistant｜>` and the thinking marker when a reply is due.

    `tools` and `response_format` (OpenAI format) go on the first system message (one is added if there is
    none).
    In thinking mode the reasoning of assistant turns before the last user turn is dropped, unless tools
    are defined or `drop_thinking` is False. `reasoning_effort="max"` prepends DeepSeek's max-effort text.
    A message with a `task` (TASKS) is followed by its task token instead of the reply's opening.
    """
    if thinking_mode not in THINKING_MODES:
        raise ChatFormatError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
    if reasoning_effort not in REASONING_EFFORTS:
        raise ChatFormatError(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {reasoning_effort!r}")
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    if not isinstance(tools, list | None):
        raise ChatFormatError(f"tools must be a list, got {type(tools).__name__}")
    if not isinstance(response_format, dict | None):
        raise ChatFormatError(f"response_format must be an object, got {type(response_format).__name__}")
    messages = list(messages)
    if tools or response_format:
        first = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "system"), None)
        if first is None:
            messages.insert(0, {"role": "system", "content": ""})
            first = 0
        extra = {"tools": [*_tool_list(first, messages[first]), *tools]} if tools else {}
        extra |= {"response_format": response_format} if response_format else {}
        messages[first] = {**messages[first], **extra}
    turns = _turns(messages)
    thinking = thinking_mode == "thinking"
    drop = drop_thinking and not any(t.message.get("tools") for t in turns)
    if thinking and drop:  # developer turns before the last user turn go (their reasoning is dropped below)
        turns = [t for i, t in enumerate(turns) if t.role != "developer" or i >= _last_user(turns)]
    last_user = _last_user(turns)

    p = Prompt()
    if add_bos:
        p.template(BOS)
    if thinking and reasoning_effort == "max":
        p.template(MAX_EFFORT_PREFIX)
    for i, turn in enumerate(turns):
        n, role, msg = turn.n, turn.role, turn.message
        if role == "system":
            _render_instructions(p, n, msg)
        elif role == "developer":
            if not _text(n, msg):
                raise _fail(n, "a developer message needs content")
            p.template(USER)
            _render_instructions(p, n, msg)
        elif role == "user":
            p.template(USER)
            for j, block in enumerate(turn.blocks):
                p.template(("\n\n" if j else "") + ("<tool_result>" if block.is_result else ""))
                p.plain(block.text)
                p.template("</tool_result>" if block.is_result else "")
        elif role == "latest_reminder":
            p.template(LATEST_REMINDER)
            p.plain(_text(n, msg))
        else:  # assistant; a task's answer carries no reasoning
            after_task = i > 0 and turns[i - 1].message.get("task") is not None
            if thinking and (not drop or i > last_user) and not after_task:
                p.plain(_text(n, msg, "reasoning_content"))
                p.template(THINK_END)
            p.plain(_text(n, msg))
            if msg.get("tool_calls"):
                _render_tool_calls(p, n, msg["tool_calls"])
            p.template(EOS)
        following = turns[i + 1].role if i + 1 < len(turns) else None
        if following not in (None, "assistant", "latest_reminder"):
            continue
        task = msg.get("task")
        if task == "action":
            p.template(ASSISTANT + (THINK_START if thinking else THINK_END) + TASKS[task])
        elif task is not None:
            p.template(TASKS[task])
        elif role in ("user", "developer"):
            opens_thinking = thinking and (not drop or i >= last_user)
            p.template(ASSISTANT + (THINK_START if opens_thinking else THINK_END))
    return p


def prompt_task(messages: list[dict]) -> str | None:
    """The task whose token ends the prompt of `messages` (the last message's `task`), for CompletionParser."""
    last = messages[-1] if isinstance(messages, list) and messages else None
    task = last.get("task") if isinstance(last, dict) else None
    return task if isinstance(task, str) and task in TASKS else None


def encode_messages(messages: list[dict], thinking_mode: str = "chat", **options: Any) -> str:
    """The prompt text of a conversation (see build_prompt for the options)."""
    return build_prompt(messages, thinking_mode, **options).text


def prompt_ids(tokenizer: Tokenizer, messages: list[dict], thinking_mode: str = "chat", **options: Any) -> list[int]:
    """Token ids of a conversation's prompt; caller text never becomes a control token. A task whose token the
    vocabulary lacks (a tiny test vocabulary) is a ChatFormatError, never the marker spelled out as text."""
    prompt = build_prompt(messages, thinking_mode, **options)
    for task, token in TASKS.items():
        used = any(is_template and token in text for text, is_template in prompt.parts)
        if used and len(tokenizer.encode(token, specials=True)) != 1:
            raise ChatFormatError(f"task {task!r}: this model's vocabulary has no {token} token")
    return tokenizer.encode_parts(prompt.parts)


def cli_prompt(messages: list[dict], *, think: bool = False, system: str | None = None,
               max_effort: bool = False) -> Prompt:
    """The prompt of the CLI's options: `--system` first, `--think`, `--think-max` (implies thinking)."""
    messages = ([{"role": "system", "content": system}] if system else []) + list(messages)
    return build_prompt(messages, "thinking" if think or max_effort else "chat",
                        reasoning_effort="max" if max_effort else None)


def render_chat(messages: list[dict], **options: Any) -> str:
    """The prompt text of the CLI's options (see cli_prompt)."""
    return cli_prompt(messages, **options).text


def chat_ids(tokenizer: Tokenizer, messages: list[dict], **options: Any) -> list[int]:
    """Token ids of the CLI's options (see cli_prompt); caller text never becomes a control token."""
    return tokenizer.encode_parts(cli_prompt(messages, **options).parts)


# ---- completions back to messages -----------------------------------------------------------------------


@dataclass
class ToolCall:
    """One parsed tool call: its name and its arguments as a JSON object string."""

    name: str
    arguments: str

    def openai(self, call_id: str) -> dict:
        """OpenAI's tool-call shape."""
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Delta:
    """A piece of a completion: reasoning text, content text, or one complete tool call."""

    reasoning: str = ""
    content: str = ""
    tool_call: ToolCall | None = None


INVOKE_RE = re.compile(rf'^\n?<{DSML}invoke name="([^"\n]*)">\n(.*?)\n?{INVOKE_END}$', re.DOTALL)
PARAM_RE = re.compile(rf'<{DSML}parameter name="([^"\n]*)" string="(true|false)">(.*?)</{DSML}parameter>\n?',
                      re.DOTALL)


def parse_invoke(text: str) -> ToolCall | None:
    """A `<｜DSML｜invoke ...>...</｜DSML｜invoke>` element as a ToolCall (None when malformed)."""
    m = INVOKE_RE.match(text)
    if not m:
        return None
    body, args, pos = m.group(2), [], 0
    for p in PARAM_RE.finditer(body):
        if p.start() != pos or any(key == p.group(1) for key, _ in args):
            return None
        value = to_json(p.group(3)) if p.group(2) == "true" else p.group(3)
        args.append((p.group(1), value))
        pos = p.end()
    if body[pos:].strip():
        return None
    return ToolCall(m.group(1), "{" + ", ".join(f"{to_json(k)}: {v}" for k, v in args) + "}")


def held_back(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the start of a marker (kept until the next piece)."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


class CompletionParser:
    """Incremental parser of a generated reply: feed text pieces, get Deltas; never emits half a marker.

    thinking mode: reasoning up to `</think>`, then content (a `task`'s reply is content only, but action's in
    thinking mode, whose prompt opened `<think>`). Content ends at EOS; a DSML tool-call block
    (`\\n\\n<｜DSML｜tool_calls>`) yields one ToolCall per complete invoke. An invoke that does not parse, or
    that calls a name not in `tools` (when given), is passed on as content text, so no generated text is
    lost; with `tools` empty no block is parsed at all.
    """

    def __init__(self, thinking_mode: str = "chat", task: str | None = None, tools: Collection[str] | None = None):
        if thinking_mode not in THINKING_MODES:
            raise ChatFormatError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
        if task is not None and not (isinstance(task, str) and task in TASKS):
            raise ChatFormatError(f"task must be one of {', '.join(TASKS)} or None, got {task!r}")
        self.tools = tools
        self.content_markers = (EOS,) if tools is not None and not tools else (TOOL_CALLS_START, EOS)
        opens_thinking = thinking_mode == "thinking" and task in (None, "action")  # as build_prompt ends the prompt
        self.state = "reasoning" if opens_thinking else "content"
        self.buffer = ""
        self.block_start = ""  # the tool-call block's opening marker, until something of the block is out

    def feed(self, text: str) -> list[Delta]:
        """Deltas completed by this piece of generated text."""
        self.buffer += text
        out: list[Delta] = []
        while self.buffer and self.state != "done":
            if not self._step(out, final=False):
                break
        return out

    def finish(self) -> list[Delta]:
        """Deltas of whatever is held back at the end of the generation."""
        out: list[Delta] = []
        while self.buffer and self.state != "done":
            self._step(out, final=True)
        return out

    def _step(self, out: list[Delta], final: bool) -> bool:
        """Consume from the buffer; False when more text is needed."""
        if self.state == "tools":
            return self._step_tools(out, final)
        markers = (THINK_END, EOS) if self.state == "reasoning" else self.content_markers
        hits = [(self.buffer.find(m), m) for m in markers if m in self.buffer]
        if hits:
            at, marker = min(hits)
            self._emit(out, self.buffer[:at])
            self.buffer = self.buffer[at + len(marker):]
            self.state = {THINK_END: "content", EOS: "done", TOOL_CALLS_START: "tools"}[marker]
            self.block_start = marker if marker == TOOL_CALLS_START else ""
            return True
        keep = 0 if final else held_back(self.buffer, markers)
        self._emit(out, self.buffer[:len(self.buffer) - keep])
        self.buffer = self.buffer[len(self.buffer) - keep:]
        return final

    def _step_tools(self, out: list[Delta], final: bool) -> bool:
        """Inside a tool-call block: one invoke at a time, then the block's end."""
        body = self.buffer.lstrip("\n")
        if body.startswith(TOOL_CALLS_END):
            self.buffer, self.state = body[len(TOOL_CALLS_END):], "content"
            return True
        end = self.buffer.find(INVOKE_END)
        if end < 0:
            if final:  # cut off inside the block: hand the raw text on
                out.append(Delta(content=self.block_start + self.buffer))
                self.buffer, self.state = "", "content"
            return final
        invoke, self.buffer = self.buffer[:end + len(INVOKE_END)], self.buffer[end + len(INVOKE_END):]
        call = parse_invoke(invoke)
        call = call if call and (self.tools is None or call.name in self.tools) else None
        out.append(Delta(tool_call=call) if call else Delta(content=self.block_start + invoke))
        self.block_start = ""
        return True

    def _emit(self, out: list[Delta], text: str) -> None:
        if text:
            out.append(Delta(reasoning=text) if self.state == "reasoning" else Delta(content=text))


def parse_completion(text: str, thinking_mode: str = "chat", task: str | None = None) -> dict:
    """A generated reply as an OpenAI assistant message: role, reasoning_content, content, tool_calls. The reply
    to a `task` prompt is content only, unless the prompt opened `<think>` (action in thinking mode)."""
    parser = CompletionParser(thinking_mode, task)
    deltas = parser.feed(text) + parser.finish()
    calls = [d.tool_call for d in deltas if d.tool_call]
    return {"role": "assistant",
            "reasoning_content": "".join(d.reasoning for d in deltas),
            "content": "".join(d.content for d in deltas),
            "tool_calls": [c.openai(f"call_{i}") for i, c in enumerate(calls)]}
