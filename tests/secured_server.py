"""A real nats-server locked down as in production: TLS with a certificate made here, a user list,
a token, nkeys or an operator's JWTs, and permissions per user. Shared by the tests of secure
connections and of the permission sets (tests/integration/test_secure_connections.py)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from keyqueue.server.embedded import find_nats_server


def make_certificates(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and localhost, and a client certificate, all signed by the CA."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {name: folder / name for name in ("ca.pem", "ca.key", "server.pem", "server.key", "client.pem",
                                                "client.key")}

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=folder)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=keyqueue test CA",
        "-keyout", "ca.key", "-out", "ca.pem")
    (folder / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}", "-keyout", f"{who}.key",
            "-out", f"{who}.csr")
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "san.cnf", "-out", f"{who}.pem")
    return files


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _jwt(claims: dict[str, Any], signer: Any) -> str:
    """A NATS JWT (``ed25519-nkey``) of ``claims``, signed by the nkey ``signer`` (its issuer)."""
    claims = {**claims, "iat": int(time.time()), "iss": signer.public_key.decode()}
    claims["jti"] = base64.b32encode(hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()) \
        .decode().rstrip("=")
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    return f"{head}.{body}.{_b64(signer.sign(f'{head}.{body}'.encode()))}"


def operator_setup(folder: Path) -> tuple[str, Path]:
    """An operator, an account with JetStream and a user of it: the server's config lines and the user's
    ``.creds`` file, as an operator's tooling (nsc) would issue them."""
    import nkeys

    def keypair(prefix: int) -> Any:
        return nkeys.from_seed(nkeys.encode_seed(hashlib.sha256(str(prefix).encode() + folder.name.encode())
                                                 .digest(), prefix))

    operator, account, user = keypair(nkeys.PREFIX_BYTE_OPERATOR), keypair(nkeys.PREFIX_BYTE_ACCOUNT), \
        keypair(nkeys.PREFIX_BYTE_USER)
    system = nkeys.from_seed(nkeys.encode_seed(hashlib.sha256(b"sys" + folder.name.encode()).digest(),
                                               nkeys.PREFIX_BYTE_ACCOUNT))
    operator_jwt = _jwt({"sub": operator.public_key.decode(), "name": "op",
                         "nats": {"type": "operator", "version": 2}}, operator)
    unlimited = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True,
                 "conn": -1, "leaf": -1, "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
    account_jwt = _jwt({"sub": account.public_key.decode(), "name": "shop",
                        "nats": {"type": "account", "version": 2, "limits": unlimited}}, operator)
    system_jwt = _jwt({"sub": system.public_key.decode(), "name": "SYS",
                       "nats": {"type": "account", "version": 2}}, operator)
    user_jwt = _jwt({"sub": user.public_key.decode(), "name": "worker",
                     "nats": {"type": "user", "version": 2, "subs": -1, "data": -1, "payload": -1}}, account)
    (folder / "operator.jwt").write_text(operator_jwt)
    creds = folder / "user.creds"
    creds.write_text(f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
                     f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n------END USER NKEY SEED------\n")
    config = (f"operator: {json.dumps(str(folder / 'operator.jwt'))}\n"
              f"system_account: {system.public_key.decode()}\n"
              "resolver: MEMORY\n"
              f"resolver_preload: {{ {account.public_key.decode()}: {json.dumps(account_jwt)}, "
              f"{system.public_key.decode()}: {json.dumps(system_jwt)} }}\n")
    return config, creds


def _write_config(folder: Path, config: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    conf = folder / "server.conf"
    conf.write_text(f"listen: 127.0.0.1:-1\nports_file_dir: {json.dumps(str(folder))}\n"
                    f"jetstream {{ store_dir: {json.dumps(str(folder / 'store'))} }}\n{config}\n")
    return conf


def _port(folder: Path) -> int | None:
    """The client port from the server's ports file, once it has written it."""
    ports = list(folder.glob("*.ports"))
    text = ports[0].read_text().strip() if ports else ""
    return int(json.loads(text)["nats"][0].rsplit(":", 1)[1]) if text else None


@asynccontextmanager
async def secured_server(folder: Path, config: str) -> AsyncIterator[int]:
    """Run nats-server with JetStream and ``config`` (authorization, tls, ...) on a free port; yields the port."""
    conf = _write_config(folder, config)
    proc = await asyncio.create_subprocess_exec(find_nats_server(), "-c", str(conf), "-l", str(folder / "log"))
    try:
        port = None
        for _ in range(1000):
            if (port := _port(folder)) is not None:
                break
            if proc.returncode is not None:
                raise AssertionError(f"nats-server exited; its log is {folder / 'log'}")
            await asyncio.sleep(0.02)  # the server writes its ports file once it listens
        assert port is not None, "nats-server did not listen within 20 s"
        yield port
    finally:
        proc.terminate()
        await proc.wait()


def reload_config(folder: Path, port: int, config: str) -> None:
    """Give the server started by :func:`secured_server` in ``folder`` a new ``config`` (on ``port``,
    the one it listens on) and have it reload: clients whose credentials it no longer accepts are
    refused at once (nats-py then closes them for good)."""
    ports = next(folder.glob("*.ports"))
    pid = int(ports.stem.rsplit("_", 1)[1])  # the server names the file nats-server_<pid>.ports
    _write_config(folder, config).write_text(
        (folder / "server.conf").read_text().replace("127.0.0.1:-1", f"127.0.0.1:{port}"))
    os.kill(pid, signal.SIGHUP)
