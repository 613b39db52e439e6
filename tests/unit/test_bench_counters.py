"""What the benchmark reports of the server's counters: per unit, less what it sent itself."""

from __future__ import annotations

from bench.server_counters import Counters


def test_the_measurements_own_calls_and_messages_are_left_out_and_said_apart() -> None:
    # 2,000 keys: 2,100 API calls of which 100 were the benchmark's polls; 17,000 client messages of
    # which 1,000 were its polls.
    per = (Counters(api=2_100, stored=10_000, client_msgs=17_000) - Counters(0, 0, 0)).per(
        2_000, extra_api=100, extra_msgs=1_000)
    assert (per.api, per.stored, per.client_msgs, per.measurement_msgs) == (1.0, 5.0, 8.0, 0.5)
    assert per.text() == ("server: 1.00 API calls + 5.00 stored messages = 6.00, 8.00 client messages "
                          "(the benchmark's own polls, 0.50, left out)")
    # A measurement that sent nothing says nothing of it.
    assert Counters(10, 20, 30).per(10).text() == ("server: 1.00 API calls + 2.00 stored messages = 3.00, "
                                                   "3.00 client messages")
