"""What nats-server's message schedules do, measured: the facts keyqueue's delays and periodic
requests are built on (docs/decisions.md, "Delayed and periodic requests")."""

from __future__ import annotations

import base64
import datetime as dt
from typing import Any

from nats.aio.client import Client
from server_facts import api, publish

NS = 1_000_000_000
STREAM = {"name": "S", "subjects": ["kq.t.at.>", "kq.t.periodic.>", "kq.t.due.>"], "retention": "workqueue",
          "storage": "file", "allow_msg_schedules": True, "duplicate_window": 120 * NS}


def at(seconds: float) -> str:
    return "@at " + (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")


async def last(nc: Client, subject: str) -> dict[str, Any] | None:
    reply = await api(nc, "STREAM.MSG.GET.S", {"last_by_subj": subject})
    if "error" in reply:
        return None
    message: dict[str, Any] = reply["message"]
    lines = base64.b64decode(message.get("hdrs", "")).decode().split("\r\n")[1:]
    message["headers"] = dict(line.split(": ", 1) for line in lines if ": " in line)
    return message


async def fired(nc: Client, subject: str) -> dict[str, Any]:
    """The first message a schedule fires on ``subject``, once there (a consumer sees it; it is not acked)."""
    sub = await nc.jetstream().pull_subscribe(subject, stream="S")
    await sub.fetch(1, timeout=10)
    await sub.unsubscribe()
    message = await last(nc, subject)
    assert message is not None
    return message


async def test_where_schedules_live_and_what_they_fire(nc: Client) -> None:
    assert "error" not in await api(nc, "STREAM.CREATE.S", STREAM)
    # A schedule stream may not refuse new messages (the inbox's per-key backlog cap does).
    refused = await api(nc, "STREAM.CREATE.S2", {**STREAM, "name": "S2", "subjects": ["x.>"], "retention": "limits",
                                                 "discard": "new"})
    assert refused["error"]["description"] == "message scheduling cannot use discard new"
    # The target must be a subject of the schedule's own stream.
    await api(nc, "STREAM.CREATE.OTHER", {"name": "OTHER", "subjects": ["other.>"]})
    elsewhere = await publish(nc, "kq.t.at.x", {"Nats-Schedule": at(1), "Nats-Schedule-Target": "other.k"})
    assert elsewhere["error"]["err_code"] == 10190  # message schedules target is invalid

    seen: list[str] = []

    async def on_msg(msg: Any) -> None:
        seen.append(msg.subject)

    await nc.subscribe("kq.t.due.>", cb=on_msg)
    headers = {"Nats-Schedule": at(0.5), "Nats-Schedule-Target": "kq.t.due.k", "Nats-Msg-Id": "r1",
               "X-MESSAGE-TYPE": "work", "X-KQ-Delayed-Request-Id": "r1"}
    stored = await publish(nc, "kq.t.at.r1", headers, b"body")
    # The request id deduplicates the schedule itself, whatever its subject.
    again = await publish(nc, "kq.t.at.other", headers, b"body")
    assert (again["seq"], again.get("duplicate")) == (stored["seq"], True)

    message = await fired(nc, "kq.t.due.k")
    assert base64.b64decode(message["data"]) == b"body"
    assert message["headers"] == {"X-MESSAGE-TYPE": "work", "X-KQ-Delayed-Request-Id": "r1",
                                  "Nats-Scheduler": "kq.t.at.r1", "Nats-Schedule-Next": "purge"}
    assert await last(nc, "kq.t.at.r1") is None, "a one-shot schedule is removed when it fires"
    await nc.flush()
    assert seen == [], "a core subscriber never sees a fired message"


async def test_what_schedule_patterns_the_server_takes(nc: Client) -> None:
    await api(nc, "STREAM.CREATE.S", STREAM)

    async def result(pattern: str, zone: str | None = None) -> int:
        headers = {"Nats-Schedule": pattern, "Nats-Schedule-Target": "kq.t.due.p"}
        if zone is not None:
            headers["Nats-Schedule-Time-Zone"] = zone
        reply = await publish(nc, "kq.t.periodic.x", headers)
        return int(reply.get("error", {}).get("err_code", 0))

    assert await result("@every 1s") == 0
    assert await result("@every 500ms") == 10189  # shorter than a second
    assert await result("@every 1s", "Europe/Oslo") == 10189  # a time zone is for cron only
    assert await result("0 0 9 * * mon-fri", "Europe/Oslo") == 0
    assert await result("@hourly", "Europe/Oslo") == 0
    assert await result("0 9 * * *") == 10189  # five fields: the server wants seconds first
    assert await result("0 0 9 * * 7") == 10189  # Sunday is 0 only
    assert await result("0 0 9 * * *", "Not/AZone") == 10223


async def test_a_periodic_schedule_is_compare_and_set_and_ticks_with_its_name(nc: Client) -> None:
    await api(nc, "STREAM.CREATE.S", STREAM)
    every = {"Nats-Schedule": "@every 1s", "Nats-Schedule-Target": "kq.t.due.p"}
    first = await publish(nc, "kq.t.periodic.p", {**every, "Nats-Expected-Last-Subject-Sequence": "0"})
    lost = await publish(nc, "kq.t.periodic.p", {**every, "Nats-Expected-Last-Subject-Sequence": "0"})
    assert "error" not in first and lost["error"]["err_code"] == 10071  # a second worker's write is refused
    tick = await fired(nc, "kq.t.due.p")
    assert tick["headers"]["Nats-Scheduler"] == "kq.t.periodic.p"
    assert dt.datetime.fromisoformat(tick["headers"]["Nats-Schedule-Next"].replace("Z", "+00:00")) > \
        dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    assert await last(nc, "kq.t.periodic.p") is not None, "a repeating schedule stays"
