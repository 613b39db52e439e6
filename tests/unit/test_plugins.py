"""The plugin manager: registration, call order, async hooks, isolation, wrappers, entry points."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import inspect
import logging
import types
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest

import keyqueue
from keyqueue.plugins import hookspecs
from keyqueue.plugins.manager import LifecycleHooks, PluginManager, autoload_disabled
from keyqueue.tasks.task import TaskSpec


class Recorder:
    """A plugin that records the lifecycle hooks it sees under its name."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    @keyqueue.hookimpl
    def keyqueue_worker_started(self, worker: Any) -> None:
        self.log.append(f"started:{self.name}")

    @keyqueue.hookimpl
    async def keyqueue_worker_stopping(self, worker: Any) -> None:
        self.log.append(f"stopping:{self.name}")


def test_closing_hooks_run_in_reverse_of_opening_hooks() -> None:
    log: list[str] = []
    manager = PluginManager(autoload=False, plugins=[Recorder("a", log), Recorder("b", log), Recorder("c", log)])

    async def run() -> None:
        await manager.notify("keyqueue_worker_started", worker=None)
        await manager.notify("keyqueue_worker_stopping", worker=None, reverse=True)

    import asyncio

    asyncio.run(run())
    # pluggy calls the latest registration first; closing hooks mirror that.
    assert log == ["started:c", "started:b", "started:a", "stopping:a", "stopping:b", "stopping:c"]


async def test_a_failing_lifecycle_hook_is_logged_and_the_rest_still_run(caplog: pytest.LogCaptureFixture) -> None:
    log: list[str] = []

    class Broken:
        @keyqueue.hookimpl
        def keyqueue_worker_started(self, worker: Any) -> None:
            raise RuntimeError("plugin bug")

    manager = PluginManager(autoload=False, plugins=[Recorder("a", log), Broken(), Recorder("c", log)])
    with caplog.at_level(logging.ERROR, logger="keyqueue.plugins"):
        await manager.notify("keyqueue_worker_started", worker=None)
    assert log == ["started:c", "started:a"]
    assert "failed in keyqueue_worker_started; carrying on" in caplog.text
    assert "RuntimeError: plugin bug" in caplog.text


NOT_LIFECYCLE = {"keyqueue_register", "keyqueue_add_commands", "keyqueue_build_processor", "keyqueue_retry_policy",
                 "keyqueue_merge_arguments", "keyqueue_wrap_enqueue", "keyqueue_wrap_process",
                 "keyqueue_request_settled"}
"""The hooks that are not lifecycle observers; a new hook must be listed here or get a typed caller."""

CLOSING = {"worker_stopping", "worker_unpinned", "key_released", "request_failed", "request_retried",
           "request_succeeded", "request_superseded", "request_dead_lettered"}


def lifecycle_specs() -> dict[str, Any]:
    """Each lifecycle hookspec by its caller's name (the hook's name without ``keyqueue_``)."""
    return {name.removeprefix("keyqueue_"): spec for name, spec in vars(hookspecs).items()
            if name.startswith("keyqueue_") and name not in NOT_LIFECYCLE}


def test_every_lifecycle_hook_has_a_typed_caller_with_its_parameters() -> None:
    specs = lifecycle_specs()
    callers = {name: f for name, f in vars(LifecycleHooks).items() if not name.startswith("_")}
    assert sorted(callers) == sorted(specs)
    for name, spec in specs.items():
        wanted = [(p.name, p.annotation) for p in inspect.signature(spec).parameters.values()]
        given = [(p.name, p.annotation) for p in inspect.signature(callers[name]).parameters.values()
                 if p.name != "self"]
        assert given == wanted, f"LifecycleHooks.{name} does not take keyqueue_{name}'s parameters"


async def test_each_typed_caller_calls_its_own_hook_closing_hooks_in_reverse() -> None:
    specs = lifecycle_specs()
    log: list[tuple[str, str]] = []

    def plugin(tag: str) -> object:
        def impl(hook: str) -> Any:
            return keyqueue.hookimpl(lambda: log.append((tag, hook)))

        return types.SimpleNamespace(**{f"keyqueue_{name}": impl(f"keyqueue_{name}") for name in specs})

    manager = PluginManager(autoload=False, plugins=[plugin("first"), plugin("second")])
    order: dict[str, list[str]] = {}
    for name, spec in specs.items():
        log.clear()
        await getattr(manager.lifecycle, name)(**dict.fromkeys(inspect.signature(spec).parameters))
        assert {hook for _, hook in log} == {f"keyqueue_{name}"}
        order[name] = [tag for tag, _ in log]
    assert {name for name, tags in order.items() if tags == ["first", "second"]} == CLOSING
    assert {name for name, tags in order.items() if tags == ["second", "first"]} == set(specs) - CLOSING


async def test_around_hooks_nest_sync_and_async_context_managers() -> None:
    log: list[str] = []

    class Span:
        @keyqueue.hookimpl
        def keyqueue_wrap_process(self, queue: str, key: str) -> Any:
            @contextlib.contextmanager
            def span() -> Iterator[None]:
                log.append(f"open span {queue}/{key}")
                yield
                log.append("close span")

            return span()

    class Timer:
        @keyqueue.hookimpl
        def keyqueue_wrap_process(self, requests: Sequence[Any]) -> Any:
            @contextlib.asynccontextmanager
            async def timer() -> AsyncIterator[None]:
                log.append(f"start timer ({len(requests)})")
                yield
                log.append("stop timer")

            return timer()

    class Nothing:
        @keyqueue.hookimpl
        def keyqueue_wrap_process(self) -> None:
            return None

    manager = PluginManager(autoload=False, plugins=[Span(), Timer(), Nothing()])
    async with contextlib.AsyncExitStack() as stack:
        await manager.enter_wrappers(stack, "keyqueue_wrap_process", queue="q", key="k", requests=[1, 2],
                                     context=None)
        log.append("process")
    assert log == ["start timer (2)", "open span q/k", "process", "close span", "stop timer"]


def test_a_later_plugin_overrides_a_builtin_firstresult_hook() -> None:
    spec = TaskSpec(name="t", queue="q", max_attempts=7)

    class Patient:
        @keyqueue.hookimpl
        def keyqueue_retry_policy(self, task: TaskSpec | None) -> keyqueue.RetryPolicy | None:
            return keyqueue.RetryPolicy(max_attempts=99) if task is not None and task.name == "t" else None

    builtin = PluginManager(autoload=False)
    assert builtin.hook.keyqueue_retry_policy(app=None, queue="q", task=spec, request=None).max_attempts == 7
    patched = PluginManager(autoload=False, plugins=[Patient()])
    assert patched.hook.keyqueue_retry_policy(app=None, queue="q", task=spec, request=None).max_attempts == 99


def test_plugins_register_tasks_and_processors_with_an_app() -> None:
    class Shop:
        @keyqueue.hookimpl
        def keyqueue_register(self, app: keyqueue.App) -> None:
            @app.task(key="{order_id}", queue="orders")
            def ship(order_id: str) -> None: ...

            app.register_processor("echo", lambda key: keyqueue.BaseProcessor())

    app = keyqueue.App("plugged", url="nats://127.0.0.1:1", plugins=[Shop()], set_as_default=False,
                       autoload_plugins=False)
    assert app.queues == ["echo", "orders"]
    assert app.find_task("ship").queue == "orders"
    assert app.processor_factory("echo") is not None


def test_mistakes_in_plugins_are_config_errors() -> None:
    class Misspelt:
        @keyqueue.hookimpl
        def keyqueue_worker_start(self, worker: Any) -> None: ...

    class WrongArgument:
        @keyqueue.hookimpl
        def keyqueue_key_acquired(self, holder: Any) -> None: ...

    class PluggyWrapper:
        @keyqueue.hookimpl(wrapper=True)
        def keyqueue_wrap_enqueue(self) -> Iterator[None]:
            yield

    with pytest.raises(keyqueue.ConfigError, match="unknown hook 'keyqueue_worker_start'"):
        PluginManager(autoload=False, plugins=[Misspelt()])
    with pytest.raises(keyqueue.ConfigError, match=r"cannot be registered.*holder"):
        PluginManager(autoload=False, plugins=[WrongArgument()])
    with pytest.raises(keyqueue.ConfigError, match="cannot be pluggy wrappers"):
        PluginManager(autoload=False, plugins=[PluggyWrapper()])


def test_an_entry_point_that_fails_to_load_names_itself_and_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = importlib.metadata.EntryPoint(name="broken", value="no_such_module_kq", group="keyqueue")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [broken] if group == "keyqueue" else [])
    with pytest.raises(keyqueue.ConfigError, match=r"plugin 'broken'.*KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD=1"):
        PluginManager(autoload=True)
    assert PluginManager(autoload=False).get_plugin("broken") is None


def test_autoload_switch() -> None:
    assert not autoload_disabled({})
    assert not autoload_disabled({"KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD": "0"})
    assert not autoload_disabled({"KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD": "false"})
    assert autoload_disabled({"KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert autoload_disabled({"KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD": "yes"})


def test_the_listing_shows_builtins_last_with_their_hooks() -> None:
    log: list[str] = []
    listing = PluginManager(autoload=False, plugins=[Recorder("a", log)]).listing()
    assert [info.builtin for info in listing] == [False, True, True, True, True]
    assert listing[0].hooks == ("keyqueue_worker_started", "keyqueue_worker_stopping")
    builtins = {info.name: info.hooks for info in listing[1:]}
    assert "keyqueue_build_processor" in builtins["keyqueue.builtins.processor"]


def test_spark_commands_come_through_the_entry_point() -> None:
    """The spark plugin's entry point adds `report` and `backfill` to the keyqueue CLI."""
    from click.testing import CliRunner

    from keyqueue.cli import main

    listed = CliRunner().invoke(main, ["--help"])
    assert "report" in listed.output and "backfill" in listed.output
    helped = CliRunner().invoke(main, ["report", "--help"])
    assert helped.exit_code == 0 and "--events-from" in helped.output


@pytest.mark.parametrize("implementations", [1, 2])
def test_first_and_collect_answer_as_pluggy_does_with_one_implementation_or_more(implementations: int) -> None:
    # One implementation is called without pluggy's machinery (a key's processor, each request's
    # settled hook): the answers must not differ from pluggy's, None results and awaitables included.
    calls: list[str] = []

    class Answers:
        def __init__(self, name: str, result: Any) -> None:
            self.name, self.result = name, result

        @keyqueue.hookimpl
        def keyqueue_retry_policy(self, task: TaskSpec | None) -> Any:
            calls.append(f"policy:{self.name}")
            return self.result

        @keyqueue.hookimpl
        async def keyqueue_request_settled(self, queue: str, status: str) -> str:
            calls.append(f"settled:{self.name}:{queue}:{status}")
            return f"{self.name}-{status}"

    class Silent:
        @keyqueue.hookimpl
        def keyqueue_request_settled(self, status: str) -> None:
            calls.append(f"silent:{status}")

    plugins: list[object] = [Answers("a", None)] if implementations == 1 else [Silent(), Answers("a", None)]
    manager = PluginManager(autoload=False, plugins=plugins)
    manager.unregister(name="keyqueue.builtins.processor")  # its keyqueue_retry_policy: ours alone or two
    manager.unregister(name="keyqueue.builtins.workflows")  # its keyqueue_request_settled

    async def run() -> tuple[Any, list[Any]]:
        first = await manager.first("keyqueue_retry_policy", app=None, queue="q", task=None, request=None)
        collected = await manager.collect("keyqueue_request_settled", app=None, queue="q", key="k", request=None,
                                          task=None, status="ok", reply=None, error=None, reason=None,
                                          elapsed=0.0, context=None)
        return first, collected

    first, collected = asyncio.run(run())
    assert first is None
    assert collected == ["a-ok"]
    expected = ["policy:a", "settled:a:q:ok"] if implementations == 1 else ["policy:a", "silent:ok", "settled:a:q:ok"]
    assert calls == expected
    assert len(manager.implementations("keyqueue_request_settled")) == implementations


def test_an_around_hook_with_one_implementation_is_entered_as_with_more() -> None:
    log: list[str] = []

    class Span:
        @keyqueue.hookimpl
        def keyqueue_wrap_process(self, queue: str, key: str) -> Any:
            @contextlib.contextmanager
            def span() -> Iterator[None]:
                log.append(f"open {queue}/{key}")
                yield
                log.append("close")

            return span()

    class Nothing:
        @keyqueue.hookimpl
        def keyqueue_wrap_process(self) -> None:
            log.append("asked")

    async def run(plugin: object) -> list[Any]:
        manager = PluginManager(autoload=False, plugins=[plugin])
        assert len(manager.implementations("keyqueue_wrap_process")) == 1
        wrappers = manager.wrappers("keyqueue_wrap_process", queue="q", key="k", requests=[1], context=None)
        async with contextlib.AsyncExitStack() as stack:
            await manager.enter_each(stack, "keyqueue_wrap_process", wrappers)
            log.append("process")
        return wrappers

    assert len(asyncio.run(run(Span()))) == 1
    assert asyncio.run(run(Nothing())) == []
    assert log == ["open q/k", "process", "close", "asked", "process"]
