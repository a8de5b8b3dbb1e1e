"""What a chat-completions body holds and how its choices read as replies.

Apart from any HTTP client: the chat policy (aiohttp) and the completions policy (httpx), which
asks a chat endpoint where a server has no completions one, share them, and a command that never
talks chat pays for no client it does not use.
"""

from __future__ import annotations

import json
from typing import Any

from blackjack_rl.policies.base import InferenceError, Reply
from blackjack_rl.policies.sampling import Sampling


def chat_sampling(s: Sampling) -> dict[str, Any]:
    """The sampling fields of a chat-completions body, also recorded in `generation_params`.

    top_k and min_p are not OpenAI fields, but vLLM, SGLang and llama.cpp's servers take them
    in the same body; they are sent only when set, so a hosted API that refuses unknown fields
    is never sent them unasked, and a run that does not use them records what it did before.
    """
    params: dict[str, Any] = {"temperature": s.temperature, "top_p": s.top_p}
    if s.top_k > 0:
        params["top_k"] = s.top_k
    if s.min_p > 0:
        params["min_p"] = s.min_p
    params["max_tokens"] = s.max_tokens
    return params


def chat_replies(data: Any, source: str) -> list[Reply]:
    """The choices of a chat completion as replies, in `index` order.

    Servers differ in what they put in `message.content`: a string (the OpenAI shape),
    a list of content parts (some hosted APIs), or null next to native `tool_calls`.
    Parts become text. Any other shape is not an answer the model gave, so it raises
    InferenceError (the episode fails with this reason) instead of reaching the parser
    or the tokenizer as a non-string.
    """
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices:
        raise InferenceError(f"{source} answered without a `choices` list: {_snippet(data)}")
    order = sorted(range(len(choices)), key=lambda i: _index(choices[i], i))
    return [_choice_reply(choices[i], source) for i in order]


def _index(choice: Any, position: int) -> int:
    index = choice.get("index") if isinstance(choice, dict) else None
    return index if isinstance(index, int) and not isinstance(index, bool) else position


def _choice_reply(choice: Any, source: str) -> Reply:
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise InferenceError(f"{source} answered a choice without a `message` object: {_snippet(choice)}")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not (
        isinstance(tool_calls, list) and all(isinstance(call, dict) for call in tool_calls)
    ):
        raise InferenceError(f"{source} answered `tool_calls` that is not a list of objects: {_snippet(tool_calls)}")
    text = content_text(message.get("content"), source, bool(tool_calls))
    if tool_calls and not text.strip():
        text = _hermes_text(tool_calls)  # what a Hermes-format model wrote before the server parsed it
    return Reply(text=text, tool_calls=tool_calls or None,
                 finish_reason="length" if choice.get("finish_reason") == "length" else "stop")


def content_text(content: Any, source: str, has_tool_calls: bool = False) -> str:
    """`message.content` as text: a string, or the concatenated text of a list of content parts."""
    if isinstance(content, str):
        return _valid_unicode(content)
    if content is None:
        if has_tool_calls:
            return ""  # the OpenAI shape of a native tool call
        raise InferenceError(f"{source} answered with neither `content` nor `tool_calls`")
    if isinstance(content, list):
        pieces = []
        for part in content:
            piece = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) else None
            if not isinstance(piece, str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InferenceError(f"{source} answered a content part of type {kind!r} without text: {_snippet(part)}")
            pieces.append(piece)
        return _valid_unicode("".join(pieces))
    raise InferenceError(
        f"{source} answered `message.content` of type {type(content).__name__} (expected a string or a list of "
        f"content parts): {_snippet(content)}"
    )


def _valid_unicode(text: str) -> str:
    """Lone surrogates (a JSON `\\ud800` escape) become U+FFFD, as invalid UTF-8 bytes do when a
    server decodes them: the tokenizer, the parser and the output files all need valid text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= ch <= "\udfff" else ch for ch in text)
    return text


def _snippet(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _hermes_text(tool_calls: list[Any]) -> str:
    parts = []
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, dict) else None
        fn = fn if isinstance(fn, dict) else {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        parts.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}) + "\n</tool_call>")
    return "\n".join(parts)
