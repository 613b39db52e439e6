"""``keyqueue dashboard``: serve the web dashboard (``keyqueue.dashboard``) until Ctrl-C."""

from __future__ import annotations

import asyncio
import logging
import socket

import click

from keyqueue.cli.common import configure_logging, connection, load_app, url_option
from keyqueue.errors import MissingExtra

__all__ = ["dashboard"]

log = logging.getLogger("keyqueue.dashboard")


@click.command()
@click.option("--app", "app_spec", metavar="MODULE:APP", default=None,
              help="Show only this app's queues (default: every queue on the server).")
@url_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but loopback needs a token or basic credentials.")
@click.option("--port", type=click.IntRange(0, 65535), default=8787, show_default=True)
@click.option("--read-only", is_flag=True, help="Hide and refuse every action (replay, delete, purge).")
@click.option("--token", envvar="KEYQUEUE_DASHBOARD_TOKEN", show_envvar=True, default=None,
              help="Require this bearer token (or ?token= once, which sets a cookie).")
@click.option("--user", envvar="KEYQUEUE_DASHBOARD_USER", show_envvar=True, default=None,
              help="Require basic credentials: this user name ...")
@click.option("--password", envvar="KEYQUEUE_DASHBOARD_PASSWORD", show_envvar=True, default=None,
              help="... and this password (prefer the environment variable: flags show in ps).")
@click.option("--viewer-token", envvar="KEYQUEUE_DASHBOARD_VIEWER_TOKEN", show_envvar=True, default=None,
              help="A token for the viewer role: every page, no action.")
@click.option("--viewer-user", envvar="KEYQUEUE_DASHBOARD_VIEWER_USER", show_envvar=True, default=None,
              help="Basic credentials for the viewer role: this user name ...")
@click.option("--viewer-password", envvar="KEYQUEUE_DASHBOARD_VIEWER_PASSWORD", show_envvar=True, default=None,
              help="... and this password.")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME[:PORT]",
              help="Also serve this Host (a tunnel's or a proxy's name); on loopback, only the loopback names "
                   "with the dashboard's port are served otherwise. Repeatable.")
@click.option("--stuck-after", type=click.FloatRange(1), default=60.0, show_default=True, metavar="SECONDS",
              help="A held key with no event and no progress message for this long is listed as stuck.")
@click.option("--max-wait", type=click.FloatRange(1), default=300.0, show_default=True, metavar="SECONDS",
              help="/health fails a queue whose oldest stored request has waited longer.")
@click.option("--refresh", type=click.FloatRange(0.2), default=1.0, show_default=True, metavar="SECONDS",
              help="Seconds between two snapshots of the queues.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
              default="info", show_default=True, envvar="KEYQUEUE_LOG_LEVEL", show_envvar=True)
def dashboard(app_spec: str | None, url: str | None, host: str, port: int, read_only: bool, token: str | None,
              user: str | None, password: str | None, viewer_token: str | None, viewer_user: str | None,
              viewer_password: str | None, allow_hosts: tuple[str, ...], stuck_after: float, max_wait: float,
              refresh: float, log_level: str) -> None:
    """Serve a live web dashboard: queues, keys and their holders, workers, dead letters, metrics.

    Listens on loopback by default and asks for nothing there, serving only requests that name
    the loopback address and its port (a page that rebinds its own name to 127.0.0.1 is refused);
    on any other address it needs an operator's token (--token / KEYQUEUE_DASHBOARD_TOKEN) or basic
    credentials (--user and --password). Viewers (--viewer-token, or --viewer-user and
    --viewer-password) see every page and take no action. Actions (replay, delete, purge, cancel,
    bulk actions on a filter) are refused from another site's pages, confirmed with the number of
    requests they touch, and kept in an audit log (the Audit page); --read-only hides and refuses
    them. /health answers a verdict per queue, /metrics Prometheus metrics. See docs/dashboard.md.

    \b
    Examples:
      $ keyqueue dashboard                          # http://127.0.0.1:8787
      $ KEYQUEUE_DASHBOARD_TOKEN=... keyqueue dashboard --host 0.0.0.0 --read-only
      $ keyqueue dashboard --allow-host localhost:9000   # behind ssh -L 9000:localhost:8787
    """
    configure_logging(log_level)
    try:
        import uvicorn

        from keyqueue.dashboard.security import Access, HostPolicy, url_host
        from keyqueue.dashboard.state import Monitor
        from keyqueue.dashboard.web import DashboardOptions, create_app
    except ImportError as exc:
        raise MissingExtra("the dashboard", "dashboard", exc.name) from None
    access = Access(token=token or None, user=user or None, password=password or None,
                    viewer_token=viewer_token or None, viewer_user=viewer_user or None,
                    viewer_password=viewer_password or None)
    access.check(host)
    options = DashboardOptions(access, HostPolicy(host, tuple(allow_hosts)), read_only=read_only,
                               stuck_after=stuck_after, max_wait=max_wait)
    queues = load_app(app_spec, url).queues if app_spec else None

    async def run() -> None:
        async with connection(url) as nc:
            monitor = Monitor(nc, queues=queues, refresh=refresh)
            await monitor.poll()
            app = create_app(monitor, options)
            config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                    lifespan="off", timeout_graceful_shutdown=1)
            server = _server_class()(config)
            async with asyncio.TaskGroup() as group:
                polling = group.create_task(monitor.run(), name="keyqueue-dashboard-monitor")
                serving = group.create_task(server.serve(), name="keyqueue-dashboard-server")
                await asyncio.wait([serving, group.create_task(server.up.wait())], return_when=asyncio.FIRST_COMPLETED)
                if server.started:
                    bound = server.servers[0].sockets[0].getsockname()[1] if server.servers else port
                    mode = "read-only, " if read_only else ""
                    click.echo(f"keyqueue dashboard on http://{url_host(host)}:{bound}/ ({mode}guarded by "
                               f"{access.describe()}); Ctrl-C to stop", err=True)
                try:
                    await serving
                finally:
                    polling.cancel()
                    server.up.set()

    asyncio.run(run())


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, with an event set once it listens."""

        def __init__(self, config: uvicorn.Config) -> None:
            super().__init__(config)
            self.up = asyncio.Event()

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            self.up.set()

    return Server
