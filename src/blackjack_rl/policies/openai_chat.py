"""Any OpenAI-compatible chat server: vLLM, SGLang, llama.cpp's server, hosted APIs.

The server returns text (or native `tool_calls` when it runs a tool parser), so the
trajectory's ids come from the model's own tokenizer and chat template
(`--tokenizer`); logprobs are not available on this path.

The HTTP client is aiohttp: on this path the client is most of our CPU per episode, and
httpx's connection pool scans every connection for every request (quadratic in the
connections kept open: ~1 ms a request at 64), where aiohttp's costs a constant ~0.1 ms.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from blackjack_rl.contract.protocol import TOOLS
from blackjack_rl.retry import RetriesExhausted, Retryable, RetryPolicy, retry_after_seconds, retry_async
from blackjack_rl.policies.base import InferenceError, Reply, Turn
from blackjack_rl.policies.chat_body import chat_replies, chat_sampling
from blackjack_rl.policies.sampling import Sampling
from blackjack_rl.policies.structured import structured_output_fields

_RETRYABLE_STATUS = {408, 409, 429, 500, 502, 503, 504}


class OpenAIChatPolicy:
    """One pooled HTTP client for the policy's lifetime; retries only what can succeed later."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        sampling: Sampling = Sampling(),
        timeout: float = 60.0,
        retries: int = 2,
        native_tools: bool = False,
        extra_body: dict[str, Any] | None = None,
        max_connections: int = 64,
        structured_output: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = model
        self.sampling = sampling
        self.retry = RetryPolicy(attempts=retries + 1, base_delay_s=0.25, max_delay_s=8.0, max_elapsed_s=None)
        self.native_tools = native_tools
        self.extra_body = {**sampling.extra, **(extra_body or {})}
        # Constrained decoding for play and evaluation only: it changes what is sampled.
        self.structured_output = structured_output
        self._structured = structured_output_fields(structured_output) if structured_output else {}
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        # `sock_read` bounds each wait for the server, as httpx's read timeout did; `connect`
        # bounds waiting for a pooled connection plus opening it.
        self._timeout = aiohttp.ClientTimeout(total=None, connect=timeout, sock_connect=min(10.0, timeout),
                                              sock_read=timeout)
        self._max_connections = max_connections
        # aiohttp binds a session to the event loop that creates it, so it is opened on first use.
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def generation_params(self) -> dict[str, Any]:
        return {
            "policy": "openai",
            "model": self.model,
            "base_url": self.base_url,
            **chat_sampling(self.sampling),
            "native_tools": self.native_tools,
            "constrained": bool(self.structured_output),
            "structured_output": self.structured_output,
            "logprobs": "unavailable on the chat-completions path (0.0 recorded)",
        }

    async def respond(self, turn: Turn) -> Reply:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": list(turn.messages),
            **chat_sampling(self.sampling),
            "seed": turn.seed & 0x7FFFFFFF,
            "n": 1,
            **self.extra_body,
        }
        if self.native_tools:
            body["tools"] = TOOLS
        body.update(self._structured)
        data = await self._post("/chat/completions", body)
        return chat_replies(data, f"{self.base_url}/chat/completions")[0]

    def _open(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._loop = loop
            connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=self._max_connections)
            self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout, connector=connector,
                                                  skip_auto_headers=("User-Agent",), proxy=_env_proxy(self.base_url))
        return self._session

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        url = self.base_url + path
        data = json.dumps(body, separators=(",", ":")).encode()
        session = self._open()

        async def attempt(_: int) -> dict[str, Any]:
            try:
                async with session.post(url, data=data) as resp:
                    status, raw = resp.status, await resp.read()
                    retry_after = retry_after_seconds(resp.headers.get("Retry-After"))
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise Retryable(f"{type(exc).__name__}: {exc}") from None
            if status in _RETRYABLE_STATUS:
                raise Retryable(f"HTTP {status}: {_text(raw, 200)}", retry_after if status in (429, 503) else None)
            if status >= 400:
                raise InferenceError(f"{url} refused the request: HTTP {status}: {_text(raw, 300)}")
            try:
                return json.loads(raw)
            except ValueError as exc:
                raise InferenceError(f"{url} answered with invalid JSON: {_text(raw, 200)}") from exc

        try:
            return await retry_async(self.retry, attempt)
        except RetriesExhausted as exc:
            raise InferenceError(f"{url} failed after {exc.attempts} attempts: {exc.problem}") from None

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()


def _env_proxy(url: str) -> str | None:
    """The proxy the environment names for `url` (HTTP(S)_PROXY, NO_PROXY), as httpx used it.

    Read once per session: aiohttp's `trust_env` would look in the environment and in
    ~/.netrc (on a worker thread) for every request.
    """
    import urllib.request
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.hostname and urllib.request.proxy_bypass(parts.hostname):
        return None
    return urllib.request.getproxies().get(parts.scheme)


def _text(raw: bytes, limit: int) -> str:
    return raw[: limit * 4].decode("utf-8", errors="replace")[:limit]
