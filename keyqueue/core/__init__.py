"""keyqueue's core: per-key exclusive, ordered work on one queue, whatever the work is.

- ``worker``: ``QueueWorker``, the runtime for one queue: slots, the token pull loop, the key
  sessions, drain.
- ``session``: ``KeySession``, what a worker runs while it holds a key (acquire, work, release).
- ``lock``, ``lease``: ``KeyLock``, a lease record per key that only the server can grant, and
  ``Lease``, how long this worker may still act for a key it holds.
- ``processor``: ``KeyProcessor``, the seam per-key code plugs into, and what it receives.
- ``observer``: ``SessionObserver``, what key sessions tell the layer above them.
- ``reconciler``: every key with stored requests and no token gets a token.
- ``retry``: ``RetryPolicy``, when to retry a failed request and how long to wait first.
- ``slots``, ``turns``: how many key sessions may work at once, and turns on the event loop.
- ``watchdog``, ``alarm``: ending the worker process before a blocked event loop or a run
  outlives a lease.

May import ``jetstream``, ``wire`` and ``errors``; outside the standard library, only ``nats`` (nats-py's
client type). It knows nothing of tasks, plugins or the app: they build on it (``tasks``, ``app``,
``builtins``) and reach it through ``KeyProcessor`` and ``SessionObserver``.
``tests/unit/test_layers.py`` checks these directions.
"""
