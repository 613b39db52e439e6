"""The lease alarm: the kernel ends a worker process whose runs would outlive their leases.

A key's run must end before its lease does (DESIGN invariant 1), whatever the handler is. An
``async def`` that awaits is cancelled when a renewal finds the lease lost; other runs cannot be
stopped by the worker's own code:

- a plain ``def`` in a thread (no exception reaches a thread blocked in C code, and one that
  returns later would have run beside the next holder);
- C code that holds the GIL (``sum(range(n))``, a big ``json.loads``, a backtracking regex): it
  freezes every Python thread of the process, the event loop and the loop watchdog's thread too;
- a process stopped as a whole (SIGSTOP, a suspended VM), which runs nothing at all.

So each worker process keeps one POSIX timer (``timer_create`` on ``CLOCK_MONOTONIC``) whose
signal is ``SIGKILL``, armed by the event loop at the earliest *kill point* of the leases whose
runs are going on (:attr:`~keyqueue.core.lease.Lease.kill_point`: half the safety margin after the
holder's own deadline, still before the server can expire the lease record). The loop moves it
later as renewals extend the leases and disarms it once no run is going on. A loop that cannot run
moves nothing: the kernel delivers ``SIGKILL`` at the kill point, which needs no Python, no GIL
and no thread of the process, and which ends even a stopped process. The next holder can acquire
the key only once the record expired, after the kill point: nothing of the old run is left.

What it costs: a ``timer_settime`` system call when the earliest kill point moves (about one per
renewal interval, not per request). What it cannot do: it is Linux only (elsewhere, the loop
watchdog thread and the session's own checks remain, with the limits docs/architecture.md states),
and a process killed by it gives nothing back: its keys move when their records expire (or at
once, under a ``--processes`` parent that reaps it) and the requests in hand run again.

:func:`die_with_parent` is the same idea for a process pool's children: the kernel kills a child
when the worker process that started it dies, however it dies.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import time
from typing import Final

__all__ = ["LeaseAlarm", "die_with_parent"]

log = logging.getLogger("keyqueue.worker")

_CLOCK_MONOTONIC: Final = 1
_SIGEV_SIGNAL: Final = 0
_TIMER_ABSTIME: Final = 1
_PR_SET_PDEATHSIG: Final = 1


class _SigVal(ctypes.Union):
    _fields_ = [("sival_int", ctypes.c_int), ("sival_ptr", ctypes.c_void_p)]


class _SigEvent(ctypes.Structure):
    # struct sigevent: 64 bytes on Linux (the union after sigev_notify is padded to 48).
    _fields_ = [("sigev_value", _SigVal), ("sigev_signo", ctypes.c_int), ("sigev_notify", ctypes.c_int),
                ("_pad", ctypes.c_int * 12)]


class _TimeSpec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _ITimerSpec(ctypes.Structure):
    _fields_ = [("it_interval", _TimeSpec), ("it_value", _TimeSpec)]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.timer_create  # noqa: B018 - glibc >= 2.34 has it in libc; older ones in librt
    except (OSError, AttributeError):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("rt") or "librt.so.1", use_errno=True)
        except OSError:
            return None
    return libc


class LeaseAlarm:
    """One kernel timer that sends this process ``SIGKILL`` at an absolute ``time.monotonic()`` instant.

    :meth:`set` is called from the event loop (it is cheap when nothing changes); :attr:`available`
    is False where the kernel offers no such timer (not Linux), and :meth:`set` then does nothing.
    """

    def __init__(self) -> None:
        self.armed: float | None = None
        """The instant the process is killed at, if nothing moves it (None: disarmed)."""
        self._timer = ctypes.c_void_p()
        self._libc = _libc()
        self.available = False
        if self._libc is None:
            return
        event = _SigEvent()
        event.sigev_notify = _SIGEV_SIGNAL
        event.sigev_signo = signal.SIGKILL
        if self._libc.timer_create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(self._timer)) != 0:
            log.warning("the lease alarm is not available (timer_create: %s): a run that cannot be stopped is "
                        "ended by the loop watchdog alone", os.strerror(ctypes.get_errno()))
            return
        self.available = True

    def set(self, at: float | None) -> None:
        """Kill this process at ``at`` (``time.monotonic()``); None disarms. A time already past kills it now."""
        if at == self.armed or not self.available:
            return
        spec = _ITimerSpec()
        if at is not None:
            # An all-zero value disarms a POSIX timer: an instant already past is one nanosecond after 0.
            seconds = int(at) if at > 0 else 0
            spec.it_value.tv_sec = seconds
            spec.it_value.tv_nsec = max(0, int((at - seconds) * 1e9)) if at > 0 else 1
        assert self._libc is not None
        if self._libc.timer_settime(self._timer, _TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), f"timer_settime: {os.strerror(ctypes.get_errno())}")
        self.armed = at

    def remaining(self) -> float | None:
        """Seconds until the kill, as this process sees it (None: disarmed)."""
        return None if self.armed is None else self.armed - time.monotonic()

    def close(self) -> None:
        """Disarm and delete the timer (the worker stopped holding keys)."""
        if not self.available:
            return
        self.set(None)
        assert self._libc is not None
        self._libc.timer_delete(self._timer)
        self.available = False


def die_with_parent(parent: int) -> bool:
    """Ask the kernel to ``SIGKILL`` this process when its parent dies (``PR_SET_PDEATHSIG``), and die
    now if ``parent`` is already gone. Call it first thing in a child. False where not supported.

    The kernel sends the signal when the *thread* that started the child ends: start children from
    a thread that lives as long as the parent (the worker's event loop thread)."""
    libc = _libc()
    if libc is None or libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the parent died before the request above: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)
    return True
