"""``keyqueue dashboard``: a web view of the queues, keys, workers and dead letters, live.

- ``state``: what the pages show, polled from the server once a second (``keyqueue.admin``'s
  inspection, the worker registry, the DLQ) plus the queues' lifecycle events as they happen.
- ``latency``: each queue's wait and run times over the last minutes, and their percentiles.
- ``progress``: the ``ctx.progress`` messages of the keys whose page is open.
- ``schedules``: a queue's periodic schedules and delayed requests, as the pages list them.
- ``charts``: the inline SVG charts, drawn on the server.
- ``security``: who may see and act (loopback, a token or basic credentials), CSRF, the audit log.
- ``web``: the Starlette app: server-rendered pages (Jinja2), ``/live`` (server-sent events),
  ``/metrics`` (Prometheus), the DLQ actions.

Needs the ``dashboard`` extra (Starlette, uvicorn, Jinja2, prometheus-client). May import every
layer below it (``admin``, ``metrics``, ``events``, ``app``, ...); the CLI imports it.
"""
