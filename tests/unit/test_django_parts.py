"""keyqueue.django's pure parts, in this process, without a server: settings read from Django's and
the environment, the app's settings resolved on first use, and how the Tasks backend checks tasks
and makes keys (tests/integration/test_django.py runs the whole project for real)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import keyqueue
from keyqueue.errors import ConfigError


def test_keyqueue_settings_come_from_django_then_the_environment() -> None:
    from keyqueue.django import keyqueue_settings

    django_conf = SimpleNamespace(KEYQUEUE_URL="nats://django:4222", KEYQUEUE_NAME=None, DEBUG=True)
    settings = keyqueue_settings(django_conf, {"KEYQUEUE_URL": "nats://env:4222", "KEYQUEUE_NAME": "from-env",
                                               "KEYQUEUE_USER": "u", "KEYQUEUE_PASSWORD": "p"})
    assert settings.url == "nats://django:4222"
    assert settings.name is None  # None in Django's settings unsets it
    assert (settings.user, settings.password) == ("u", "p")  # left out of Django's: the environment's
    with pytest.raises(ConfigError, match=r"CONNECT_TIMEOUT .* \(from Django's KEYQUEUE_\* settings or the env"):
        keyqueue_settings(SimpleNamespace(KEYQUEUE_CONNECT_TIMEOUT="soon"), {})


def test_an_app_calls_its_settings_function_when_it_first_needs_them() -> None:
    calls: list[str] = []

    def settings() -> keyqueue.Settings:
        calls.append("read")
        return keyqueue.Settings.from_url("nats://late:4222")

    app = keyqueue.App("lazy-settings", settings=settings, set_as_default=False, autoload_plugins=False)
    assert calls == []
    assert repr(app) == "<App lazy-settings>"
    assert app.settings.url == "nats://late:4222"
    assert app.settings.url == "nats://late:4222"
    assert calls == ["read"]
    overridden = keyqueue.App("lazy-url", url="nats://given:4222", settings=settings, set_as_default=False)
    assert overridden.settings.url == "nats://given:4222"
    wrong = keyqueue.App("lazy-wrong", settings=lambda: "nats://x:1", set_as_default=False)  # type: ignore[arg-type,return-value]
    with pytest.raises(ConfigError, match=r"returned str, not keyqueue\.Settings"):
        wrong.settings  # noqa: B018


# --- the Tasks backend, with Django configured in this process ---


def charge(order_id: int, amount: int = 1) -> dict[str, int]:
    return {"order_id": order_id, "amount": amount}


def with_context(context: Any, order_id: int) -> None: ...


class PaymentDeclined(Exception):
    pass


@pytest.fixture(scope="module")
def backend() -> Iterator[Any]:
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(USE_TZ=True, INSTALLED_APPS=[], TASKS={"default": {
            "BACKEND": "keyqueue.django.backend.KeyqueueBackend", "QUEUES": ["default", "mail"],
            "OPTIONS": {"NAME": "unit-django"}}})
        django.setup()
    from keyqueue.django.framework import task_backends

    yield task_backends["default"]


def test_the_backend_states_what_it_supports(backend: Any) -> None:
    assert (backend.supports_defer, backend.supports_async_task, backend.supports_get_result,
            backend.supports_priority) == (True, True, True, False)
    assert backend.queue_for("default") == "unit-django"
    assert backend.queue_for("mail") == "unit-django-mail"


def test_a_priority_is_refused_with_what_to_do_instead(backend: Any) -> None:
    from keyqueue.django.framework import InvalidTask, task

    declared = task(key="{order_id}")(charge)
    with pytest.raises(InvalidTask, match=r"priority=5, but keyqueue has no priority per request.*queue of its own"):
        declared.using(priority=5)


def test_a_key_template_must_name_the_functions_parameters(backend: Any) -> None:
    from keyqueue.django.framework import InvalidTask, task

    with pytest.raises(InvalidTask, match="names 'order', which is not one of its parameters"):
        task(key="{order}")(charge)
    with pytest.raises(InvalidTask, match="is not one of its parameters"):
        task(key="{context}", takes_context=True)(with_context)  # the context is no argument of a request


def test_keys_from_templates_callables_and_none(backend: Any) -> None:
    from keyqueue.django.backend import _key
    from keyqueue.django.framework import task

    assert _key(task(key="order-{order_id}.{amount}")(charge), "01ID", [7], {}) == "order-7.1"
    assert _key(task(key=lambda order_id, amount=1: f"o{order_id}")(charge), "01ID", [], {"order_id": 8}) == "o8"
    assert _key(task(key="{order_id}", takes_context=True)(with_context), "01ID", [9], {}) == "9"
    assert _key(task()(charge), "01JREQUEST", [1], {}) == "01JREQUEST"  # no key: each request is its own


def test_arguments_must_be_json_as_django_requires(backend: Any) -> None:
    from keyqueue.django.framework import task

    with pytest.raises(TypeError):
        backend._new_result(task(key="{order_id}")(charge), [object()], {})


def test_unknown_options_are_refused(backend: Any) -> None:
    from keyqueue.django.backend import KeyqueueBackend

    with pytest.raises(ConfigError, match="has RESULT_TLL; keyqueue's backend takes APP, NAME, RESULT_TTL"):
        KeyqueueBackend("other", {"OPTIONS": {"RESULT_TLL": 5}})


def test_a_failed_tasks_exception_is_named_by_an_importable_path(backend: Any) -> None:
    from keyqueue.django.backend import _exception_path

    assert _exception_path("ValueError", charge) == "builtins.ValueError"
    assert _exception_path("PaymentDeclined", charge) == f"{__name__}.PaymentDeclined"
    assert _exception_path("SomethingElse", charge) == "keyqueue.errors.RemoteError"
