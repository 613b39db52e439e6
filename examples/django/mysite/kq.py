"""The project's keyqueue app. Its settings come from Django's (``KEYQUEUE_URL``), read when it first
connects: this module may be imported before Django has loaded them."""

import keyqueue
from keyqueue.django import django_settings

app = keyqueue.App("shop", settings=django_settings, result_ttl=3600)
