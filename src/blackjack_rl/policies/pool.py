"""A pool of inference servers: weighted least-loaded routing, one cap, bounded retries, quarantine.

Why it looks like this:
- One `httpx.AsyncClient` per server for the pool's lifetime: building a client per
  request costs more CPU than the rest of an episode.
- Each request takes exactly one slot on exactly one server and holds nothing else
  while it waits for it; the slot is released before any retry backoff. No nested
  limits means no deadlock at any cap, down to 1. httpx's own connection limit is set
  to the cap, so it never becomes a second, hidden queue.
- Only failures that can succeed later are retried: 5xx, 408, timeouts and broken
  connections, with jittered exponential backoff, preferring another server. A 4xx
  or a malformed body is returned as an error at once.
- A server that fails `quarantine_after` times in a row is taken out of rotation and
  probed (`GET /v1/models`) after a backoff that doubles with every relapse, until a
  real request succeeds again. With every server quarantined a request fails at once
  with an error naming each server and its last error, instead of hanging (a probe
  already under way is waited for, so a server that is back loses no work).
- Sticky routing: a request may carry a routing key (`affinity_key`: the episode's first
  user message, so every turn of an episode and every answer of a group's shared prompt
  share it). Keyed requests go to the key's first choice by weighted rendezvous hashing
  while it is healthy and below its cap, so that server's prefix cache holds the
  episode's history; otherwise to the key's next choice, in the same order for every
  request of the key (so a failover moves a key once, to one place). No table of keys is
  kept: every process sharing the server list routes a key to the same server.
- Nothing is logged on the success path; quarantine and recovery are logged once each.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import httpcore
import httpx

from blackjack_rl.httpclient import http_client
from blackjack_rl.retry import RetriesExhausted, Retryable, RetryPolicy, retry_after_seconds, retry_async
from blackjack_rl.policies.base import InferenceError

log = logging.getLogger(__name__)

try:  # optional: about 10x faster on bodies that are mostly token ids
    import orjson
except ImportError:  # pragma: no cover - depends on the environment
    orjson = None


def _dumps(obj: Any) -> bytes:
    if orjson is not None:
        try:
            return orjson.dumps(obj)
        except TypeError:  # a type orjson does not take (numpy ints...): the standard library does
            pass
    return json.dumps(obj, separators=(",", ":")).encode()


_loads = orjson.loads if orjson is not None else json.loads

_JSON_HEADERS = {"Content-Type": "application/json"}


class NoHealthyServer(InferenceError):
    """Every server of the pool is quarantined."""


class ServerBusy(InferenceError):
    """Every healthy server stayed at its concurrency cap for `acquire_timeout` seconds."""


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """One endpoint: its URL (with or without the trailing `/v1`), its routing weight and cap."""

    url: str
    weight: float = 1.0
    max_concurrency: int | None = None  # None: the pool's default

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"server URL {self.url!r} must start with http:// or https://")
        if not self.weight > 0:
            raise ValueError(f"server {self.url}: weight must be > 0, got {self.weight}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"server {self.url}: max_concurrency must be >= 1")


def affinity_key(messages: Sequence[dict]) -> str | None:
    """The routing key of a conversation: its first user message.

    Every turn of an episode and every answer of a group start with it, and everything a
    server can reuse from its prefix cache follows the (shared) system prompt and it; two
    deals that open on the same hand share it too, and so share that prefix. None (no
    user message yet): routed by load alone.
    """
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            return content if isinstance(content, str) else json.dumps(content, sort_keys=True)
    return None


def rendezvous_order(key: str, urls: Sequence[str], weights: Sequence[float]) -> list[int]:
    """Server indices, best first, by weighted rendezvous (highest-random-weight) hashing.

    Each server's score is -weight / ln(u), u uniform in (0, 1) from a hash of (key, url):
    a key's first choice is server i with probability weight_i / sum(weights), and removing
    a server moves only the keys that chose it. The hash is stable across processes.
    """
    scores = []
    for i, (url, weight) in enumerate(zip(urls, weights)):
        digest = hashlib.blake2b(f"{url}\x00{key}".encode(), digest_size=8).digest()
        u = (int.from_bytes(digest, "big") + 0.5) / 2**64
        scores.append((-weight / math.log(u), i))
    return [i for _, i in sorted(scores, reverse=True)]


def server_root(url: str) -> str:
    """The server's root URL: OpenAI routes live under `/v1`, native ones (SGLang, llama.cpp) at the root."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class _Server:
    """Mutable per-server state; only touched from the event loop, so no locks."""

    __slots__ = ("url", "root", "weight", "cap", "client", "in_flight", "failures", "strikes",
                 "quarantined_until", "probing", "last_error", "requests", "errors", "keyed", "spilled_in")

    def __init__(self, spec: ServerSpec, cap: int, client: httpx.AsyncClient) -> None:
        self.url = spec.url
        self.root = server_root(spec.url)
        self.weight = spec.weight
        self.cap = spec.max_concurrency or cap
        self.client = client
        self.in_flight = 0
        self.failures = 0  # consecutive failed requests
        self.strikes = 0  # quarantines since the last successful request
        self.quarantined_until = 0.0  # 0.0: healthy
        self.probing = False
        self.last_error = ""
        self.requests = 0
        self.errors = 0
        self.keyed = 0  # keyed requests served here as the key's first choice
        self.spilled_in = 0  # keyed requests served here although another server was the key's first choice


class ServerPool:
    """Sends JSON requests to the least-loaded healthy server, within each server's cap."""

    def __init__(
        self,
        servers: Sequence[ServerSpec],
        *,
        api_key: str | None = None,
        timeout: float = 60.0,
        connect_timeout: float = 5.0,
        retries: int = 2,
        max_concurrency: int = 128,
        acquire_timeout: float | None = None,
        quarantine_after: int = 3,
        quarantine_s: float = 2.0,
        max_quarantine_s: float = 60.0,
        backoff_s: float = 0.25,
        max_backoff_s: float = 8.0,
        probe_path: str = "/v1/models",
        sticky: bool = True,
    ) -> None:
        if not servers:
            raise ValueError("the server pool needs at least one server (--server URL[,WEIGHT])")
        if len({s.url for s in servers}) != len(servers):
            raise ValueError("the same server URL is listed twice; give it a higher weight instead")
        if max_concurrency < 1 or retries < 0 or quarantine_after < 1:
            raise ValueError("max_concurrency and quarantine_after must be >= 1, retries >= 0")
        self.timeout = timeout
        self.acquire_timeout = acquire_timeout if acquire_timeout is not None else timeout
        self.quarantine_after = quarantine_after
        self.quarantine_s, self.max_quarantine_s = quarantine_s, max_quarantine_s
        self.probe_path = probe_path
        self.sticky = sticky
        # Failures are counted per server too (quarantine), so the retry loop never waits for long.
        self.retry = RetryPolicy(attempts=retries + 1, base_delay_s=backoff_s, max_delay_s=max_backoff_s,
                                 max_elapsed_s=None)
        self._servers: list[_Server] = []
        for spec in servers:
            cap = spec.max_concurrency or max_concurrency
            client = http_client(server_root(spec.url), token=api_key, timeout=timeout, connect_timeout=connect_timeout,
                                 transport=_transport(cap))
            self._servers.append(_Server(spec, max_concurrency, client))
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._turn = 0  # rotates ties, so equally loaded servers share the work
        self._closed = False
        self._orders: dict[str, tuple[int, ...]] = {}  # key -> rendezvous order (bounded, see _order)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self._servers]

    async def post(self, path: str, body: dict[str, Any], key: str | None = None) -> Any:
        """POST `body` as JSON to `path` (relative to a server's root) and return the decoded answer.

        `key` (see `affinity_key`) routes the request stickily; without it, a chat body's
        first user message is the key. Raises InferenceError (or its subclasses NoHealthyServer, ServerBusy) with a message
        that says what failed and what to check; never returns a partial answer.
        """
        if self._closed:
            raise InferenceError("the server pool is closed")
        content = _dumps(body)
        if key is None and self.sticky and isinstance(body.get("messages"), list):
            key = affinity_key(body["messages"])
        order = self._order(key) if self.sticky and key is not None else None
        failed_on: list[_Server] = []

        async def attempt(_: int) -> Any:
            server = await self._acquire(failed_on, order)
            retry_after = None
            try:
                response = await server.client.post(path, content=content, headers=_JSON_HEADERS)
            except httpx.TimeoutException as exc:
                error = f"{server.root}{path}: timed out after {self.timeout:g}s ({type(exc).__name__})"
            except httpx.TransportError as exc:
                error = f"{server.root}{path}: {type(exc).__name__}: {exc or 'connection failed'}"
            else:
                status = response.status_code
                if status < 400:
                    try:
                        data = _loads(response.content)
                    except ValueError:
                        self._failed(server, f"invalid JSON from {path}")
                        raise InferenceError(
                            f"{server.root}{path} answered HTTP {status} with invalid JSON: {response.text[:200]!r}"
                        ) from None
                    self._succeeded(server)
                    return data
                if status < 500 and status != 408:
                    self._succeeded(server)  # the server is fine; the request is wrong
                    raise InferenceError(
                        f"{server.root}{path} refused the request: HTTP {status}: {response.text[:300]}. "
                        "Client errors are not retried: check the model name, the server's API "
                        "(--server-api) and the sampling parameters."
                    )
                error = f"{server.root}{path}: HTTP {status}: {response.text[:200]}"
                retry_after = retry_after_seconds(response.headers.get("retry-after")) if status == 503 else None
            finally:
                self._release(server)
            self._failed(server, error)
            failed_on.append(server)
            raise Retryable(error, retry_after)

        try:
            return await retry_async(self.retry, attempt)
        except RetriesExhausted as exc:
            raise InferenceError(f"request failed after {exc.attempts} attempts; last error: {exc.problem}") from None

    async def post_to(self, server_url: str, path: str, body: dict[str, Any], timeout: float = 30.0) -> httpx.Response:
        """One plain POST to one server, outside routing, retries and health (capability probes)."""
        server = next((s for s in self._servers if s.url == server_url), None)
        if server is None:
            raise ValueError(f"{server_url} is not in the pool")
        return await server.client.post(path, json=body, timeout=min(timeout, self.timeout))

    def healthy_urls(self) -> list[str]:
        return [s.url for s in self._servers if not s.quarantined_until]

    def snapshot(self) -> list[dict[str, Any]]:
        """Each server's state, for status lines and error messages."""
        return [
            {
                "url": s.url,
                "weight": s.weight,
                "cap": s.cap,
                "in_flight": s.in_flight,
                "healthy": not s.quarantined_until,
                "requests": s.requests,
                "errors": s.errors,
                "sticky_first_choice": s.keyed,
                "sticky_spilled_in": s.spilled_in,
                "last_error": s.last_error or None,
            }
            for s in self._servers
        ]

    async def aclose(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        for s in self._servers:
            await s.client.aclose()

    # -- routing -------------------------------------------------------------------

    def _order(self, key: str) -> tuple[int, ...]:
        order = self._orders.get(key)
        if order is None:
            if len(self._orders) >= 65536:  # keys are hands, so few; bound it anyway
                self._orders.clear()
            order = self._orders[key] = tuple(
                rendezvous_order(key, [s.url for s in self._servers], [s.weight for s in self._servers]))
        return order

    async def _acquire(self, avoid: Iterable[_Server], order: tuple[int, ...] | None = None) -> _Server:
        """Take one slot: on the key's first usable choice when `order` is given, else on the
        least-loaded healthy server; wait (bounded) if all are at their cap."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.acquire_timeout
        while True:
            server = self._pick(loop.time(), avoid) if order is None else self._pick_sticky(loop.time(), avoid, order)
            if server is not None:
                server.in_flight += 1
                server.requests += 1
                return server
            if self._closed:
                raise InferenceError("the server pool is closed")
            if not any(not s.quarantined_until for s in self._servers) and not any(s.probing for s in self._servers):
                raise NoHealthyServer(self._none_healthy_message(loop.time()))  # (a probe under way is waited for)
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise ServerBusy(
                    f"every healthy server stayed at its concurrency cap for {self.acquire_timeout:g}s "
                    f"({self._describe()}); raise the caps or lower the episode concurrency"
                )
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the result when a
                # cancellation arrives in the same turn as the slot, swallowing the user's Ctrl-C.
                async with asyncio.timeout(remaining):
                    await waiter
            except TimeoutError:
                pass
            finally:
                if not waiter.done():
                    waiter.cancel()
                try:
                    self._waiters.remove(waiter)
                except ValueError:
                    pass

    def _usable(self, s: _Server, now: float) -> bool:
        """Healthy and below its cap; a quarantined server whose time is up gets its probe started."""
        if s.quarantined_until:
            if now >= s.quarantined_until and not s.probing and not self._closed:
                self._spawn_probe(s)
            return False
        return s.in_flight < s.cap

    def _pick(self, now: float, avoid: Iterable[_Server]) -> _Server | None:
        servers = self._servers
        n = len(servers)
        avoid = tuple(avoid)
        best: _Server | None = None
        best_score = float("inf")
        start = self._turn = (self._turn + 1) % n
        for k in range(n):
            s = servers[(start + k) % n]
            if not self._usable(s, now):
                continue
            score = (s.in_flight + 1) / s.weight
            if avoid and s in avoid:
                score += 1e12  # retry elsewhere when anywhere else has room
            if score < best_score:
                best, best_score = s, score
        return best

    def _pick_sticky(self, now: float, avoid: Iterable[_Server], order: tuple[int, ...]) -> _Server | None:
        """The first server of the key's order that is healthy, below its cap and not already
        failed for this request; a server failed for it only when no other has room."""
        avoid = tuple(avoid)
        fallback: _Server | None = None
        for rank, i in enumerate(order):
            s = self._servers[i]
            if not self._usable(s, now):
                continue
            if avoid and s in avoid:
                fallback = fallback or s
                continue
            self._count_keyed(s, rank)
            return s
        if fallback is not None:
            self._count_keyed(fallback, order.index(self._servers.index(fallback)))
        return fallback

    @staticmethod
    def _count_keyed(server: _Server, rank: int) -> None:
        if rank == 0:
            server.keyed += 1
        else:
            server.spilled_in += 1

    def _release(self, server: _Server) -> None:
        server.in_flight -= 1
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _wake_all(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    # -- health --------------------------------------------------------------------

    def _succeeded(self, server: _Server) -> None:
        if server.failures or server.strikes:
            server.failures = server.strikes = 0

    def _failed(self, server: _Server, error: str) -> None:
        server.errors += 1
        server.failures += 1
        server.last_error = error
        if server.failures >= self.quarantine_after and not server.quarantined_until:
            self._quarantine(server)

    def _quarantine(self, server: _Server) -> None:
        delay = min(self.max_quarantine_s, self.quarantine_s * 2**server.strikes)
        server.strikes += 1
        server.quarantined_until = asyncio.get_running_loop().time() + delay
        log.warning("server %s quarantined for %.1fs after %d failures in a row; last error: %s",
                    server.url, delay, server.failures, server.last_error)
        self._wake_all()  # waiters re-check: they may now have to fail fast

    def _spawn_probe(self, server: _Server) -> None:
        server.probing = True
        task = asyncio.get_running_loop().create_task(self._probe(server))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _probe(self, server: _Server) -> None:
        try:
            response = await server.client.get(self.probe_path, timeout=min(self.timeout, 5.0))
            ok = response.status_code < 500
            error = f"probe {self.probe_path}: HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            ok, error = False, f"probe {self.probe_path}: {type(exc).__name__}: {exc}"
        finally:
            server.probing = False
        if ok:
            server.quarantined_until = 0.0
            server.failures = 0  # strikes stay until a real request succeeds
            log.warning("server %s is back in rotation (probe answered)", server.url)
            self._wake_all()
        else:
            server.last_error = error
            delay = min(self.max_quarantine_s, self.quarantine_s * 2**server.strikes)
            server.strikes += 1
            server.quarantined_until = asyncio.get_running_loop().time() + delay
            self._wake_all()  # requests waiting on this probe now fail fast

    def _describe(self) -> str:
        return "; ".join(f"{s.url}: {s.in_flight}/{s.cap} in flight" for s in self._servers)

    def _none_healthy_message(self, now: float) -> str:
        parts = [
            f"{s.url} (quarantined for {max(0.0, s.quarantined_until - now):.1f}s more; last error: {s.last_error})"
            for s in self._servers
        ]
        return (
            f"no healthy inference server: all {len(self._servers)} are quarantined after repeated failures: "
            + "; ".join(parts)
            + ". Check that the servers are running and reachable; they are probed and return on their own."
        )


def _transport(cap: int) -> httpx.AsyncHTTPTransport:
    """httpx's transport with `cap` connections, all kept alive, and linear-time connection assignment."""
    transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=cap, max_keepalive_connections=cap))
    pool = getattr(transport, "_pool", None)
    if type(pool) is httpcore.AsyncConnectionPool and all(
        hasattr(pool, name) for name in ("_requests", "_connections", "_max_connections", "_max_keepalive_connections")
    ):
        pool.__class__ = _LinearConnectionPool
    return transport


class _LinearConnectionPool(httpcore.AsyncConnectionPool):
    """httpcore's connection pool, assigning requests to connections in linear time.

    httpcore 1.0 rebuilds a list of every connection for every idle connection on every
    request (quadratic) and polls every idle socket for expiry each time; with 64
    requests in flight that was most of this process's CPU. Here: one pass, expiry
    checked only on the connection about to be reused (newest first), and a connection
    is never handed to two requests at once. Otherwise httpcore's rules: reuse an idle
    connection, else open one below `max_connections`, else replace an idle one, else wait.
    """

    def _assign_requests_to_connections(self) -> list[Any]:
        closing: list[Any] = []
        conns = [c for c in self._connections if not c.is_closed()]
        taken = {id(r.connection) for r in self._requests if r.connection is not None}
        for request in self._requests:
            if request.connection is not None:
                continue
            origin = request.request.url.origin
            chosen = None
            for i in range(len(conns) - 1, -1, -1):
                c = conns[i]
                if id(c) in taken or not c.can_handle_request(origin) or not c.is_available():
                    continue
                if c.has_expired():
                    closing.append(c)
                    continue
                chosen = c
                break
            if closing:
                conns = [c for c in conns if c not in closing]
            if chosen is None:
                if len(conns) >= self._max_connections:
                    idle = next((c for c in conns if id(c) not in taken and c.is_idle()), None)
                    if idle is None:
                        continue  # every connection is busy: this request waits
                    conns.remove(idle)
                    closing.append(idle)
                chosen = self.create_connection(origin)
                conns.append(chosen)
            request.assign_to_connection(chosen)
            taken.add(id(chosen))
        surplus = len(conns) - self._max_keepalive_connections
        if surplus > 0:
            for c in [c for c in conns if id(c) not in taken and c.is_idle()][:surplus]:
                conns.remove(c)
                closing.append(c)
        self._connections = conns
        return closing
