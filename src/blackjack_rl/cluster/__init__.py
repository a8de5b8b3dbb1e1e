"""Scale-out on Ray: evaluations and datasets split into shards, serve workers as actors.

Ray is an optional extra (`pip install 'blackjack-rl[ray]'`): nothing else in the
package imports it, and `--ray` without it is a one-line error. Ray places and
restarts the work; the environment stays what it is locally (the same player, the same
seeds, the same writers), so a sharded run writes exactly what a local run writes.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

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
