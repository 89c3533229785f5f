"""`ConnectorConfig`: bind and advertised addresses of the control and data planes."""

from __future__ import annotations

import pytest

from rapidkv.connector.config import ConnectorConfig, kv_transfer_config

pytestmark = pytest.mark.unit


def config(**extra: object) -> ConnectorConfig:
    return ConnectorConfig.from_extra(extra)


def test_defaults_keep_loopback_and_the_transports_own_choices() -> None:
    c = config()
    assert c.control_host == "127.0.0.1" and c.control_advertised_host == "127.0.0.1"
    assert c.kvt_host is None and c.transport_options() == {}
    assert config(transport="tcp").transport_options() == {}


def test_the_control_plane_binds_one_address_and_advertises_another() -> None:
    c = config(control_host="0.0.0.0", control_advertise_host="10.77.0.1")
    assert c.control_advertised_host == "10.77.0.1"
    assert config(control_host="10.77.0.2").control_advertised_host == "10.77.0.2"


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])
def test_a_wildcard_control_bind_needs_an_advertised_host(wildcard: str) -> None:
    with pytest.raises(ValueError, match="control_advertise_host"):
        config(control_host=wildcard)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"control_host": ""}, "control_host must name a host"),
        ({"control_advertise_host": "0.0.0.0"}, "names no host"),
        ({"kvt_advertise_host": "10.0.0.1"}, "needs kvt_host"),
        ({"kvt_host": "0.0.0.0"}, "one interface"),
        ({"kvt_host": "10.0.0.1", "kvt_advertise_host": "10.0.0.2"}, "only transport tcp"),
        ({"transport": "tcp", "kvt_host": "0.0.0.0"}, "kvt_advertise_host"),
        ({"transport": "tcp", "kvt_host": "::", "kvt_advertise_host": "::"}, "names no host"),
    ],
)
def test_addresses_that_cannot_work_are_refused_with_the_reason(extra: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        config(**extra)
    with pytest.raises(ValueError, match=match):  # as the harness builds the flag
        kv_transfer_config(9100, **extra)


def test_the_data_plane_address_reaches_the_transport() -> None:
    assert config(kvt_host="10.77.0.1").transport_options() == {"host": "10.77.0.1"}
    same = config(kvt_host="10.77.0.1", kvt_advertise_host="10.77.0.1")
    assert same.transport_options() == {"host": "10.77.0.1"}
    tcp = config(transport="tcp", kvt_host="0.0.0.0", kvt_advertise_host="10.77.0.1")
    assert tcp.transport_options() == {"host": "0.0.0.0", "advertise_host": "10.77.0.1"}
    assert config(transport="tcp", kvt_host="10.77.0.2").transport_options() == {
        "host": "10.77.0.2",
        "advertise_host": None,
    }


# -- the shared secret: from a file (what deployments use) or inline (tests)


def test_the_secret_is_read_from_secret_file_and_only_its_path_is_kept(tmp_path) -> None:
    path = tmp_path / "secret"
    path.write_text("  s3cr3t-from-a-file\n")
    c = config(secret_file=str(path))
    assert c.shared_secret() == b"s3cr3t-from-a-file"
    assert c.secret is None and "s3cr3t" not in repr(c)
    assert config(secret="inline").shared_secret() == b"inline"
    assert config().shared_secret() is None


@pytest.mark.parametrize(
    ("content", "match"),
    [(None, "secret_file: cannot read the secret file .*No such file"), ("\n", "is empty")],
)
def test_a_secret_file_that_holds_no_secret_is_refused_at_load(
    tmp_path, content: str | None, match: str
) -> None:
    path = tmp_path / "secret"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match):
        config(secret_file=str(path))
    with pytest.raises(ValueError, match=match):  # as the harness builds the flag
        kv_transfer_config(9100, secret_file=str(path))


def test_secret_and_secret_file_together_are_refused_without_echoing_either(tmp_path) -> None:
    path = tmp_path / "secret"
    path.write_text("file-secret")
    with pytest.raises(ValueError, match="secret_file or secret, not both") as e:
        config(secret="inline-secret", secret_file=str(path))
    assert "inline-secret" not in str(e.value) and "file-secret" not in str(e.value)
    with pytest.raises(ValueError, match="empty"):
        config(secret="")


def test_an_inline_secret_is_warned_about_once(monkeypatch, caplog, tmp_path) -> None:
    from rapidkv.connector import config as config_module

    monkeypatch.setattr(config_module, "_warned_inline_secret", False)
    path = tmp_path / "secret"
    path.write_text("file-secret")
    with caplog.at_level("WARNING", logger="rapidkv.connector.config"):
        assert not config_module.warn_if_inline_secret(config(secret_file=str(path)))
        assert not config_module.warn_if_inline_secret(config())
        assert config_module.warn_if_inline_secret(config(secret="inline-secret"))
        assert not config_module.warn_if_inline_secret(config(secret="inline-secret"))
    [record] = caplog.records
    assert "`ps`" in record.message and "secret_file" in record.message
    assert "inline-secret" not in record.message


def test_injected_failures_are_limited_to_the_ranks_named() -> None:
    from rapidkv.kvt.faults import SendFaults

    every = config(debug_fail_transfer_rate=0.5, debug_send_delay_s=0.2)
    assert every.send_faults(0) == every.send_faults(1) == SendFaults(0.5, 0.2)
    one = config(debug_fail_transfer_rate=1.0, debug_send_delay_s=0.2, debug_fail_ranks=[1])
    assert one.debug_fail_ranks == (1,)
    assert one.send_faults(1) == SendFaults(1.0, 0.2)
    assert one.send_faults(0) == SendFaults(0.0, 0.2)  # delays everywhere, failures on 1 only
    assert config().send_faults(0) == SendFaults() and not config().send_faults(0)
    with pytest.raises(ValueError, match="debug_fail_ranks"):
        config(debug_fail_ranks=[-1])


def test_a_fault_prefix_limits_every_debug_fault_to_the_transfers_it_starts() -> None:
    from rapidkv.kvt.faults import SendFaults

    scoped = config(debug_fail_transfer_rate=0.5, debug_fault_prefix="faulty-")
    assert scoped.send_faults(0) == SendFaults(0.5, 0.0, "faulty-")
    assert scoped.faulted("faulty-3") and not scoped.faulted("cmpl-3")
    assert config().faulted("anything")  # no prefix: every transfer
