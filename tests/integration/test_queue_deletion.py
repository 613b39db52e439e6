"""``keyqueue delete-queue``: a queue nobody uses any more is deleted with everything it holds (it
asks first, or --yes), and only it: a queue whose name starts the same is kept, and a queue with
live workers is refused unless --force."""

from __future__ import annotations

import asyncio

from click.testing import CliRunner, Result
from nats.aio.client import Client

import keyqueue
from keyqueue.admin.inspection import list_queues
from keyqueue.cli import main
from keyqueue.jetstream.api import JetStreamApi


def _command(url: str, *args: str, answer: str | None = None) -> Result:
    return CliRunner().invoke(main, ["delete-queue", *args], env={"KEYQUEUE_URL": url}, input=answer)


async def _streams(nc: Client) -> list[str]:
    return sorted((await JetStreamApi(nc).request("STREAM.NAMES", {})).get("streams") or [])


async def test_a_stale_queue_is_deleted_with_all_it_holds_and_nothing_else(nats_url: str, nc: Client) -> None:
    app = keyqueue.App("smoke", nats_url, autoload_plugins=False, set_as_default=False, result_ttl=600)
    other = keyqueue.App("smoke_x", nats_url, autoload_plugins=False, set_as_default=False)

    @app.task(key="{n}")
    def probe(n: str) -> None: ...

    @other.task(key="{n}")
    def keep(n: str) -> None: ...

    try:
        await probe.enqueue(n="1")  # stored, no worker: what keeps /health at fail
        await probe.options(countdown=600).enqueue(n="2")  # its schedules stream too
        await keep.enqueue(n="1")
    finally:
        await app.close()
        await other.close()
    smoke = [s for s in await _streams(nc) if s.startswith("KQ_smoke_") and not s.startswith("KQ_smoke_x_")]
    assert {"KQ_smoke_INBOX", "KQ_smoke_RECORDS", "KQ_smoke_SCHEDULES"} <= set(smoke)

    refused = await asyncio.to_thread(_command, nats_url, "smoke", answer="n\n")
    assert refused.exit_code == 1 and "queue smoke: 1 request(s), 0 dead letter(s)" in refused.output
    assert "Aborted" in refused.output and "smoke" in await list_queues(JetStreamApi(nc))

    done = await asyncio.to_thread(_command, nats_url, "smoke", "--yes")
    assert done.exit_code == 0, done.output
    assert done.output == f"deleted queue smoke: {len(smoke)} stream(s), 1 request(s), 0 dead letter(s)\n"
    left = await _streams(nc)
    assert not [s for s in left if s in smoke] and "KQ_smoke_x_INBOX" in left
    assert await list_queues(JetStreamApi(nc)) == ["smoke_x"]

    again = await asyncio.to_thread(_command, nats_url, "smoke", "--yes")
    assert again.exit_code == 1 and "queue 'smoke' does not exist on this server; queues: smoke_x" in again.output


async def test_a_queue_with_a_live_worker_is_refused_unless_forced(nats_url: str, nc: Client) -> None:
    app = keyqueue.App("busy", nats_url, autoload_plugins=False, set_as_default=False)

    @app.task(key="{n}")
    def work(n: str) -> None: ...

    try:
        async with app.worker(name="busy-1") as worker:
            assert worker.heartbeat is not None
            async with asyncio.timeout(20):
                while not worker.heartbeat.written:
                    await worker.heartbeat.wrote.wait()
            refused = await asyncio.to_thread(_command, nats_url, "busy", "--yes")
            assert refused.exit_code == 1
            assert "queue 'busy' has 1 live worker(s) (busy-1): stop them first, or pass --force" in refused.output
            assert "busy" in await list_queues(JetStreamApi(nc))
            forced = await asyncio.to_thread(_command, nats_url, "busy", "--yes", "--force")
            assert forced.exit_code == 0, forced.output
        assert "busy" not in await list_queues(JetStreamApi(nc))
    finally:
        await app.close()
