"""Scale-out on Ray: evaluations and datasets split into shards, serve workers as actors.

Ray is an optional extra (`pip install 'blackjack-rl[ray]'`): nothing else in the
package imports it, and `--ray` without it is a one-line error. Ray places and
restarts the work; the environment stays what it is locally (the same player, the same
seeds, the same writers), so a sharded run writes exactly what a local run writes.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from typing import Any, Iterator
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

INSTALL_HINT = "--ray needs Ray: pip install 'blackjack-rl[ray]'"
# `--ray` with no address: start a local cluster for this command only.
LOCAL = "local"
# Named actors (`serve:<worker id>`) live here, so `ray.get_actor` finds them from any driver.
NAMESPACE = "blackjack-rl"


class ClusterError(RuntimeError):
    """The cluster could not finish the job (no room, work lost too often, a worker failing): one line for the user."""


def task_error(ray: Any, exc: BaseException, what: str) -> ClusterError:
    """A call that raised inside an actor, as one line naming what failed and the original error."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return ClusterError(f"{what} failed: {type(cause).__name__}: {text[-1] if text else ''}")


def require_ray() -> Any:
    """The `ray` module, or an ImportError whose message is the one line to show the user."""
    try:
        import ray
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return ray


@contextlib.contextmanager
def connected(address: str) -> Iterator[Any]:
    """Join the cluster at `address` (`auto`: the one `ray start` runs on this node; `local`:
    start one for this process), and leave it afterwards (a local one is shut down)."""
    ray = require_ray()
    if ray.is_initialized():  # a caller (a test, a notebook) already joined one: use it, leave it up
        yield ray
        return
    kwargs: dict[str, Any] = {"log_to_driver": False, "include_dashboard": False, "namespace": NAMESPACE}
    if address not in (LOCAL, "auto"):
        _check_reachable(address)
    if address == LOCAL:  # a new instance even when this machine already runs a cluster
        ray.init(address="local", **kwargs)
    else:
        try:
            ray.init(address=address, **kwargs)
        except ConnectionError as exc:
            raise ValueError(f"--ray {address}: no Ray cluster there ({exc}); start one with `ray start --head`, "
                             "or give no address to start a local one") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """One connection to the cluster's port before Ray is asked to join it: for an address where
    nothing listens, ray.init retries for minutes, printing a warning every few seconds."""
    try:
        parts = urlsplit(address if "://" in address else f"//{address}")
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or port is None:
        raise ValueError(f"--ray {address}: expected HOST:PORT (the head's GCS port, e.g. 10.0.0.5:6379), "
                         "ray://HOST:PORT, auto, or no address to start a local cluster")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ValueError(f"--ray {address}: no Ray cluster answers there ({exc.strerror or exc}); start one with "
                         "`ray start --head`, or give no address to start a local one") from None


def node_failure_errors(ray: Any) -> tuple[type[BaseException], ...]:
    """Errors that mean the process or node running a call is gone (retry elsewhere),
    as opposed to a RayTaskError: the call itself raised (a bug; not retried)."""
    ex = ray.exceptions
    return tuple(
        getattr(ex, name)
        for name in ("RayActorError", "WorkerCrashedError", "NodeDiedError", "ObjectLostError", "OwnerDiedError",
                     "ActorUnavailableError", "LocalRayletDiedError")
        if hasattr(ex, name)
    )
