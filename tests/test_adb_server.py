"""ADB through an adb server (connection.server), against Debian's real `adb` server connected to the
loopback adbd; the transport's own conformance tests run on it in test_transports.py."""

import socket

import pytest

from testbed.devices import Profile, connect
from testbed.errors import DeviceUnreachable, UsageError
from testbed.peers.fixtures import adb_profile


def test_what_testbed_pushes_through_the_server_adb_sees(adb_server, adb_server_device, tmp_path):
    server, serial = adb_server
    (tmp_path / "f.txt").write_text("through the server\n")
    adb_server_device.push(tmp_path / "f.txt", "seen.txt")
    path = f"{adb_server_device.transport.work_dir}/seen.txt"
    assert server("-s", serial, "shell", f"cat {path}").stdout == "through the server\n"
    assert adb_server_device.fingerprint()["model"] == "Loopback"


def test_a_serial_the_server_does_not_have_is_unreachable_saying_so(adb_server):
    server, _ = adb_server
    with pytest.raises(DeviceUnreachable, match=f"the adb server at {server.address} says: device 'nope:1' not found"):
        connect(adb_profile("ghost"), {"server": server.address, "serial": "nope:1"})


def test_no_server_at_the_address_is_unreachable_saying_so():
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DeviceUnreachable, match=f"no adb server answers at 127.0.0.1:{port}"):
        connect(adb_profile("ghost"), {"server": f"127.0.0.1:{port}", "serial": "x"})


@pytest.mark.parametrize("connection, message", [
    ({"server": "5037"}, "'connection.server' '5037' is not accepted; accepted: HOST:PORT"),
    ({"server": "127.0.0.1:5037", "host": "10.0.0.2"}, "'connection.host' '10.0.0.2' and connection.server are exclusive"),
])
def test_a_bad_server_field_is_one_line_naming_it(connection, message):
    with pytest.raises(UsageError, match=message):
        Profile.from_config({"name": "p", "transport": "adb", "abi": "arm64-v8a", "work_dir": "/data/local/tmp/t",
                             "connection": connection}, "devices/p.yaml")
