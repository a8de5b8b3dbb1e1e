"""The one way our clients open an httpx connection to a server: base URL, bearer token, timeouts.

Built once per server and kept for the client's lifetime (a client per request costs more
CPU than the request). The connect timeout is separate and short by default: a server that
is not there should be found out in seconds, one that is slow to answer gets `timeout`.
"""

from __future__ import annotations

from typing import Literal, overload

import httpx


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


@overload
def http_client(base_url: str, *, token: str | None = ..., timeout: float = ..., connect_timeout: float | None = ...,
                transport: httpx.AsyncBaseTransport | None = ..., sync: Literal[False] = ...) -> httpx.AsyncClient: ...


@overload
def http_client(base_url: str, *, token: str | None = ..., timeout: float = ..., connect_timeout: float | None = ...,
                transport: httpx.BaseTransport | None = ..., sync: Literal[True]) -> httpx.Client: ...


def http_client(base_url, *, token=None, timeout=30.0, connect_timeout=None, transport=None, sync=False):
    """An httpx client for one server; `sync` for blocking callers (the trainer's client).
    `connect_timeout` None: the same as `timeout`."""
    limits = httpx.Timeout(timeout, connect=timeout if connect_timeout is None else min(connect_timeout, timeout))
    cls = httpx.Client if sync else httpx.AsyncClient
    return cls(base_url=base_url, headers=bearer(token), timeout=limits, transport=transport)
