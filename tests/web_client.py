"""HTTP over a unix socket to a web server a test started (gunicorn, uvicorn), answers as JSON.
Shared by the tests that run a real web app the way users deploy one."""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any


class UnixHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection to a server bound to a unix socket (``--bind unix:PATH``, ``--uds PATH``)."""

    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=60)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(self.path)


def request(path: str, url: str, method: str = "GET") -> tuple[int, Any]:
    """``(status, the JSON body)`` of one request to the server on the unix socket ``path``."""
    connection = UnixHTTPConnection(path)
    try:
        connection.request(method, url)
        response = connection.getresponse()
        body = response.read()
        try:
            return response.status, json.loads(body)
        except ValueError:
            return response.status, body.decode(errors="replace")
    finally:
        connection.close()


def get(path: str, url: str, method: str = "GET") -> Any:
    """The JSON body of a request that must answer 200."""
    status, body = request(path, url, method)
    assert status == 200, (method, url, status, body)
    return body
