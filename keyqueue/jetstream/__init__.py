"""keyqueue on JetStream: the streams, consumers, subjects and API calls a queue is made of.

- ``connect``: opening a NATS connection, and what keyqueue's connections promise.
- ``api``: the JetStream API calls keyqueue makes, their errors typed by
  ``keyqueue.errors.from_api_error``.
- ``subjects``, ``topology``: a queue's names and the rules for keys; its streams and consumer,
  created when missing, checked when they exist.
- ``publish``, ``fastpub``: enqueue (a request into its key's inbox, then a token for the key);
  core publishes with headers encoded once.
- ``pull``, ``mux``: the token pull loop; many requests in flight on one reply subscription, their
  replies handled straight from nats-py's read loop.
- ``queue_io``, ``rechecks``, ``acks``, ``unawaited``, ``dlq_copy``: every per-key read and write a
  key session makes (the release marker among them), the re-checks of many inboxes in one round
  trip, the acks of many released tokens confirmed by one reply, the lease records' deletes nobody
  waits for (sent again when no answer comes), a request's dead-letter copy.
- ``records``, ``kv``: per-request records (kept results, cancels); a small key-value bucket.
- ``schedules``, ``due``, ``cron``, ``server_clock``: delayed and periodic requests, kept by
  nats-server itself, and the server's clock as a client can know it.

May import ``wire`` and ``errors``; outside the standard library, only ``nats`` (nats-py). The
per-key protocol (acquire, work, release) is not here but in ``keyqueue.core``, whose key sessions
make their reads and writes through ``queue_io.QueueIO``.
``tests/unit/test_layers.py`` checks these directions.
"""
