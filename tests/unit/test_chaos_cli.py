"""``python -m keyqueue.chaos``'s options: the classes it accepts and the topology they need."""

from __future__ import annotations

import pytest

from keyqueue.chaos.__main__ import main
from keyqueue.chaos.soak import CLASSES, CLUSTER_CLASSES, SoakOptions


@pytest.mark.parametrize(("argv", "complaint"), [
    (["--classes", "network,bogus"], "unknown fault class(es): bogus"),
    (["--classes", "partition", "--nodes", "1"], "partition need a cluster"),
    (["--handlers", "thread,bogus"], "unknown handler(s): bogus; choose from async, thread, process, gil, "
                                     "blocking, bad-input or all"),
])
def test_bad_class_choices_are_refused_before_anything_starts(argv: list[str], complaint: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert complaint in capsys.readouterr().err


def test_a_cluster_class_runs_the_soak_on_three_nodes() -> None:
    assert set(CLUSTER_CLASSES) < set(CLASSES)
    for name in CLUSTER_CLASSES:
        assert SoakOptions(classes=(name,)).clustered
    assert not SoakOptions(classes=("network", "process", "server", "clock")).clustered
    assert SoakOptions(classes=("network",), nodes=3).clustered
    assert not SoakOptions(classes=()).clustered
