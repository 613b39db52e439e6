"""keyqueue's core: per-key exclusive, ordered work on one queue, whatever the work is.

- ``worker``: ``QueueWorker``, the runtime for one queue: slots, the token pull loop, the key
  sessions, drain.
- ``session``: ``KeySession``, what a worker runs while it holds a key: the state machine
  (acquire, work, give back) whose parts are objects of their own:
  ``lease_keeper`` (``LeaseKeeper``: the record renewed beside the work, the work cut off when the
  lease is lost), ``removals`` (``Removals``: the handled requests' purges, coalesced and
  confirmed), ``dead_lettering`` (``DeadLettering``: a request to the DLQ, crash-loop counts),
  ``hand_back`` (``HandBack``: the release marker, or the slow give-back and its re-check);
  ``outage`` (``ride_out``: one NATS step tried again through an outage, within a lease or a
  deadline).
- ``key_io``: ``KeyIO`` and ``ReconcilerIO``, what the core needs from the I/O layer (protocols that
  ``jetstream.queue_io.QueueIO`` satisfies and unit tests' fakes implement).
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
