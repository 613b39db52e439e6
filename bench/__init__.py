"""keyqueue's benchmark suite, beside raw JetStream and the peers: ``python -m bench`` or ``make bench``
/ ``make bench-quick``.

Modules: ``run`` (one run, start to end), ``raw`` (raw JetStream baselines), ``workloads``
(keyqueue's workloads), ``worker`` and ``fleet`` (worker processes), ``peers`` (Celery, Dramatiq,
procrastinate in their own virtual environment), ``records`` (per-request records and the order /
exclusivity check), ``report`` (table, Markdown, chart).
"""
