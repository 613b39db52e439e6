"""An app that serves only the Rebaser, for ``keyqueue worker``::

    keyqueue worker keyqueue_rebaser.app:app --url nats://127.0.0.1:4222 --concurrency 64
"""

from __future__ import annotations

from keyqueue import App

from .plugin import RebaserPlugin

app = App("rebaser", plugins=[RebaserPlugin()], set_as_default=False)
