"""The sync portal: how code without a running event loop reaches NATS (``delay``, ``call_sync``, ...).

A Django or Flask view, a gunicorn or uWSGI worker, a script: none runs an event loop, and a
nats-py connection lives on one. ``Portal`` runs a private event loop in a daemon thread; a sync
call hands it a coroutine and waits for the result, **never without a bound**: past it the
coroutine is cancelled and the call raises ``SyncTimeout`` (a ``KeyqueueTimeout``, so also a
``TimeoutError``) saying what did not finish. Whatever the coroutine itself raises, a timeout of its
own included (``call``'s ``KeyqueueTimeout``, ``EnqueueTimeout``), reaches the caller unchanged:
the sync form raises exactly what the async form raises.

**Fork safety.** A process forked from one that used the portal (gunicorn ``--preload``, uWSGI
without ``lazy-apps``, ``multiprocessing`` with the fork start method) inherits the portal object
but not its thread: a coroutine handed to that loop would never run, and the child would wait
forever. ``SyncRunner`` registers an after-fork hook (``os.register_at_fork``) that forgets, in the
child, the parent's portal, its lock (which another thread may have held at the fork) and what the
owner asks (the app forgets its connections): the child's first sync call starts a loop of its own
and opens a connection of its own. The parent's objects are dropped, never closed: their sockets
and threads belong to the parent.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from keyqueue.errors import ConfigError, SyncTimeout
from keyqueue.tasks.task import SYNC_BOUND

__all__ = ["SYNC_BOUND", "Portal", "SyncRunner", "require_sync_caller"]

T = TypeVar("T")


def require_sync_caller() -> None:
    """Refuse a sync form called from a running event loop (it would block that loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise ConfigError("this is the sync form, for code without a running event loop; "
                      "in async code, await the async form (task.enqueue(...), task.call(...))")

class Portal:
    """A private event loop in a daemon thread, for sync callers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.pid = os.getpid()
        self.thread = threading.Thread(target=self.loop.run_forever, name="keyqueue-portal", daemon=True)
        self.thread.start()

    @property
    def usable(self) -> bool:
        """Whether a coroutine handed to it runs: its thread lives (in this process)."""
        return self.pid == os.getpid() and self.thread.is_alive() and not self.loop.is_closed()

    def run(self, coro: Coroutine[Any, Any, T], bound: float, what: str) -> T:
        """``coro``'s result or its exception, waiting at most ``bound`` seconds (then ``SyncTimeout``, the
        coroutine cancelled)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        # Wait, then tell the portal's silence from the coroutine's own error: on Python 3.11+
        # ``concurrent.futures.TimeoutError`` is the builtin ``TimeoutError``, the base of keyqueue's
        # own timeouts, so catching it around ``result()`` would turn the coroutine's
        # ``KeyqueueTimeout`` ("the request is stored and will still run") into a ``SyncTimeout``.
        done, _ = concurrent.futures.wait([future], timeout=bound)
        if not done:
            future.cancel()
            raise SyncTimeout(what, bound)
        return future.result()

    def close(self) -> None:
        if self.loop.is_closed() or self.pid != os.getpid():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class SyncRunner:
    """An owner's portal: made on first use, remade in a forked child, closed with its owner.

    ``after_fork`` is called in a forked child (before anything else of the owner runs there) to
    forget what the owner keeps per process, such as its connections; ``closing()`` runs on the
    portal before it stops (closing the connection it made), at ``close_sync`` or at exit.
    """

    def __init__(self, after_fork: Callable[[], None], closing: Callable[[], Awaitable[None]]) -> None:
        self._after_fork = after_fork
        self._closing = closing
        self._portal: Portal | None = None
        self._lock = threading.Lock()
        self._atexit = False
        ref = weakref.ref(self)
        # Registered once per runner and never removed (the os module offers no way): the hook
        # holds only a weak reference, so a runner that is gone costs one call per fork.
        os.register_at_fork(after_in_child=lambda: _reset(ref))

    def forget(self) -> None:
        """In a forked child: drop the parent's portal and lock unused, and let the owner forget its state."""
        self._portal = None
        self._lock = threading.Lock()
        self._atexit = False
        self._after_fork()

    def run(self, make: Callable[[], Awaitable[T]], *, bound: float, what: str) -> T:
        """Run ``make()`` on the portal from code without a running event loop, for at most ``bound`` seconds."""
        require_sync_caller()

        async def run() -> T:
            return await make()

        with self._lock:
            portal = self._portal
            if portal is None or not portal.usable:
                portal = self._portal = Portal()
                if not self._atexit:
                    atexit.register(self.close_sync)
                    self._atexit = True
        return portal.run(run(), bound, what)

    def close_sync(self) -> None:
        """Run ``closing()`` on the portal, then stop it; a no-op without one."""
        with self._lock:
            portal, self._portal = self._portal, None
        if portal is None or not portal.usable:
            return
        try:
            portal.run(_call(self._closing), SYNC_BOUND, "closing the sync connection")
        except Exception:  # closing must not fail because the server went away first
            pass
        portal.close()


async def _call(make: Callable[[], Awaitable[None]]) -> None:
    await make()


def _reset(ref: weakref.ref[SyncRunner]) -> None:
    runner = ref()
    if runner is not None:
        runner.forget()
