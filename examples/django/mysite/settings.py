"""Settings of the example project: sqlite, the shop app, keyqueue in both forms."""

import os
from pathlib import Path

import django

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "example-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
ROOT_URLCONF = "mysite.urls"
WSGI_APPLICATION = "mysite.wsgi.application"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = ["django.contrib.contenttypes", "shop"]
if django.VERSION < (6, 0):
    INSTALLED_APPS.append("django_tasks")  # the backport of Django 6's Tasks framework

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("SHOP_DATABASE", BASE_DIR / "db.sqlite3"),
        # Web processes and the worker write at once: wait for the lock, and take it up front.
        "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE"},
    }
}

# keyqueue's settings, read by keyqueue.django.django_settings when the app first connects; any
# KEYQUEUE_* setting left out here is read from the environment.
KEYQUEUE_URL = os.environ.get("SHOP_NATS_URL", "nats://127.0.0.1:4222")

# Django's Tasks framework, on keyqueue; its tasks are registered on the app of mysite/kq.py, so
# one worker serves both: DJANGO_SETTINGS_MODULE=mysite.settings keyqueue worker mysite.kq:app
TASKS = {
    "default": {
        "BACKEND": "keyqueue.django.backend.KeyqueueBackend",
        "QUEUES": ["default", "audit"],
        "OPTIONS": {"APP": "mysite.kq:app", "RESULT_TTL": 3600},
    }
}
