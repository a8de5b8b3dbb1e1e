"""Clients of the trajectory API: `EnvClient` for environment workers, `TrainerClient` for trainers.

The environment side is where Atropos loses data: a send that fails three times is logged
and dropped. `EnvClient` retries transient failures (connection errors, timeouts, 5xx, 503
and 429 with their Retry-After) with jittered exponential backoff, sends every post with an
Idempotency-Key so a retry is never queued twice, and, given an outbox, parks what it still
cannot deliver on disk and sends it, in order, once the API answers again. Refusals (4xx)
are not retried: they raise `ApiRejected` with the server's explanation.
"""

from __future__ import annotations

import asyncio
import gzip
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pydantic_core

from blackjack_rl.httpclient import http_client
from blackjack_rl.retry import RetriesExhausted, Retryable, RetryPolicy, retry_after_seconds, retry_async, retry_sync
from blackjack_rl.api.models import (
    Registration,
    RegisterEnv,
    RegisterEnvResponse,
    StatusEnvResponse,
    StatusResponse,
)
from blackjack_rl.api.outbox import Outbox, Rejected

WAIT_FOR_TRAINER = "wait for trainer to start"


class ApiRejected(Exception):
    """The API refused the request (4xx other than 429): fix the request, retrying won't help."""

    def __init__(self, status: int, detail: str, method: str = "", path: str = "") -> None:
        super().__init__(f"{method} {path} refused with {status}: {detail}".strip())
        self.status = status
        self.detail = detail


class ApiUnavailable(Exception):
    """The API could not be reached, or stayed busy, through every retry."""


@dataclass(frozen=True)
class SendResult:
    """What became of groups handed to `EnvClient.submit`."""

    sent_groups: int  # delivered now (including earlier parked ones flushed first)
    parked_groups: int  # waiting in the outbox
    rejected: list[Rejected]  # refused by the API during this call, kept in the outbox's rejected table


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return str(body)[:500]


def _checked(response: httpx.Response, method: str, path: str) -> httpx.Response:
    """The response when it succeeded; ApiRejected for a refusal; Retryable for 429, 503 and 5xx."""
    status = response.status_code
    if status < 400:
        return response
    if status not in (429, 503) and status < 500:
        raise ApiRejected(status, _detail(response), method, path)
    raise Retryable(f"{status}: {_detail(response)}", retry_after_seconds(response.headers.get("retry-after")))


def _json_fallback(value: Any) -> Any:
    """numpy scalars and arrays (scores, logprobs) serialize as plain numbers and lists."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot send a {type(value).__name__} in a group")


def encode_groups(groups: Sequence[Mapping[str, Any]], level: int = 1) -> bytes:
    """Gzip-compressed JSON list. Level 1: ~10x faster than gzip's default, nearly as small."""
    return gzip.compress(pydantic_core.to_json(list(groups), fallback=_json_fallback), compresslevel=level)


class EnvClient:
    """Async client for one environment worker. Use one per worker, as an async context manager."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        outbox: Outbox | str | Path | None = None,
        park_after: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._http = http_client(base_url, token=token, timeout=timeout_s, transport=transport)
        self.retry = retry or RetryPolicy()
        # submit() gives up sooner than send_groups(): a worker should park and keep playing.
        self.park_after = park_after or RetryPolicy(attempts=3, max_elapsed_s=5.0)
        self.outbox = Outbox(outbox) if isinstance(outbox, (str, Path)) else outbox
        self.env_id: int | None = None
        self.registration: RegisterEnvResponse | None = None

    async def __aenter__(self) -> EnvClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()
        if self.outbox is not None:
            self.outbox.close()

    # --- HTTP with retries ----------------------------------------------------------------

    async def _request(
        self, method: str, path: str, *, retry: RetryPolicy | None = None, **kwargs: Any
    ) -> httpx.Response:
        try:
            return await retry_async(retry or self.retry, lambda _: self._attempt(method, path, **kwargs))
        except RetriesExhausted as exc:
            raise ApiUnavailable(f"{method} {path} {exc}") from None

    async def _attempt(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:  # connection refused/reset, timeouts
            raise Retryable(f"{type(exc).__name__}: {exc}") from None
        return _checked(response, method, path)

    # --- environment protocol -------------------------------------------------------------

    async def register_env(
        self, request: RegisterEnv, *, poll_interval_s: float = 1.0, timeout_s: float | None = None
    ) -> RegisterEnvResponse:
        """Register, waiting (polling) while the API says the trainer has not started.

        `timeout_s` bounds the whole wait, an API that cannot be reached included: each attempt's
        retries stop at the deadline, so a worker told to give up after a second does not spend
        its retry policy's ~15 s first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ApiUnavailable(f"the trainer did not start within {timeout_s:g} s")
            retry = self.retry if left is None else self.retry.within(left)
            try:
                async with asyncio.timeout(left):
                    response = await self._request("POST", "/register-env", retry=retry, json=request.model_dump())
            except TimeoutError:
                raise ApiUnavailable(f"the API did not answer POST /register-env within {timeout_s:g} s") from None
            answer = RegisterEnvResponse.model_validate(response.json())
            if answer.status == "success" and answer.env_id is not None:
                self.env_id = answer.env_id
                self.registration = answer
                return answer
            if answer.status != WAIT_FOR_TRAINER:
                raise ApiRejected(response.status_code, f"unexpected registration status {answer.status!r}")
            if deadline is not None and time.monotonic() >= deadline:
                raise ApiUnavailable(f"the trainer did not start within {timeout_s:g} s")
            await asyncio.sleep(poll_interval_s)

    async def status_env(self) -> StatusEnvResponse:
        env_id = self._require_env()
        # Atropos' run-api reads env_id only from a JSON body on GET; proxies may drop such a
        # body, and our API also takes the query parameter. Send both, so either server works.
        response = await self._request("GET", "/status-env", params={"env_id": env_id}, json={"env_id": env_id})
        return StatusEnvResponse.model_validate(response.json())

    async def status(self) -> StatusResponse:
        return StatusResponse.model_validate((await self._request("GET", "/status")).json())

    async def disconnect(self) -> None:
        if self.env_id is not None:
            await self._request("POST", "/disconnect-env", json={"env_id": self.env_id})

    def _require_env(self) -> int:
        if self.env_id is None:
            raise RuntimeError("register_env() first: the API identifies this worker by its env_id")
        return self.env_id

    def _with_env(self, groups: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        if self.env_id is None:
            return list(groups)
        return [g if g.get("env_id") is not None else {**g, "env_id": self.env_id} for g in groups]

    async def _post_body(self, body: bytes, key: str, retry: RetryPolicy | None = None) -> dict[str, Any]:
        response = await self._request(
            "POST",
            "/scored_data_list",
            content=body,
            headers={"Content-Type": "application/json", "Content-Encoding": "gzip", "Idempotency-Key": key},
            retry=retry,
        )
        return dict(response.json())

    async def send_groups(self, groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """POST the groups in one request (all or none are queued), retrying transient failures.

        Raises ApiRejected for a refusal, ApiUnavailable when retries run out. No outbox.
        """
        return await self._post_body(encode_groups(self._with_env(groups)), uuid.uuid4().hex)

    async def submit(self, groups: Sequence[Mapping[str, Any]], key: str | None = None) -> SendResult:
        """Deliver groups, or park them in the outbox: nothing handed here is lost.

        Tries briefly (`park_after`), then parks instead of blocking the worker. Order is
        kept: while older posts wait in the outbox, new ones queue behind them. A refused
        post goes to the outbox's rejected table and is reported in the result. `key` is the
        Idempotency-Key (default: a new one); a caller that may submit the same data again
        after a crash passes a key derived from the data's identity.
        """
        if self.outbox is None:
            raise RuntimeError("submit() needs an outbox; use send_groups() to send without one")
        body, key = encode_groups(self._with_env(groups)), key or uuid.uuid4().hex
        if self.outbox.pending_posts():
            self.outbox.put(key, body, len(groups))
            return await self.flush_outbox(self.park_after)
        try:
            await self._post_body(body, key, self.park_after)
        except ApiUnavailable:
            self.outbox.put(key, body, len(groups))
            return SendResult(0, self.outbox.pending_groups(), [])
        except ApiRejected as exc:
            self.outbox.put(key, body, len(groups))
            parked = self.outbox.oldest()
            assert parked is not None
            self.outbox.reject(parked, exc.status, exc.detail)
            return SendResult(0, 0, [Rejected(parked.id, parked.n_groups, exc.status, exc.detail)])
        return SendResult(len(groups), 0, [])

    async def flush_outbox(self, retry: RetryPolicy | None = None) -> SendResult:
        """Send parked posts oldest first; stop (keeping the rest) when the API is unreachable."""
        if self.outbox is None:
            return SendResult(0, 0, [])
        sent = 0
        rejected: list[Rejected] = []
        while (parked := self.outbox.oldest()) is not None:
            try:
                await self._post_body(parked.body, parked.key, retry)
            except ApiRejected as exc:
                self.outbox.reject(parked, exc.status, exc.detail)
                rejected.append(Rejected(parked.id, parked.n_groups, exc.status, exc.detail))
                continue
            except ApiUnavailable:
                break
            self.outbox.remove(parked)
            sent += parked.n_groups
        return SendResult(sent, self.outbox.pending_groups(), rejected)


@dataclass(frozen=True)
class Batch:
    """A batch as the trainer receives it."""

    batch_id: int | None  # None from servers that do not number batches (Atropos' run-api)
    step: int  # -1 when the server does not say
    redelivered: bool  # sent before and not acknowledged: the trainer may have seen it
    groups: list[dict[str, Any]]

    @property
    def sequences(self) -> int:
        return sum(len(g["tokens"]) for g in self.groups)


class TrainerClient:
    """Small synchronous trainer-side client: register, then pull batches.

    It acknowledges explicitly (`GET /batch?ack=<last batch id>`): a batch whose response
    was lost is sent again rather than skipped.
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout_s: float = 60.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._http = http_client(base_url, token=token, timeout=timeout_s, transport=transport, sync=True)
        self.retry = retry or RetryPolicy()
        self.last_batch_id: int | None = None

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, *, retry: RetryPolicy | None = None, **kwargs: Any) -> httpx.Response:
        def attempt(_: int) -> httpx.Response:
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                raise Retryable(f"{type(exc).__name__}: {exc}") from None
            return _checked(response, method, path)

        try:
            return retry_sync(retry or self.retry, attempt)
        except RetriesExhausted as exc:
            raise ApiUnavailable(f"{method} {path} {exc}") from None

    def register(self, registration: Registration | Mapping[str, Any]) -> int:
        payload = registration.model_dump() if isinstance(registration, Registration) else dict(registration)
        return int(self._request("POST", "/register", json=payload).json()["uuid"])

    def get_batch(self, retry: RetryPolicy | None = None) -> Batch | None:
        """The next batch, or None when the queue cannot fill one yet."""
        ack = self.last_batch_id if self.last_batch_id is not None else 0
        data = pydantic_core.from_json(self._request("GET", "/batch", retry=retry, params={"ack": ack}).content)
        if not data.get("batch"):  # null, or [] before a trainer registered (as run-api answers)
            return None
        batch_id = data.get("batch_id")
        batch = Batch(
            None if batch_id is None else int(batch_id),
            int(data.get("step", -1)),
            bool(data.get("redelivered", False)),
            data["batch"],
        )
        if batch.batch_id is not None:
            self.last_batch_id = batch.batch_id
        return batch

    def wait_for_batch(self, timeout_s: float, poll_s: float = 0.05) -> Batch:
        """Poll until a batch comes; `timeout_s` bounds the whole wait, retries of an API that
        cannot answer included (as `EnvClient.register_env`'s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            batch = self.get_batch(self.retry.within(deadline - time.monotonic()))
            if batch is not None:
                return batch
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no batch within {timeout_s} s")
            time.sleep(poll_s)

    def status(self) -> StatusResponse:
        return StatusResponse.model_validate(self._request("GET", "/status").json())

    def info(self) -> dict[str, Any]:
        return dict(self._request("GET", "/info").json())
