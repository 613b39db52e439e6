"""The Rebaser as a keyqueue plugin: queue ``rebaser``, a :class:`RebaserProcessor` per change set.

Run a worker with keyqueue's own command line::

    keyqueue worker keyqueue_rebaser.app:app --url nats://127.0.0.1:4222 --concurrency 64

``keyqueue_rebaser.app:app`` is a ``keyqueue.App`` with this plugin. To add the Rebaser to an app
of your own, pass ``RebaserPlugin()`` in ``App(plugins=[...])``. Installing the
``keyqueue-rebaser`` distribution (``contrib/rebaser/pyproject.toml``) registers :data:`plugin`
through its ``keyqueue`` entry point: it adds the ``keyqueue rebaser`` commands (and the DVU event
names) everywhere, but no queue: an installed plugin must not make every app's workers serve a
queue their app never asked for.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Mapping
from dataclasses import replace
from typing import Any

import click

from keyqueue import App, KeyProcessor, QueueConfig, Worker
from keyqueue import hookimpl as keyqueue_hookimpl
from keyqueue.events import publish_event
from keyqueue.ext import Client, connect

from .functions import FunctionRegistry, load_functions
from .processor import Observer, PublishEvent, RebaserProcessor, RebaserSettings
from .store import SnapshotStore

__all__ = ["RebaserCommands", "RebaserPlugin", "RebaserProcessors", "plugin", "queue_config"]


def queue_config(*, ack_wait: float = 30.0, queue: str = "rebaser") -> QueueConfig:
    """The ``rebaser`` queue's configuration (every producer and worker must agree on it)."""
    return QueueConfig(queue, ack_wait=ack_wait)


class RebaserProcessors:
    """Builds a :class:`RebaserProcessor` per key session; all share one snapshot store per connection."""

    def __init__(self, nc: Client, store: SnapshotStore, functions: FunctionRegistry, *,
                 settings: RebaserSettings | None = None, observer: Observer | None = None,
                 publish_event: PublishEvent | None = None) -> None:
        self.nc = nc
        self.store = store
        self.functions = functions
        self.settings = settings or RebaserSettings()
        self.observer = observer
        self.publish_event = publish_event

    @classmethod
    async def open(cls, nc: Client, *, settings: RebaserSettings | None = None,
                   functions: FunctionRegistry | None = None, observer: Observer | None = None,
                   publish_event: PublishEvent | None = None) -> RebaserProcessors:
        """The factory, with the snapshot bucket created if missing and the functions loaded from plugins."""
        settings = settings or RebaserSettings()
        store = await SnapshotStore.open(nc, settings.bucket)
        return cls(nc, store, functions or load_functions(), settings=settings, observer=observer,
                   publish_event=publish_event)

    async def _send(self, inbox: str, headers: Mapping[str, str], body: bytes) -> None:
        await self.nc.publish(inbox, body, headers=dict(headers))

    def __call__(self, key: str, worker: str | None = None) -> RebaserProcessor:
        settings = self.settings
        if worker is not None and worker != settings.worker:
            settings = replace(settings, worker=worker)
        return RebaserProcessor(self.store, self.functions, self._send, settings=settings, observer=self.observer,
                                publish_event=self.publish_event)


class RebaserPlugin:
    """Registers queue ``rebaser`` with an app, served by Rebaser processors.

    ``functions`` defaults to the built-ins plus the ``keyqueue.rebaser`` entry points;
    ``observer`` sees every Rebaser event (``applied``, ``dvu_started``, ...); ``ack_wait``, if
    given, configures the queue's lease (producers must use the same).
    """

    def __init__(self, *, settings: RebaserSettings | None = None, functions: FunctionRegistry | None = None,
                 observer: Observer | None = None, ack_wait: float | None = None) -> None:
        self.settings = settings or RebaserSettings()
        self.functions = functions
        self.observer = observer
        self.ack_wait = ack_wait
        self._factories: dict[int, RebaserProcessors] = {}
        self._registered: set[int] = set()

    async def _factory(self, app: App) -> RebaserProcessors:
        nc = await app.connection()
        factory = self._factories.get(id(nc))
        if factory is None or factory.nc is not nc:
            if self.functions is None:
                self.functions = load_functions()
            queue = self.settings.queue

            async def publish(name: str, key: str, fields: dict[str, Any]) -> None:
                await publish_event(app, name, queue, key, **fields)

            factory = await RebaserProcessors.open(nc, settings=self.settings, functions=self.functions,
                                                   observer=self.observer, publish_event=publish)
            self._factories[id(nc)] = factory
        return factory

    async def _build(self, app: App, key: str, worker: str) -> KeyProcessor:
        return (await self._factory(app))(key, worker)

    @keyqueue_hookimpl
    def keyqueue_register(self, app: App) -> None:
        queue = self.settings.queue
        if app.processor_factory(queue) is not None:
            return  # another Rebaser plugin (say, the entry point's) registered the queue first
        config = queue_config(queue=queue, ack_wait=self.ack_wait) if self.ack_wait is not None else None
        default_worker = f"{socket.gethostname()}:{os.getpid()}"
        app.register_processor(queue, lambda key: self._build(app, key, default_worker), config=config)
        self._registered.add(id(app))

    @keyqueue_hookimpl
    def keyqueue_build_processor(self, app: App, worker: Worker, queue: str, key: str
                                 ) -> Awaitable[KeyProcessor] | None:
        # Only for the apps this instance registered with, so each DVU run records its worker.
        if queue != self.settings.queue or id(app) not in self._registered:
            return None
        return self._build(app, key, worker.name)

    @keyqueue_hookimpl
    def keyqueue_add_commands(self, cli: Any) -> None:
        if "rebaser" not in getattr(cli, "commands", {}):
            cli.add_command(rebaser_commands)


@click.group("rebaser")
def rebaser_commands() -> None:
    """The Rebaser's change sets (contrib/rebaser)."""


@rebaser_commands.command("show")
@click.argument("workspace")
@click.argument("change_set")
@click.option("--url", envvar="KEYQUEUE_URL", default="nats://127.0.0.1:4222", show_default=True)
@click.option("--bucket", default="rebaser_snapshots", show_default=True)
def show(workspace: str, change_set: str, url: str, bucket: str) -> None:
    """Print a change set's values, pending roots and DVU runs."""
    import asyncio

    from .client import change_set_key

    async def run() -> None:
        nc = await connect(url, name="rebaser-show")
        try:
            store = await SnapshotStore.open(nc, bucket)
            state, revision = await store.load(change_set_key(workspace, change_set))
        finally:
            await nc.close()
        click.echo(f"change set {workspace}.{change_set}: revision {revision}, {state.change} changes applied, "
                   f"fencing {state.fencing}")
        for name, node in sorted(state.nodes.items()):
            how = f" = {node.function}({', '.join(node.inputs)})" if node.function else ""
            error = f"  [error: {node.error}]" if node.error else ""
            click.echo(f"  {name}{how}: {node.value!r}{error}")
        click.echo(f"DVU: {state.dvu_runs} runs for {state.triggers} triggers; pending roots: "
                   f"{', '.join(sorted(state.roots)) or 'none'}")
        for run in state.dvu_history[-10:]:
            click.echo(f"  run {run.run}: through change {run.covered}, {run.triggers} triggers, "
                       f"{run.recomputed} recomputed in {run.finished - run.started:.3f}s on {run.worker}")

    asyncio.run(run())


class RebaserCommands:
    """What the entry point registers with every app: the ``keyqueue rebaser`` commands only."""

    @keyqueue_hookimpl
    def keyqueue_add_commands(self, cli: Any) -> None:
        if "rebaser" not in getattr(cli, "commands", {}):
            cli.add_command(rebaser_commands)


plugin = RebaserCommands()
"""The instance the ``keyqueue`` entry point of ``keyqueue-rebaser`` registers."""
