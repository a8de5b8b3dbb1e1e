"""The model contract: what the model is shown and how its answer becomes a game action.

Everything that fixes the wording of a prompt or the shape of an accepted answer lives here,
so that training data, evaluation and serving all speak exactly the same language. The
tool-call format is Hermes style (as in Atropos): the tool list is JSON inside ``<tools>`` in
the system prompt and the model answers with a JSON object inside ``<tool_call>`` tags.
Servers that run their own tool parser return native ``tool_calls`` instead; both are read.

The parser is deliberately forgiving about *packaging* (tags, case, fences, quoting style,
wrappers that real models and servers produce) and strict about *meaning*: the call must name
``take_action`` and the action must be one of the schema's enum values. A packaging quirk is
not a decision error, but "stand" or a bare "hit" in prose is not a call of the tool the model
was given, and accepting it would teach the policy a contract nobody else honours.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from blackjack_rl.game.table import HIT, STICK

__all__ = [
    "ACTION_NAMES",
    "HIT",
    "STICK",
    "TOOLS",
    "TOOL_NAME",
    "ParseError",
    "ParsedAction",
    "observation_text",
    "parse_action",
    "split_thinking",
    "system_prompt",
    "tool_call_text",
]

# Gymnasium Blackjack-v1 action ids.
ACTION_NAMES = {HIT: "hit", STICK: "stick"}
_ACTIONS_BY_NAME = {name: action for action, name in ACTION_NAMES.items()}

TOOL_NAME = "take_action"

TOOLS: list[dict] = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": (
                "Play your turn in Blackjack: 'hit' takes another card, "
                "'stick' keeps your hand and ends your turn."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "action": {
                        "type": "string",
                        "enum": [ACTION_NAMES[HIT], ACTION_NAMES[STICK]],
                        "description": "Either 'hit' or 'stick'.",
                    }
                },
                "required": ["action"],
                "additionalProperties": False,
            },
        },
    }
]

# Bounds that keep parsing cheap whatever a model (or an attacker) sends. Thinking can be long
# and is only searched for its closing tag with a C-level regex, so it gets a larger budget
# than the answer, which is scanned character by character.
_MAX_TEXT_CHARS = 1_000_000
_MAX_ANSWER_CHARS = 20_000
_MAX_TAG_REGIONS = 16
_MAX_OBJECTS_PER_REGION = 4
_MAX_BARE_OBJECTS = 16
_MAX_UNCLOSED_OBJECTS = 3
_MAX_LITERAL_DEPTH = 64
_DETAIL_SNIPPET = 60

# Each pattern is a literal with optional whitespace runs between literal characters, so
# matching stays linear: no nested or adjacent unbounded quantifiers that could backtrack.
_THINK_OPEN = re.compile(r"<\s*think\s*>", re.IGNORECASE)
_THINK_CLOSE = re.compile(r"<\s*/\s*think\s*>", re.IGNORECASE)
_LEADING_THINK_OPEN = re.compile(r"\s*<\s*think\s*>", re.IGNORECASE)
_CALL_OPEN = re.compile(r"<\s*tool_call\s*>", re.IGNORECASE)
_CALL_CLOSE = re.compile(r"<\s*/\s*tool_call\s*>", re.IGNORECASE)
_CALL_KEY = re.compile(r"[\"'](?:name|function)[\"']\s*:", re.IGNORECASE)
_OBJECT_SCAN = re.compile(r"[{}\"'\\]")

_PYTHON_NAMES = {
    "true": True,
    "false": False,
    "null": None,
    "True": True,
    "False": False,
    "None": None,
}


# --------------------------------------------------------------------------- prompt side


def tool_call_text(action: int) -> str:
    """The canonical answer for ``action``: the one format every consumer must accept.

    Used as the example in the system prompt and by scripted policies, so that the text a
    model is shown and the text the parser is tested against cannot drift apart.
    """
    try:
        name = ACTION_NAMES[int(action)]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"action must be HIT ({HIT}) or STICK ({STICK}), got {action!r}") from None
    payload = json.dumps({"name": TOOL_NAME, "arguments": {"action": name}})
    return f"<tool_call>\n{payload}\n</tool_call>"


def system_prompt(thinking: bool = False) -> str:
    """The system message; a pure function of ``thinking`` so a whole group shares one prompt.

    Trainers such as the Axolotl plugin take the prompt as the prefix shared by a group, so any
    variation here (timestamps, random examples) would silently corrupt training data.

    It shows both calls as the two possible whole answers. A prompt whose one complete
    example was the stick call made the untrained model say stick in every hand, and RL
    then rewarded that bias along with the format. A small model still favours whichever
    call is listed first (docs/training/README.md has the measurements); hit comes first
    because it is optimal in 53% of first decisions.
    """
    tools_json = json.dumps(TOOLS)
    intro = (
        "You are an AI agent playing Blackjack. Each turn you are told your hand total, the "
        "card the dealer is showing and whether you hold a usable ace (an ace counted as 11). "
        "Get closer to 21 than the dealer without going over; the dealer draws until reaching "
        "17 or more. Decide whether to hit (take another card) or stick (keep your hand).\n\n"
        "You have one function available. Its definition is inside <tools></tools>:\n"
        f"<tools>\n{tools_json}\n</tools>\n\n"
        "To call the function, write a JSON object with the function name and its arguments "
        "inside <tool_call> </tool_call> tags.\n\n"
    )
    calls = f"{tool_call_text(HIT)}\n{tool_call_text(STICK)}\n"
    if thinking:
        answer = (
            "First reason about your decision inside <think> </think> tags, then write the "
            "function call after the closing </think> tag. The call should look like one of "
            f"these two:\n{calls}"
        )
    else:
        answer = (
            "Answer with the function call only: no reasoning, no thinking block and no other "
            f"text. Your whole answer should look like one of these two:\n{calls}"
        )
    return intro + answer


def observation_text(player_sum: int, dealer_card: int, usable_ace: bool) -> str:
    """Describe a Blackjack-v1 observation in the Atropos wording.

    The wording is kept verbatim (including "a 8" and the dealer's ace shown as "a 1") so that
    data and checkpoints stay comparable with the original environment. ``int``/``bool``
    coercion makes numpy scalars from gymnasium render exactly like Python ints.
    """
    return (
        f"Your current hand sum is {int(player_sum)}. "
        f"The dealer is showing a {int(dealer_card)}. "
        f"You have a usable ace: {'yes' if bool(usable_ace) else 'no'}."
    )


# --------------------------------------------------------------------------- answer side


class ParseError(str, Enum):
    """Why an answer is not a valid action; a ``str`` so it serialises as its plain value."""

    NO_CALL = "no_call"
    BAD_JSON = "bad_json"
    WRONG_TOOL = "wrong_tool"
    BAD_ACTION = "bad_action"


@dataclass(frozen=True, slots=True)
class ParsedAction:
    """An answer's meaning: an action, or the class and reason of the failure.

    Failures are values rather than exceptions because an invalid answer is an expected,
    scored outcome of an episode, and metrics count each class separately.
    """

    action: int | None
    error: ParseError | None
    detail: str

    @property
    def valid(self) -> bool:
        return self.error is None


def _ok(action: int) -> ParsedAction:
    return ParsedAction(action, None, "")


def _fail(error: ParseError, detail: str) -> ParsedAction:
    return ParsedAction(None, error, detail)


def _snippet(value: Any) -> str:
    """A short, always-safe rendering for error details.

    Only primitives are ``repr``'d: arbitrary objects (SDK models, fuzzed structures) could
    have slow or raising ``__repr__`` methods.
    """
    if isinstance(value, str):
        text = repr(value[: _DETAIL_SNIPPET + 1])
    elif value is None or isinstance(value, (bool, int, float)):
        try:
            text = repr(value)
        except Exception:  # int too large to render
            text = type(value).__name__
    else:
        text = f"<{type(value).__name__}>"
    if len(text) > _DETAIL_SNIPPET:
        text = text[:_DETAIL_SNIPPET] + "..."
    return text


def _as_text(text: Any) -> str | None:
    """Best-effort text; ``None`` for values that cannot be a model's answer at all."""
    if text is None:
        return ""
    if isinstance(text, str):
        return text[:_MAX_TEXT_CHARS]
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            return bytes(text[: _MAX_TEXT_CHARS * 4]).decode("utf-8", "replace")[:_MAX_TEXT_CHARS]
        except Exception:
            return None
    return None


def split_thinking(text: str) -> tuple[str, str]:
    """Separate a leading ``<think>`` block from the answer: ``(thought, rest)``, both stripped.

    Only the part after the thinking counts as the answer, so a call the model drafts while
    reasoning is not mistaken for its decision. An unclosed block means the model never got
    to answer: all of it is thought. A closing tag with no opening one is read as the end of
    thinking, because chat templates of reasoning models (Qwen3, DeepSeek-R1) put the
    opening ``<think>`` into the prompt and the completion starts mid-thought.
    """
    text = _as_text(text) or ""
    opening = _LEADING_THINK_OPEN.match(text)
    if opening is not None:
        closing = _THINK_CLOSE.search(text, opening.end())
        if closing is None:
            return text[opening.end() :].strip(), ""
        return text[opening.end() : closing.start()].strip(), text[closing.end() :].strip()
    closing = _THINK_CLOSE.search(text)
    if closing is not None and _THINK_OPEN.search(text, 0, closing.start()) is None:
        return text[: closing.start()].strip(), text[closing.end() :].strip()
    return "", text.strip()


def _drop_think_blocks(text: str) -> str:
    """Remove later ``<think>`` blocks too; an unclosed one hides everything after it."""
    parts = []
    pos = 0
    while True:
        opening = _THINK_OPEN.search(text, pos)
        if opening is None:
            parts.append(text[pos:])
            break
        parts.append(text[pos : opening.start()])
        closing = _THINK_CLOSE.search(text, opening.end())
        if closing is None:
            break
        pos = closing.end()
    return "".join(parts)


def _object_end(text: str, start: int) -> int:
    """Index just past the brace matching ``text[start] == '{'``, or -1 if it never closes.

    Braces inside quoted strings (either quote style, with backslash escapes) do not count,
    so JSON and Python-literal objects are both delimited correctly. Linear in the text.
    """
    depth = 0
    quote = ""
    skip_before = -1
    for match in _OBJECT_SCAN.finditer(text, start):
        i = match.start()
        if i < skip_before:
            continue
        ch = text[i]
        if quote:
            if ch == "\\":
                skip_before = i + 2
            elif ch == quote:
                quote = ""
            continue
        if ch == '"' or ch == "'":
            quote = ch
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


def _objects(text: str, limit: int) -> list[tuple[str, bool]]:
    """Top-level ``{...}`` spans in order, as ``(span, closed)``, at most ``limit`` of them.

    After an unclosed span the search resumes at the next brace, so that a stray ``{`` in
    prose does not hide a later call; only a few times, which bounds the work on inputs made
    of nothing but opening braces.
    """
    spans: list[tuple[str, bool]] = []
    pos = 0
    unclosed = 0
    while len(spans) < limit:
        start = text.find("{", pos)
        if start < 0:
            break
        end = _object_end(text, start)
        if end < 0:
            spans.append((text[start:], False))
            unclosed += 1
            following = text.find("{", start + 1)
            # Objects nested in a truncated call are fragments of it (its arguments, or the
            # call inside a wrapper), not calls of their own; a truncated call is BAD_JSON.
            if (
                unclosed >= _MAX_UNCLOSED_OBJECTS
                or following < 0
                or _CALL_KEY.search(text, start, following)
            ):
                break
            pos = following
        else:
            spans.append((text[start:end], True))
            pos = end
    return spans


_FAILED = object()


def _literal(node: ast.AST, depth: int) -> Any:
    """Evaluate a Python/JSON literal AST, also accepting ``true``/``false``/``null``.

    A hand-written evaluator instead of ``ast.literal_eval`` because models mix JSON and
    Python spellings in one object, and because it rejects anything that is not plain data.
    """
    if depth > _MAX_LITERAL_DEPTH:
        raise ValueError("too deeply nested")
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, bool, int, float)):
            return node.value
        raise ValueError("unsupported constant")
    if isinstance(node, ast.Name) and node.id in _PYTHON_NAMES:
        return _PYTHON_NAMES[node.id]
    if isinstance(node, ast.Dict):
        result = {}
        for key, value in zip(node.keys, node.values):
            if key is None:
                raise ValueError("dict unpacking")
            result[_literal(key, depth + 1)] = _literal(value, depth + 1)
        return result
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item, depth + 1) for item in node.elts]
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, (ast.USub, ast.UAdd))
        and isinstance(node.operand, ast.Constant)
        and isinstance(node.operand.value, (int, float))
        and not isinstance(node.operand.value, bool)
    ):
        value = node.operand.value
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("not a literal")


def _load(source: str) -> Any:
    """JSON first, then a Python-literal reading; ``_FAILED`` when neither works."""
    try:
        return json.loads(source)
    except Exception:  # ValueError, RecursionError, MemoryError: all mean "not this way"
        pass
    try:
        # Invalid escape sequences in model text would otherwise print compiler warnings.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(source.strip(), mode="eval")
        return _literal(tree.body, 0)
    except Exception:
        return _FAILED


def _looks_like_call(value: Any) -> bool:
    return isinstance(value, dict) and ("name" in value or "function" in value)


def _interpret(call: Mapping) -> ParsedAction:
    """Judge a call-shaped object: right tool, then a valid action argument."""
    body = call
    function = call.get("function")
    if isinstance(function, Mapping):
        body = function
    name = body.get("name")
    if name is None:
        return _fail(ParseError.WRONG_TOOL, "tool call has no name")
    if not isinstance(name, str):
        return _fail(ParseError.WRONG_TOOL, f"tool name is not a string: {_snippet(name)}")
    if name.strip().lower() != TOOL_NAME:
        return _fail(ParseError.WRONG_TOOL, f"unknown tool {_snippet(name)}")

    arguments = None
    for source in (body, call):
        for key in ("arguments", "parameters"):
            if source.get(key) is not None:
                arguments = source.get(key)
                break
        if arguments is not None:
            break
    # OpenAI-style servers send arguments as a JSON string, occasionally double-encoded.
    for _ in range(2):
        if not isinstance(arguments, str):
            break
        if not arguments.strip():
            arguments = {}
            break
        loaded = _load(arguments[:_MAX_ANSWER_CHARS])
        if loaded is _FAILED:
            return _fail(
                ParseError.BAD_JSON, f"arguments are not valid JSON: {_snippet(arguments)}"
            )
        arguments = loaded
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, Mapping):
        return _fail(ParseError.BAD_ACTION, f"arguments are not an object: {_snippet(arguments)}")

    action = arguments.get("action")
    if action is None:
        return _fail(ParseError.BAD_ACTION, "missing 'action' argument")
    if isinstance(action, str):
        chosen = _ACTIONS_BY_NAME.get(action.strip().lower())
        if chosen is not None:
            return _ok(chosen)
    return _fail(ParseError.BAD_ACTION, f"action must be 'hit' or 'stick', got {_snippet(action)}")


def _field(obj: Any, key: str) -> Any:
    """Read ``key`` from a dict or an attribute-style object (e.g. an openai SDK model)."""
    try:
        if isinstance(obj, Mapping):
            return obj.get(key)
        if obj is None or isinstance(obj, (str, bytes, bytearray, int, float, list, tuple)):
            return None
        return getattr(obj, key, None)
    except Exception:
        return None


def _parse_native(tool_calls: list | tuple) -> ParsedAction:
    first = tool_calls[0]
    function = _field(first, "function")
    source = function if function is not None else first
    name = _field(source, "name")
    arguments = _field(source, "arguments")
    if arguments is None:
        arguments = _field(source, "parameters")
    if name is None and arguments is None:
        return _fail(ParseError.BAD_JSON, f"unreadable native tool call {_snippet(first)}")
    return _interpret({"name": name, "arguments": arguments})


def _parse_text(text: str) -> ParsedAction:
    thought, rest = split_thinking(text)
    if not rest:
        if thought:
            return _fail(ParseError.NO_CALL, "no tool call after the thinking block")
        return _fail(ParseError.NO_CALL, "empty response")
    answer = _drop_think_blocks(rest[:_MAX_ANSWER_CHARS])

    # 1. Inside <tool_call> tags. A missing closing tag runs to the next opening tag or the end.
    openings = []
    for match in _CALL_OPEN.finditer(answer):
        openings.append(match)
        if len(openings) > _MAX_TAG_REGIONS:
            break
    first_unnamed: dict | None = None
    tag_problem = ""
    for index, opening in enumerate(openings[:_MAX_TAG_REGIONS]):
        limit = openings[index + 1].start() if index + 1 < len(openings) else len(answer)
        closing = _CALL_CLOSE.search(answer, opening.end(), limit)
        region = answer[opening.end() : closing.start() if closing else limit]
        spans = _objects(region, _MAX_OBJECTS_PER_REGION)
        if not spans and not tag_problem:
            tag_problem = f"no JSON object inside <tool_call>: {_snippet(region.strip())}"
        for span, closed in spans:
            value = _load(span) if closed else _FAILED
            if _looks_like_call(value):
                return _interpret(value)
            if isinstance(value, dict):
                if first_unnamed is None:
                    first_unnamed = value
            elif not tag_problem:
                reason = "invalid JSON" if closed else "unterminated JSON object"
                tag_problem = f"{reason} inside <tool_call>: {_snippet(span)}"
    if first_unnamed is not None:
        return _interpret(first_unnamed)

    # 2. A bare object that names a tool: code fences, Mistral-style lists, plain JSON.
    bare_problem = ""
    for span, closed in _objects(answer, _MAX_BARE_OBJECTS):
        value = _load(span) if closed else _FAILED
        if _looks_like_call(value):
            return _interpret(value)
        if value is _FAILED and not bare_problem and _CALL_KEY.search(span):
            reason = "invalid JSON" if closed else "unterminated JSON object"
            bare_problem = f"{reason} in tool call: {_snippet(span)}"

    if openings:
        return _fail(ParseError.BAD_JSON, tag_problem or "unreadable <tool_call>")
    if bare_problem:
        return _fail(ParseError.BAD_JSON, bare_problem)
    return _fail(ParseError.NO_CALL, "no <tool_call> or JSON tool call found")


def parse_action(text: str | None, tool_calls: list | None = None) -> ParsedAction:
    """Turn a model's answer into an action, or a classified failure; never raises.

    Native ``tool_calls`` from a server-side parser take precedence: when a server returns
    them, the text content is empty or commentary. Only the first call is played, since a
    Blackjack turn has exactly one decision.
    """
    try:
        if isinstance(tool_calls, (list, tuple)) and tool_calls:
            return _parse_native(tool_calls)
        as_text = _as_text(text)
        if as_text is None:
            return _fail(ParseError.NO_CALL, f"response is not text: {_snippet(text)}")
        return _parse_text(as_text)
    except Exception as exc:  # a last line of defence: a bad answer must never end a run
        return _fail(ParseError.BAD_JSON, f"unparseable response ({type(exc).__name__})")
