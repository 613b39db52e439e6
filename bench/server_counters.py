"""What a workload cost the server, from its own monitoring counters (``/jsz`` and ``/varz``).

Three counts, each a difference between two snapshots taken around a workload:

- **API calls**: ``/jsz`` ``api.total``, the ``$JS.API`` requests the server handled (stream and
  consumer operations, message deletes, purges, ``STREAM.MSG.GET``). nats-server does not count
  pull requests, acks, ``+WPI`` or direct gets there: they are handled by the consumer or the
  stream itself, not by the API;
- **stored messages**: the sum over every stream of its ``last_seq`` (each message a stream
  stores takes a sequence, so this counts what was written, whatever was removed since), lease
  records and events included;
- **client messages**: ``/varz`` ``in_msgs``, every message the server received from a client
  (publishes, pulls, acks, direct gets, replies): the broadest count of round trips.

On a cluster each counter is summed over the servers but for stored messages, where a stream's
sequence is taken once (from the server that reports it highest: its leader or a caught-up replica).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Counters:
    """One snapshot (or, from ``-``, a difference) of the server's counters."""

    api: int
    stored: int
    client_msgs: int

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.api - other.api, self.stored - other.stored, self.client_msgs - other.client_msgs)

    def per(self, n: int, extra_api: int = 0, extra_msgs: int = 0) -> PerUnit:
        """This difference per request (or per key), less ``extra_api`` calls and ``extra_msgs`` client
        messages the measurement made itself (its polls for the queue being drained)."""
        return PerUnit((self.api - extra_api) / n, self.stored / n, (self.client_msgs - extra_msgs) / n,
                       extra_msgs / n)


@dataclass(frozen=True, slots=True)
class PerUnit:
    """Counters per request (or per key)."""

    api: float
    stored: float
    client_msgs: float
    measurement_msgs: float = 0.0
    """Client messages the measurement sent itself, left out of ``client_msgs`` (shown apart)."""

    @property
    def api_and_stored(self) -> float:
        """The issue's figure: JetStream API calls plus stored messages."""
        return self.api + self.stored

    def text(self) -> str:
        return (f"server: {self.api:.2f} API calls + {self.stored:.2f} stored messages = {self.api_and_stored:.2f}, "
                f"{self.client_msgs:.2f} client messages"
                + (f" (the benchmark's own polls, {self.measurement_msgs:.2f}, left out)" if self.measurement_msgs
                   else ""))


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=30) as answer:
        data: dict[str, Any] = json.load(answer)
        return data


def _snapshot(monitoring_urls: Sequence[str]) -> Counters:
    api = client = 0
    sequences: dict[tuple[str, str], int] = {}
    for url in monitoring_urls:
        jsz = _get(f"{url}/jsz?accounts=true&streams=true")
        api += int(jsz.get("api", {}).get("total", 0))
        for account in jsz.get("account_details") or []:
            for stream in account.get("stream_detail") or []:
                name = (account.get("name", ""), stream["name"])
                sequences[name] = max(sequences.get(name, 0), int(stream["state"].get("last_seq", 0)))
        client += int(_get(f"{url}/varz").get("in_msgs", 0))
    return Counters(api, sum(sequences.values()), client)


async def snapshot(monitoring_urls: str | Sequence[str]) -> Counters:
    """The counters of the server (or servers) now; read in a thread (the monitoring port is HTTP)."""
    urls = [monitoring_urls] if isinstance(monitoring_urls, str) else list(monitoring_urls)
    return await asyncio.to_thread(_snapshot, urls)
