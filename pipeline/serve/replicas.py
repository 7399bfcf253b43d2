"""How many replicas serve the app: a fixed number, or Ray Serve's autoscaler between bounds.

`Replicas` becomes Serve's own deployment options (`num_replicas`, or `autoscaling_config` with
`min_replicas`, `max_replicas`, `target_ongoing_requests`); nothing here scales by itself.
`ReplicaHeader` names the replica that answered each response (`x-raypack-replica`), so a client
or a test sees where Serve's router sent a request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

REPLICA_HEADER = "x-raypack-replica"
# How often a stopping replica (shutdown, scale-down, a redeploy) checks whether its requests
# are done. Serve's default is 2 s, and a replica sleeps one such period before its first check
# even when idle (ray/serve/_private/replica.py, `_drain_ongoing_requests`), so `raypack serve`
# took 2 s more than needed to stop; a check is a counter read. Serve's
# `graceful_shutdown_timeout_s` (20 s) still bounds the wait for requests in flight.
DRAIN_CHECK_S = 0.1


@dataclass(frozen=True)
class Replicas:
    """A fixed `num_replicas` (default 1), or autoscaling when `max_replicas` is set.

    Autoscaling starts at `min_replicas` (default 1) and keeps each replica near
    `target_ongoing_requests` requests in progress (default: the engine's max_num_seqs, the
    requests one replica runs at once; beyond them requests wait in its staging queue).
    Errors name the command-line flag (the builder's arguments use the same names).
    """

    num_replicas: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_replicas", "min_replicas", "max_replicas"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{_flag(name)} must be an integer, got {value!r}")
            if value is not None and value < 1:
                raise ValueError(f"{_flag(name)} must be >= 1, got {value}")
        target = self.target_ongoing_requests
        if target is not None and not target > 0:
            raise ValueError(f"{_flag('target_ongoing_requests')} must be > 0, got {target}")
        if self.num_replicas is not None:
            for other in ("min_replicas", "max_replicas", "target_ongoing_requests"):
                if getattr(self, other) is not None:
                    raise ValueError(
                        f"{_flag(other)} is for autoscaling and {_flag('num_replicas')} fixes"
                        " the count: give one or the other"
                    )
        if not self.autoscaling:
            for other in ("min_replicas", "target_ongoing_requests"):
                if getattr(self, other) is not None:
                    raise ValueError(
                        f"{_flag(other)} steers autoscaling: give {_flag('max_replicas')} with it"
                    )
        elif self.lowest > self.highest:
            raise ValueError(
                f"{_flag('min_replicas')} ({self.lowest}) must be <= "
                f"{_flag('max_replicas')} ({self.highest})"
            )

    @property
    def autoscaling(self) -> bool:
        """Whether Serve's autoscaler sets the count (max_replicas is set)."""
        return self.max_replicas is not None

    @property
    def lowest(self) -> int:
        """Fewest replicas (autoscaling: min_replicas, default 1)."""
        if self.autoscaling:
            return self.min_replicas if self.min_replicas is not None else 1
        return self.num_replicas or 1

    @property
    def highest(self) -> int:
        """Most replicas (autoscaling: max_replicas)."""
        if self.max_replicas is not None:
            return self.max_replicas
        return self.num_replicas or 1

    def deployment_options(self, default_target: float) -> dict[str, Any]:
        """Serve's `.options()` for this count: `num_replicas`, or `autoscaling_config` (with
        `default_target` as target_ongoing_requests when none is set)."""
        if not self.autoscaling:
            return {"num_replicas": self.lowest}
        target = self.target_ongoing_requests
        return {
            "autoscaling_config": {
                "min_replicas": self.lowest,
                "max_replicas": self.highest,
                "target_ongoing_requests": target if target is not None else default_target,
            }
        }


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Scope]]
Send = Callable[[Scope], Awaitable[None]]


class ReplicaHeader:
    """ASGI middleware: every HTTP response carries `x-raypack-replica: <replica id>`."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], replica: str):
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Scope) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)
