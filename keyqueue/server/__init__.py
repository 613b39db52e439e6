"""The embedded nats-server: real ``nats-server`` processes on loopback for development and tests.

- ``embedded``: ``EmbeddedServer`` (one process, a temporary or given store) and finding the
  ``nats-server`` binary.
- ``cluster``: ``EmbeddedCluster``, N embedded servers as one JetStream cluster.
- ``probe``: the readiness checks both wait on (``/healthz``, JetStream answers, the cluster
  takes a replicated stream).
- ``local``: ``LocalServer``, how the processes of one app on one machine share one server.

Imports only ``keyqueue.errors`` and nats-py; nothing above it.
"""

from keyqueue.server.cluster import EmbeddedCluster
from keyqueue.server.embedded import (
    MIN_SERVER_VERSION,
    ClusterSpec,
    EmbeddedServer,
    find_nats_server,
    free_tcp_port,
    server_version,
)
from keyqueue.server.local import LocalServer

__all__ = [
    "MIN_SERVER_VERSION",
    "ClusterSpec",
    "EmbeddedCluster",
    "EmbeddedServer",
    "LocalServer",
    "find_nats_server",
    "free_tcp_port",
    "server_version",
]
