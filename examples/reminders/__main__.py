"""``python -m examples.reminders``: a worker in this process, three delayed reminders, two digests.

Uses $KEYQUEUE_URL, else the app's embedded nats-server. Exits once everything it waited for ran.
"""

from __future__ import annotations

import asyncio
import datetime as dt

from examples.reminders.app import app, remind


async def main() -> None:
    async with app, app.worker():
        now = dt.datetime.now(dt.UTC)
        in_two, in_three = now + dt.timedelta(seconds=2), now + dt.timedelta(seconds=3)
        later = await remind.options(countdown=3).enqueue(user="ada", text="stand up", due=in_three.isoformat())
        sooner = await remind.options(eta=in_two).enqueue(user="ada", text="drink water", due=in_two.isoformat())
        print(f"stored 2 reminders for ada, due {sooner.due:%H:%M:%S} and {later.due:%H:%M:%S}", flush=True)
        result = await remind.options(countdown=1, timeout=30).call(user="bob", text="call ada",
                                                                   due=(now + dt.timedelta(seconds=1)).isoformat())
        print(f"bob's call returned: {result}", flush=True)
        await asyncio.sleep(4)  # ada's reminders and a couple of digests come due meanwhile


asyncio.run(main())
