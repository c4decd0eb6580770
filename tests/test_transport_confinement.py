"""Every transport keeps push, pull and cwd inside the work folder even through symlinks on the
device, and carries any name a device can hold (issue 13, items 11 and 17). Same tests on the host,
the loopback adbd and a real sshd."""

from __future__ import annotations

import uuid

import pytest

from testbed.devices.transport import OutsideWorkFolder


@pytest.fixture(params=["local", "adb", "ssh"])
def dev(request):
    return request.getfixturevalue(f"{request.param}_device")


@pytest.fixture
def outside(dev):
    """A fresh folder outside the work folder (in /tmp, which every device here has), and a cleanup."""
    folder = f"/tmp/tb-outside-{uuid.uuid4().hex[:8]}"
    assert dev.run(["mkdir", "-p", folder]).returncode == 0
    yield folder
    dev.run(["rm", "-rf", folder])
    dev.run(["rm", "-f", "link", "evil", "secret"])


def test_a_symlinked_folder_cannot_take_a_push_out(dev, outside, tmp_path):
    (tmp_path / "f").write_text("payload")
    assert dev.run(["ln", "-s", outside, "link"]).returncode == 0
    with pytest.raises(OutsideWorkFolder, match="leads out of the work folder"):
        dev.push(tmp_path / "f", "link/f")
    with pytest.raises(OutsideWorkFolder):
        dev.push(tmp_path / "f", "link/deeper/f")  # not even the folders are made out there
    assert dev.run(["ls", "-A", outside]).stdout.strip() == ""


def test_a_symlinked_file_cannot_be_pushed_through_or_pulled(dev, outside, tmp_path):
    (tmp_path / "f").write_text("payload")
    assert dev.run(["sh", "-c", 'echo secret > "$1"/s && ln -s "$1"/s secret && ln -s "$1"/new evil',
                    "sh", outside]).returncode == 0
    with pytest.raises(OutsideWorkFolder):
        dev.pull("secret", tmp_path / "got")
    assert not (tmp_path / "got").exists()
    with pytest.raises(OutsideWorkFolder):
        dev.push(tmp_path / "f", "evil")  # a dangling link out: writing it would create the file out there
    assert dev.run(["ls", "-A", outside]).stdout.split() == ["s"]


def test_a_symlinked_cwd_is_refused(dev, outside):
    assert dev.run(["ln", "-s", outside, "link"]).returncode == 0
    with pytest.raises(OutsideWorkFolder):
        dev.run(["touch", "made-here"], cwd="link")
    assert dev.run(["ls", "-A", outside]).stdout.strip() == ""


def test_a_symlink_that_stays_inside_is_fine(dev, tmp_path):
    (tmp_path / "f").write_text("payload")
    dev.run(["mkdir", "-p", "real"])
    dev.run(["ln", "-s", "real", "alias"])
    dev.push(tmp_path / "f", "alias/f")
    dev.pull("real/f", tmp_path / "back")
    assert (tmp_path / "back").read_text() == "payload"
    assert dev.run(["pwd"], cwd="alias").returncode == 0
    dev.run(["rm", "-rf", "real", "alias"])


@pytest.mark.parametrize("name", ["back\\slash.bin", "new\nline.bin", "both\\n\n.bin", "x" * 250])
def test_names_a_device_can_hold_round_trip(dev, name, tmp_path):
    (tmp_path / "f").write_bytes(b"payload " + name.encode())
    dev.push(tmp_path / "f", f"names/{name}")
    dev.pull(f"names/{name}", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == b"payload " + name.encode()
    dev.run(["rm", "-rf", "names"])


def test_what_no_device_can_name_is_refused_clearly(dev, tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="has a name of 300 bytes; accepted: at most 255"):
        dev.push(tmp_path / "f", "y" * 300)
    with pytest.raises(ValueError, match="contains a NUL byte"):
        dev.push(tmp_path / "f", "a\0b")
    with pytest.raises(ValueError, match=r"argument 1 \('a\\x00b'\) contains a NUL byte"):
        dev.run(["echo", "a\0b"])
    assert dev.run(["true"]).returncode == 0  # and the connection is still there
