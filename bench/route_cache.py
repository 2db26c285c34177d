"""The bench's switch for the route cache: ``BENCH_NO_ROUTE_CACHE=1`` in a process's environment
makes every :class:`~kombu_pgskip.store.Store` created there remember no route.

The transport has no option for it. :func:`install` wraps ``Store.__init__``: a Store created
while the variable is ``1`` gets, as its ``_routes``, a dict that stores nothing, so
``Store.publish_routed`` routes every message with ``publish_routed`` (one statement, its NOTIFY
inside the insert's transaction) and never inserts with ``insert_remembered`` /
``insert_remembered_quiet`` guarded by the routing epoch (migration 0005). Publishes to the
default exchange (``Store.publish``) do not route and are unchanged.

The bench process installs it when it imports :mod:`bench.brokers`, and the workers when they
import :mod:`bench.benchapp`; the ``pgskip-noroute`` broker sets the variable (see
:attr:`bench.brokers.Broker.env`) around its measurements in the bench process and in its
workers' environment. Celery apps of one process with equal broker URLs and transport options
share kombu's producer pools, so a publisher's Store outlives its app: ``pgskip-noroute`` has
a transport option of its own (``bench_route_cache``, which the transport ignores) so that its
publishers get Stores created while the variable is set.
"""

from __future__ import annotations

import functools
import os
from typing import Any

ENV = "BENCH_NO_ROUTE_CACHE"


class NoRoutes(dict):  # type: ignore[type-arg]
    """A route cache that remembers nothing."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


def off() -> bool:
    """Whether Stores created now remember no route."""
    return os.environ.get(ENV) == "1"


def install() -> None:
    """Wrap ``Store.__init__`` once per process (idempotent)."""
    from kombu_pgskip.store import Store

    if getattr(Store.__init__, "_bench_route_switch", False):
        return
    original = Store.__init__

    @functools.wraps(original)
    def __init__(self: Store, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if off():
            self._routes = NoRoutes()

    __init__._bench_route_switch = True  # type: ignore[attr-defined]
    Store.__init__ = __init__  # type: ignore[method-assign]
