"""SSH against a real sshd: key auth, SFTP, and a host-key policy that never accepts silently."""

import subprocess

import paramiko
import pytest

from testbed.devices import Profile, connect
from testbed.devices.ssh import key_fingerprint
from testbed.errors import DeviceUnreachable
from testbed.peers.fixtures import ssh_profile


def server_fingerprint(sshd) -> str:
    return key_fingerprint(paramiko.Ed25519Key.from_private_key_file(str(sshd.host_key)))


def with_connection(sshd, **changes) -> Profile:
    p = ssh_profile(sshd)
    p.connection = {**p.connection, **changes}
    return p


def test_fingerprint_matches_openssh(sshd):
    out = subprocess.run(["ssh-keygen", "-lf", f"{sshd.host_key}.pub"], capture_output=True, text=True).stdout
    assert out.split()[1] == server_fingerprint(sshd)


def test_an_unknown_host_key_is_refused(sshd, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(DeviceUnreachable, match=r"unknown host key SHA256:\S+ .*not in known_hosts; refusing"):
        connect(with_connection(sshd, known_hosts=str(empty)))


def test_a_changed_host_key_is_refused_naming_both(sshd, tmp_path):
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    kind, blob = (tmp_path / "other.pub").read_text().split()[:2]
    stale = tmp_path / "known_hosts"
    stale.write_text(f"[127.0.0.1]:{sshd.port} {kind} {blob}\n")
    with pytest.raises(DeviceUnreachable, match="CHANGED") as e:
        connect(with_connection(sshd, known_hosts=str(stale)))
    assert server_fingerprint(sshd) in str(e.value)


def test_a_pinned_fingerprint_is_accepted_and_a_wrong_one_refused(sshd):
    device = connect(with_connection(sshd, known_hosts="", host_key_sha256=server_fingerprint(sshd)))
    assert device.run(["true"]).returncode == 0
    device.close()
    with pytest.raises(DeviceUnreachable, match="pinned host_key_sha256"):
        connect(with_connection(sshd, known_hosts="", host_key_sha256="SHA256:" + "A" * 43))


def test_a_wrong_client_key_fails_authentication(sshd, tmp_path):
    other = tmp_path / "id"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    with pytest.raises(DeviceUnreachable, match="Authentication failed"):
        connect(with_connection(sshd, key=str(other)))


def test_the_login_user_is_not_root(ssh_device):
    assert ssh_device.run(["id", "-u"]).stdout.strip() != "0"
