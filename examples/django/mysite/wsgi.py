"""WSGI entry point: gunicorn mysite.wsgi (with --preload, Django is set up before the fork)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mysite.settings")

application = get_wsgi_application()
