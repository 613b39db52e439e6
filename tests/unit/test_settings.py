"""Settings: parsing the environment, validation, masking, and nats.connect options."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import pytest

from keyqueue.errors import ConfigError
from keyqueue.settings import Settings


def test_defaults_ask_for_the_embedded_server() -> None:
    settings = Settings()
    assert settings.uses_embedded_server
    assert settings.url is None and settings.connect_timeout == 5.0
    assert Settings.from_env({}) == settings


def test_from_env_reads_every_variable(tmp_path: Path) -> None:
    env = {
        "KEYQUEUE_URL": "nats://a:4222,nats://b:4222",
        "KEYQUEUE_CREDS": "/etc/nats/app.creds",
        "KEYQUEUE_NKEY_SEED": "/etc/nats/app.nk",
        "KEYQUEUE_TOKEN": "tok",
        "KEYQUEUE_USER": "alice",
        "KEYQUEUE_PASSWORD": "s3cret",
        "KEYQUEUE_TLS_CA": "/ca.pem",
        "KEYQUEUE_TLS_CERT": "/cert.pem",
        "KEYQUEUE_TLS_KEY": "/key.pem",
        "KEYQUEUE_TLS_HOSTNAME": "nats.internal",
        "KEYQUEUE_CONNECT_TIMEOUT": "2.5",
        "KEYQUEUE_NAME": "worker-1",
        "UNRELATED": "x",
    }
    assert Settings.from_env(env) == Settings(
        url="nats://a:4222,nats://b:4222",
        creds_file="/etc/nats/app.creds",
        nkey_seed="/etc/nats/app.nk",
        token="tok",
        user="alice",
        password="s3cret",
        tls_ca="/ca.pem",
        tls_cert="/cert.pem",
        tls_key="/key.pem",
        tls_hostname="nats.internal",
        connect_timeout=2.5,
        name="worker-1",
    )


def test_from_env_honours_the_prefix_and_ignores_empty_values() -> None:
    env = {"APP_URL": "nats://x:1", "APP_TOKEN": "", "KEYQUEUE_URL": "nats://other:2"}
    assert Settings.from_env(env, prefix="APP_") == Settings(url="nats://x:1")


def test_from_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYQUEUE_URL", "nats://from-env:4222")
    assert Settings.from_env().url == "nats://from-env:4222"


@pytest.mark.parametrize("raw", ["soon", "1,5", "-1", "0", "nan"])
def test_bad_connect_timeout_names_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match="KEYQUEUE_CONNECT_TIMEOUT"):
        Settings.from_env({"KEYQUEUE_CONNECT_TIMEOUT": raw})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"url": " , "}, "names no server"),
        ({"url": "nats://h:1", "password": "p"}, "without a user"),
        ({"url": "nats://h:1", "tls_key": "/k.pem"}, "without tls_cert"),
        ({"connect_timeout": 0}, "positive"),
    ],
)
def test_inconsistent_settings_are_config_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Settings(**kwargs)  # type: ignore[arg-type]


def test_from_url_and_with_url() -> None:
    settings = Settings.from_url("nats://h:4222", name="api", connect_timeout=1)
    assert (settings.url, settings.name, settings.connect_timeout) == ("nats://h:4222", "api", 1)
    moved = settings.with_url("nats://other:4222")
    assert moved.url == "nats://other:4222" and moved.name == "api"
    assert settings.url == "nats://h:4222"
    assert Settings().with_url("nats://127.0.0.1:5000").uses_embedded_server is False


def test_repr_masks_secrets() -> None:
    settings = Settings(
        url="nats://bob:urlpass@a:4222,nats://urltoken@b:4222,nats://c:4222",
        user="alice",
        password="hunter2",
        token="tok-123",
        nkey_seed="/seeds/app.nk",
    )
    shown = repr(settings)
    for secret in ("urlpass", "urltoken", "hunter2", "tok-123"):
        assert secret not in shown
    assert "nats://bob:***@a:4222,nats://***@b:4222,nats://c:4222" in shown
    assert "user='alice'" in shown and "password='***'" in shown and "token='***'" in shown
    assert "nkey_seed='/seeds/app.nk'" in shown  # the path is shown; its contents never are
    assert str(settings) == shown


def test_connect_options_for_a_plain_url() -> None:
    options = Settings.from_url(" nats://a:4222 , nats://b:4222 ", name="w").nats_connect_options()
    assert options == {
        "servers": ["nats://a:4222", "nats://b:4222"],
        "connect_timeout": 5.0,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "pending_size": 0,
        "name": "w",
    }


def test_connect_options_carry_credentials(tmp_path: Path) -> None:
    creds, seed = tmp_path / "app.creds", tmp_path / "app.nk"
    creds.write_text("-----BEGIN NATS USER JWT-----\n")
    seed.write_text("SUAEXAMPLE\n")
    options = Settings(
        url="nats://h:4222",
        creds_file=str(creds),
        nkey_seed=str(seed),
        token="t",
        user="u",
        password="p",
    ).nats_connect_options()
    assert options["user_credentials"] == str(creds)
    assert options["nkeys_seed"] == str(seed)
    assert (options["token"], options["user"], options["password"]) == ("t", "u", "p")
    assert "tls" not in options


def test_missing_files_are_config_errors_naming_the_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    for field in ("creds_file", "nkey_seed", "tls_ca", "tls_cert"):
        settings = Settings(url="nats://h:4222", **{field: missing})  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"nope\.pem"):
            settings.nats_connect_options()


def test_embedded_settings_have_no_connect_options() -> None:
    with pytest.raises(ConfigError, match="with_url"):
        Settings().nats_connect_options()


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=nats.test",
         "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def test_tls_options_build_an_ssl_context(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    options = Settings(
        url="nats://h:4222", tls_ca=str(cert), tls_cert=str(cert), tls_key=str(key), tls_hostname="nats.test"
    ).nats_connect_options()
    context = options["tls"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert options["tls_hostname"] == "nats.test"


def test_tls_url_scheme_alone_turns_tls_on() -> None:
    options = Settings.from_url("tls://h:4222").nats_connect_options()
    assert isinstance(options["tls"], ssl.SSLContext)


def test_a_key_that_does_not_match_is_a_config_error(tmp_path: Path) -> None:
    cert, _ = _self_signed(tmp_path)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a key")
    settings = Settings(url="nats://h:4222", tls_cert=str(cert), tls_key=str(garbage))
    with pytest.raises(ConfigError, match=r"garbage\.pem"):
        settings.nats_connect_options()


@pytest.mark.parametrize("url", ["http://127.0.0.1:4222", "nats://a:4222,https://user:secret@b:4222", "NATS://h:1"])
def test_a_url_scheme_nats_cannot_use_is_one_clear_line(url: str) -> None:
    scheme = url.split(",")[-1].partition("://")[0]
    with pytest.raises(ConfigError) as error:
        Settings.from_url(url)
    message = str(error.value)
    assert message.endswith(f" has the scheme {scheme!r}; NATS URLs use nats://, tls://, ws://, wss:// "
                            "(e.g. nats://127.0.0.1:4222)")
    assert "\n" not in message and "secret" not in message
    with pytest.raises(ConfigError, match=r"scheme 'http'.*\(from KEYQUEUE_\* environment variables\)$"):
        Settings.from_env({"KEYQUEUE_URL": "http://127.0.0.1:4222"})


@pytest.mark.parametrize("url", ["nats://h:1", "tls://h:1", "ws://h:80", "wss://h", "127.0.0.1:4222", "h"])
def test_the_schemes_nats_uses_and_none_are_accepted(url: str) -> None:
    assert Settings.from_url(url).url == url
