"""``keyqueue dashboard``: a web view of the queues, their keys and why they wait, live, for operators.

- ``state``: what the pages show, polled from the server (``keyqueue.admin``'s inspection of every
  key, the worker registry, the DLQ) plus what it follows live: lifecycle events, progress times.
- ``key_list``: a queue's keys page: every key filtered, sorted and cut into pages.
- ``search``: the index of every pending and dead request, and the filter searches and bulk actions use.
- ``history``: per-minute rollups of each queue's events, stored in NATS, behind the history charts.
- ``health``: ``/health``'s verdict per queue.
- ``latency``: each queue's wait and run times over the last minutes, and their percentiles.
- ``progress``: the ``ctx.progress`` messages of the keys whose page is open.
- ``schedules``: a queue's periodic schedules and delayed requests, as the pages list them.
- ``charts``: the inline SVG charts, drawn on the server.
- ``security``: who may see and act, from where (loopback Host allow-list, foreign Origin refusal,
  roles, the session cookie derived from the token, CSRF).
- ``audit``: the audit log of every action, kept in a stream per queue.
- ``actions``: every POST (replay, delete, purge, cancel, release, bulk), checked, confirmed, audited.
- ``web``: the Starlette app: server-rendered pages (Jinja2), ``/live`` (server-sent events),
  ``/health``, ``/metrics`` (Prometheus).

Needs the ``dashboard`` extra (Starlette, uvicorn, Jinja2, prometheus-client). May import every
layer below it (``admin``, ``metrics``, ``events``, ``app``, ...); the CLI imports it.
"""
