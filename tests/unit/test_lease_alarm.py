"""The lease alarm against the real kernel: a process whose alarm is due dies, whatever it does.

Each case runs a child Python process that arms ``keyqueue.core.alarm.LeaseAlarm`` and then holds
the GIL in C code, stops itself, or disarms; the child's exit status says what the kernel did.
(No NATS here: core/alarm.py is a kernel timer; the workers that arm it are tested in
tests/integration/test_handler_shapes.py.)
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from keyqueue.core.alarm import LeaseAlarm

pytestmark = pytest.mark.skipif(not LeaseAlarm().available, reason="the lease alarm needs Linux's POSIX timers")

CHILD = """
import os, signal, sys, time
from keyqueue.core.alarm import LeaseAlarm
alarm = LeaseAlarm()
assert alarm.available
alarm.set(time.monotonic() + 0.3)
print("armed", flush=True)
case = sys.argv[1]
if case == "gil":
    sum(range(10**12))          # C code holding the GIL far past the alarm
elif case == "stopped":
    os.kill(os.getpid(), signal.SIGSTOP)
elif case == "moved":
    for _ in range(10):         # the loop's ticks: each moves the kill point later
        time.sleep(0.1)
        alarm.set(time.monotonic() + 0.3)
    alarm.set(None)
    time.sleep(0.5)
elif case == "closed":
    alarm.close()
    time.sleep(0.5)
elif case == "past":
    alarm.set(time.monotonic() - 1.0)
    time.sleep(5)
print("survived", flush=True)
"""


def run(case: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CHILD, case], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("case", ["gil", "past"])
def test_the_kernel_kills_a_process_whose_alarm_is_due_even_while_c_code_holds_the_gil(case: str) -> None:
    began = time.monotonic()
    done = run(case)
    assert done.returncode == -signal.SIGKILL, done
    assert "armed" in done.stdout and "survived" not in done.stdout
    assert time.monotonic() - began < 30  # sum(range(10**12)) alone would take many minutes


def test_a_stopped_process_is_killed_at_its_alarm_without_being_continued() -> None:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, "stopped"], stdout=subprocess.PIPE, text=True)
    assert proc.wait(timeout=60) == -signal.SIGKILL  # nobody sends SIGCONT: the kernel ends it stopped
    assert proc.stdout is not None and "survived" not in proc.stdout.read()


@pytest.mark.parametrize("case", ["moved", "closed"])
def test_an_alarm_moved_later_or_closed_kills_nothing(case: str) -> None:
    done = run(case)
    assert done.returncode == 0, done
    assert done.stdout.split() == ["armed", "survived"]
