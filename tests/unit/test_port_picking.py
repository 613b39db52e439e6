"""Where ``free_tcp_port()`` picks ports: outside the kernel's ephemeral range (keyqueue.server.embedded)."""

from __future__ import annotations

import errno

import pytest

from keyqueue.errors import ConfigError
from keyqueue.server.embedded import PICKED_PORTS, picking_range, port_taken


@pytest.mark.parametrize(("ephemeral", "span"), [
    ((32768, 60999), (10000, 32768)),  # Linux's default: below it
    ((49152, 65535), (10000, 49152)),  # macOS's default
    ((10500, 60000), (60001, 65536)),  # little room below: above it
    ((1024, 65535), None),  # no room anywhere: the kernel picks
    ((10000, 64800), None),  # 736 above, none below: too few to pick from at random
    (None, PICKED_PORTS),  # the range cannot be read
])
def test_the_picking_range_avoids_the_ephemeral_range(ephemeral: tuple[int, int] | None,
                                                      span: tuple[int, int] | None) -> None:
    assert picking_range(ephemeral) == span


def test_a_port_in_use_is_told_from_other_failures() -> None:
    assert port_taken(OSError(errno.EADDRINUSE, "in use"))
    assert not port_taken(OSError(errno.ECONNREFUSED, "refused"))
    assert port_taken(ConfigError('nats-server could not start: Error listening on port: 127.0.0.1:20001, '
                                  '"listen tcp 127.0.0.1:20001: bind: address already in use"'))
    assert not port_taken(ConfigError("nats-server could not start: exit code 1"))
