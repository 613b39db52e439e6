"""A worker kept from a key by the lease record of a worker that is gone says so at INFO, naming the
holder and the most its record can still last (a killed stand-alone worker's keys wait out their
lease, and the other workers' logs said nothing about why)."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import time

import pytest
from nats.aio.client import Client

import keyqueue
from keyqueue.jetstream.api import parse_pub_ack
from keyqueue.jetstream.subjects import QueueNames

RECORD_TTL = 2
"""Seconds the gone holder's record lives: how long the key waits."""


def _gone_pid() -> int:
    """The pid of a process of this host that has exited (and been reaped)."""
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


async def test_a_worker_waiting_on_a_dead_holders_record_names_it_and_the_time_left(
        nats_url: str, nc: Client, caplog: pytest.LogCaptureFixture) -> None:
    app = keyqueue.App("ledger", nats_url, autoload_plugins=False, set_as_default=False)

    @app.task(key="{account}", max_attempts=1)
    def post(account: str) -> str:
        return f"posted {account}"

    dead = _gone_pid()
    caplog.set_level(logging.INFO, logger="keyqueue.session")
    try:
        async with app.worker():
            # What a worker killed with kill -9 while it held the key leaves: its lease record.
            body = {"worker": "ghost-1", "host": socket.gethostname(), "pid": dead, "nonce": "n", "fence": 0,
                    "since": "", "ttl": RECORD_TTL, "sent": time.monotonic()}
            parse_pub_ack(await nc.request(QueueNames("ledger").lease("a1"), json.dumps(body).encode(), timeout=5,
                                           headers={"Nats-TTL": str(RECORD_TTL),
                                                    "Nats-Expected-Last-Subject-Sequence": "0"}))
            assert await post.call(account="a1", timeout=30) == "posted a1"  # once the record expired
    finally:
        await app.close()
    [line] = [r.getMessage() for r in caplog.records if "looks gone" in r.getMessage()]
    assert line.startswith(f"queue ledger key a1 waits for the lease record of worker ghost-1 (pid {dead} on "
                           f"{socket.gethostname()}), which looks gone: its process {dead} on this host has exited; "
                           "the key is free when the record expires, in at most ")
    assert "`keyqueue release ledger --worker ghost-1`" in line
    left = float(line.split("in at most ", 1)[1].split("s,", 1)[0])
    assert 0 <= left <= RECORD_TTL
