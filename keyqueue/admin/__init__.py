"""Operating on queues from outside a worker: the dead-letter queue, inspection, the consumer.

- ``dead_letters``: list, show, delete, purge and replay (in order) a queue's dead requests.
- ``inspection``: a queue's streams, consumer and keys (with their holders, from the keys' lease
  records), as ``keyqueue inspect`` shows them.
- ``consumers``: unpinning a ``pinned_client`` queue's token consumer.
- ``workers``: the live worker registry, from the heartbeat records workers write
  (``keyqueue.app.heartbeat``), as ``keyqueue inspect`` and the dashboard show it.

May import ``jetstream``, ``wire``, ``errors`` and ``app`` (the heartbeat record's format); used by
the CLI, the dashboard and by applications.
"""
