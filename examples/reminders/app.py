"""Reminders: delayed requests (``options(countdown=...)`` / ``options(eta=...)``) and a periodic
digest (``app.periodic``), kept by nats-server itself: no process holds a pending reminder, and
there is no beat process.

Run a worker for it with ``keyqueue worker examples.reminders.app:app`` (see README.md).
"""

from __future__ import annotations

import datetime as dt

import keyqueue

app = keyqueue.App("reminders")
"""Connects to $KEYQUEUE_URL, else to the app's embedded nats-server (see docs/tutorial.md)."""


@app.task(key="{user}")
async def remind(user: str, text: str, due: str) -> str:
    """Remind a user. A user's reminders run one at a time, each when it falls due (``due``: ISO 8601,
    so that ``keyqueue enqueue`` can pass it as JSON)."""
    late = (dt.datetime.now(dt.UTC) - dt.datetime.fromisoformat(due)).total_seconds()
    line = f"reminder for {user}: {text} ({late * 1000:.0f} ms after its due time)"
    print(line, flush=True)
    return line


@app.task(key="digest")
async def digest(kind: str) -> str:
    """The periodic digest: every tick of its schedule enqueues one request, whatever the number of workers."""
    line = f"{kind} digest at {dt.datetime.now(dt.UTC):%H:%M:%S}"
    print(line, flush=True)
    return line


app.periodic("digest", digest, every=2, kwargs={"kind": "two-second"})
app.periodic("morning-digest", digest, cron="0 7 * * mon-fri", timezone="Europe/Oslo", kwargs={"kind": "morning"})
