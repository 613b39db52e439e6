"""An optional part whose extra is not installed says how to install it into this Python: from the
checkout when keyqueue runs from a clone of its repository (the package index has no copy of the
clone), and from the index."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import keyqueue
from keyqueue import errors
from keyqueue.cli import main
from keyqueue.metrics.prometheus import require_client

ROOT = Path(keyqueue.__file__).resolve().parents[1]


def test_the_dashboard_without_its_extra_names_the_checkout_to_install_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if the extra were not installed
    done = CliRunner().invoke(main, ["dashboard"])
    assert done.exit_code == 1
    message = " ".join(done.output.split())
    assert "the dashboard needs keyqueue's 'dashboard' extra (uvicorn is missing)" in message
    assert f"{sys.executable} -m pip install -e '{ROOT}[dashboard]'" in message
    assert "'keyqueue[dashboard]'" in message


def test_metrics_without_their_extra_say_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(keyqueue.MissingExtra, match=r"-m pip install -e '.*\[metrics\]'") as missing:
        require_client()
    assert isinstance(missing.value, keyqueue.ConfigError) and missing.value.extra == "metrics"


def test_an_installed_release_is_told_the_index_first_and_a_clone_second(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(errors, "__file__", "/site-packages/keyqueue/errors.py")  # no pyproject.toml beside it
    message = str(keyqueue.MissingExtra("the dashboard", "dashboard", "uvicorn"))
    assert message == (f"the dashboard needs keyqueue's 'dashboard' extra (uvicorn is missing): install it: "
                       f"{sys.executable} -m pip install 'keyqueue[dashboard]' (in a clone of keyqueue's repository, "
                       f"from the checkout: {sys.executable} -m pip install -e '.[dashboard]')")
