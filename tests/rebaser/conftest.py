"""What the Rebaser's tests share: a client on the test's nats-server.

The Rebaser is the installed ``keyqueue-rebaser`` distribution (``make`` installs it), imported
as ``keyqueue_rebaser``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from keyqueue_rebaser import RebaserClient


@pytest.fixture
async def client(nats_url: str, request: pytest.FixtureRequest) -> AsyncIterator[RebaserClient]:
    """A client of the ``rebaser`` queue whose lease (``ack_wait``) is the test module's ``ACK_WAIT``.

    Producers and workers must agree on the queue's configuration, so the lease comes from the
    module whose workers use it.
    """
    ack_wait: float = request.module.ACK_WAIT
    async with await RebaserClient.connect(nats_url, timeout=30.0, ack_wait=ack_wait) as c:
        yield c
