"""Any OpenAI-compatible chat server: vLLM, SGLang, llama.cpp's server, hosted APIs.

The server returns text (or native `tool_calls` when it runs a tool parser), so the
trajectory's ids come from the model's own tokenizer and chat template
(`--tokenizer`); logprobs are not available on this path.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx

from ..protocol import TOOLS
from .base import InferenceError, Reply, Turn

_RETRYABLE_STATUS = {408, 409, 429, 500, 502, 503, 504}


class OpenAIChatPolicy:
    """One pooled HTTP client for the policy's lifetime; retries only what can succeed later."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 64,
        timeout: float = 60.0,
        retries: int = 2,
        native_tools: bool = False,
        extra_body: dict[str, Any] | None = None,
        max_connections: int = 64,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = model
        self.temperature, self.top_p, self.max_tokens = temperature, top_p, max_tokens
        self.retries = retries
        self.native_tools = native_tools
        self.extra_body = extra_body or {}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(10.0, timeout)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    def generation_params(self) -> dict[str, Any]:
        return {
            "policy": "openai",
            "model": self.model,
            "base_url": self.base_url,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
            "native_tools": self.native_tools,
            "logprobs": "unavailable on the chat-completions path (0.0 recorded)",
        }

    async def respond(self, turn: Turn) -> Reply:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": list(turn.messages),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
            "seed": turn.seed & 0x7FFFFFFF,
            "n": 1,
            **self.extra_body,
        }
        if self.native_tools:
            body["tools"] = TOOLS
        data = await self._post("/chat/completions", body)
        try:
            choice = data["choices"][0]
            message = choice.get("message") or {}
            text = message.get("content") or ""
            tool_calls = message.get("tool_calls") or None
            finish = choice.get("finish_reason") or "stop"
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise InferenceError(f"malformed chat completion from {self.base_url}: {str(data)[:200]}") from exc
        if tool_calls and not text.strip():
            text = _hermes_text(tool_calls)  # what a Hermes-format model wrote before the server parsed it
        return Reply(text=text, tool_calls=tool_calls, finish_reason="length" if finish == "length" else "stop")

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        last_error = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(min(8.0, 0.25 * 2 ** (attempt - 1)) * (0.5 + random.random()))
            try:
                resp = await self._client.post(path, json=body)
            except (httpx.TimeoutException, httpx.TransportError) as exc:
                last_error = f"{type(exc).__name__}: {exc}"
                continue
            if resp.status_code in _RETRYABLE_STATUS:
                last_error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            if resp.status_code >= 400:
                raise InferenceError(
                    f"{self.base_url}{path} refused the request: HTTP {resp.status_code}: {resp.text[:300]}"
                )
            try:
                return resp.json()
            except ValueError as exc:
                raise InferenceError(f"{self.base_url}{path} answered with invalid JSON: {resp.text[:200]}") from exc
        raise InferenceError(f"{self.base_url}{path} failed after {self.retries + 1} attempts: {last_error}")

    async def aclose(self) -> None:
        await self._client.aclose()


def _hermes_text(tool_calls: list[Any]) -> str:
    parts = []
    for call in tool_calls:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        parts.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}) + "\n</tool_call>")
    return "\n".join(parts)
