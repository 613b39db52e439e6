"""A locked-down NATS, as production runs it: a real nats-server that requires TLS (a certificate made
here) or each kind of credential, used the way a user does (``keyqueue worker`` and ``keyqueue
enqueue`` configured by ``KEYQUEUE_*`` variables), and the permission set of each role
(``keyqueue permissions``): a producer with only its own enqueues and can neither read nor purge."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import nkeys
import pytest
from command_output import Command
from secured_server import make_certificates, operator_setup, secured_server

from keyqueue.admin.permissions import server_block

ROOT = Path(__file__).parents[2]
KEYQUEUE = str(Path(sys.executable).with_name("keyqueue"))
ORDER = '{"order_id": "o1", "amount": 3}'


def environment(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYQUEUE_")}
    env.update(KEYQUEUE_DISABLE_PLUGIN_AUTOLOAD="1", **values)
    return env


async def keyqueue_cli(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(KEYQUEUE, *args, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def enqueue_and_run(worker_env: dict[str, str], producer_env: dict[str, str]) -> None:
    """A worker process and a producer, each with its own configuration, get a request done."""
    worker = await Command.start(KEYQUEUE, "worker", "examples.quickstart.app:app", "-q", "shop", env=worker_env,
                                 cwd=ROOT)
    try:
        await worker.wait_for(r"queue shop: charge, refund")
        code, out, err = await keyqueue_cli(producer_env, "enqueue", "examples.quickstart.app:app", "charge", ORDER,
                                            "--wait")
        assert code == 0, err
        assert json.loads(out)["charged"] == 3
    finally:
        assert await worker.stop() == 0, worker.output


async def test_a_server_that_requires_tls_and_client_certificates(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path / "certs")
    config = (f'tls {{ cert_file: "{certs["server.pem"]}", key_file: "{certs["server.key"]}", '
              f'ca_file: "{certs["ca.pem"]}", verify: true }}')
    async with secured_server(tmp_path / "server", config) as port:
        env = environment(KEYQUEUE_URL=f"tls://127.0.0.1:{port}", KEYQUEUE_TLS_CA=str(certs["ca.pem"]),
                          KEYQUEUE_TLS_CERT=str(certs["client.pem"]), KEYQUEUE_TLS_KEY=str(certs["client.key"]))
        await enqueue_and_run(env, env)
        # Without a client certificate the server refuses the connection: one line, exit status 1.
        no_cert = environment(KEYQUEUE_URL=f"tls://127.0.0.1:{port}", KEYQUEUE_TLS_CA=str(certs["ca.pem"]))
        code, _, err = await keyqueue_cli(no_cert, "enqueue", "examples.quickstart.app:app", "charge", ORDER)
        assert code == 1 and err.startswith("Error: cannot connect to NATS at tls://127.0.0.1"), err
        # Without the CA, the server's certificate is not trusted.
        code, _, err = await keyqueue_cli(environment(KEYQUEUE_URL=f"tls://127.0.0.1:{port}"), "enqueue",
                                          "examples.quickstart.app:app", "charge", ORDER)
        assert code == 1 and "certificate" in err.lower(), err


def _credentials(kind: str, folder: Path) -> tuple[str, dict[str, str], dict[str, str]]:
    """Server configuration, a good client's KEYQUEUE_* variables, and a bad client's."""
    if kind == "user-password":
        return ('authorization { users: [ { user: "shop", password: "s3cret-pw" } ] }',
                {"KEYQUEUE_USER": "shop", "KEYQUEUE_PASSWORD": "s3cret-pw"},
                {"KEYQUEUE_USER": "shop", "KEYQUEUE_PASSWORD": "wrong-pw"})
    if kind == "token":
        return ('authorization { token: "t0ken-abc" }', {"KEYQUEUE_TOKEN": "t0ken-abc"},
                {"KEYQUEUE_TOKEN": "not-the-token"})
    if kind == "nkey":
        user, stranger = nkeys.from_seed(nkeys.encode_seed(b"u" * 32, nkeys.PREFIX_BYTE_USER)), \
            nkeys.from_seed(nkeys.encode_seed(b"x" * 32, nkeys.PREFIX_BYTE_USER))
        (folder / "user.nk").write_bytes(user.seed)
        (folder / "stranger.nk").write_bytes(stranger.seed)
        return (f'authorization {{ users: [ {{ nkey: "{user.public_key.decode()}" }} ] }}',
                {"KEYQUEUE_NKEY_SEED": str(folder / "user.nk")}, {"KEYQUEUE_NKEY_SEED": str(folder / "stranger.nk")})
    config, creds = operator_setup(folder)
    other = operator_setup(folder / "other")[1]  # issued by another operator: unknown here
    return config, {"KEYQUEUE_CREDS": str(creds)}, {"KEYQUEUE_CREDS": str(other)}


@pytest.mark.parametrize("kind", ["user-password", "token", "nkey", "creds"])
async def test_each_credential_kind_against_a_server_that_requires_it(kind: str, tmp_path: Path) -> None:
    (tmp_path / "keys" / "other").mkdir(parents=True)
    config, good, bad = _credentials(kind, tmp_path / "keys")
    async with secured_server(tmp_path / "server", config) as port:
        url = f"nats://127.0.0.1:{port}"
        await enqueue_and_run(environment(KEYQUEUE_URL=url, **good), environment(KEYQUEUE_URL=url, **good))
        code, out, err = await keyqueue_cli(environment(KEYQUEUE_URL=url, **bad), "enqueue",
                                            "examples.quickstart.app:app", "charge", ORDER)
        assert code == 1 and err.startswith(f"Error: cannot connect to NATS at {url}"), err
        assert "Authorization" in err or "authorization" in err, err
        for secret in ("s3cret-pw", "wrong-pw", "t0ken-abc", "not-the-token"):
            assert secret not in out + err  # no secret in what a user sees (or a log collects)


def _user(name: str, role: str) -> str:
    block = server_block(role, ["shop"])  # type: ignore[arg-type]
    return f'{{ user: "{name}", password: "{name}-pw", {block} }}'


async def test_each_role_can_do_its_work_and_a_producer_can_neither_read_nor_purge(tmp_path: Path) -> None:
    users = ", ".join(_user(name, role) for name, role in
                      (("producer", "producer"), ("worker", "worker"), ("dash", "dashboard"), ("ops", "operator")))
    async with secured_server(tmp_path / "server", f"authorization {{ users: [ {users} ] }}") as port:
        url = f"nats://127.0.0.1:{port}"

        def as_user(name: str) -> dict[str, str]:
            return environment(KEYQUEUE_URL=url, KEYQUEUE_USER=name, KEYQUEUE_PASSWORD=f"{name}-pw")

        # The worker creates the queue's streams; the producer, with only its permissions, enqueues.
        await enqueue_and_run(as_user("worker"), as_user("producer"))
        code, _, err = await keyqueue_cli(as_user("producer"), "enqueue", "examples.quickstart.app:app", "charge",
                                          ORDER)
        assert code == 0, err
        # It starts a workflow whose first step runs in its queue (the workers created its workflows stream).
        started = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "from examples.quickstart.app import charge, refund; "
            "print((charge.si('o2', 1) | refund.si('o2', 1)).delay(workflow_id='wf-role').workflow_id)",
            cwd=ROOT, env=as_user("producer"), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out_b, err_b = await asyncio.wait_for(started.communicate(), 90)
        assert (started.returncode, out_b) == (0, b"wf-role\n"), err_b.decode()
        code, out, err = await keyqueue_cli(as_user("ops"), "status", "shop", "wf-role")
        assert (code, out) == (0, "pending\n"), err
        # It cannot read what is stored, nor purge it.
        for args in (["inspect", "shop"], ["dlq", "list", "shop"], ["purge", "shop", "--yes"],
                     ["status", "shop", "any-id"]):
            code, _, err = await keyqueue_cli(as_user("producer"), *args)
            assert code == 1 and "ermission" in err, (args, err)
        # The dashboard reads, and may not write.
        code, out, err = await keyqueue_cli(as_user("dash"), "inspect", "shop")
        assert code == 0 and "shop" in out, err
        code, _, err = await keyqueue_cli(as_user("dash"), "purge", "shop", "--yes")
        assert code == 1 and "ermission" in err, err
        # The operator purges.
        code, out, err = await keyqueue_cli(as_user("ops"), "purge", "shop", "--yes")
        assert (code, out) == (0, "removed 2 pending request(s) from queue shop\n"), err


UNKEYED_APP = '''
import keyqueue

app = keyqueue.App("shop", set_as_default=False)


@app.task()
async def add(x: int, y: int) -> int:
    return x + y
'''


async def test_the_roles_cover_unkeyed_tasks(tmp_path: Path) -> None:
    (tmp_path / "unkeyed_shop.py").write_text(UNKEYED_APP)
    users = ", ".join(_user(name, role) for name, role in (("producer", "producer"), ("worker", "worker")))
    async with secured_server(tmp_path / "server", f"authorization {{ users: [ {users} ] }}") as port:
        url = f"nats://127.0.0.1:{port}"

        def as_user(name: str) -> dict[str, str]:
            return environment(KEYQUEUE_URL=url, KEYQUEUE_USER=name, KEYQUEUE_PASSWORD=f"{name}-pw",
                               PYTHONPATH=str(tmp_path))

        # The worker makes the work stream and its consumer, pulls, acks; the producer stores there.
        worker = await Command.start(KEYQUEUE, "worker", "unkeyed_shop:app", env=as_user("worker"), cwd=ROOT)
        try:
            await worker.wait_for(r"queue shop: add \(unkeyed\)")
            code, out, err = await keyqueue_cli(as_user("producer"), "enqueue", "unkeyed_shop:app", "add",
                                                '{"x": 2, "y": 3}', "--wait")
            assert code == 0, err
            assert json.loads(out) == 5
            code, out, err = await keyqueue_cli(as_user("worker"), "purge", "shop", "--key", "~", "--yes")
            assert (code, out) == (0, "no pending requests in queue shop (unkeyed)\n"), err  # it was acked
        finally:
            assert await worker.stop() == 0, worker.output
        assert "ermission" not in worker.output, worker.output
