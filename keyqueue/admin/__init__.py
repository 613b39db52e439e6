"""Operating on queues from outside a worker: the dead-letter queue, inspection, the consumer.

- ``dead_letters``: list, show, delete, purge and replay (in order) a queue's dead requests.
- ``inspection``: a queue's streams, consumer and keys (with their holders, from the keys' lease
  records), as ``keyqueue inspect`` shows them.
- ``consumers``: unpinning a ``pinned_client`` queue's token consumer.

May import ``jetstream``, ``wire`` and ``errors``; used by the CLI and by applications.
"""
