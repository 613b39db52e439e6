"""Prometheus metrics: a worker's (``keyqueue worker --metrics-port``) and the dashboard's ``/metrics``.

- ``prometheus``: the instruments, named as the OpenTelemetry plugin's in Prometheus form
  (docs/observability.md), the plugin that counts a worker's lifecycle hooks into them, and the
  ``/metrics`` HTTP listener.

Needs the ``metrics`` extra (``prometheus-client``). May import ``app``, ``plugins``, ``errors``.
"""
