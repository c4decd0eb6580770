"""Device profiles: every shipped one loads; a bad one is refused with the field named."""

import pytest

from testbed.config import choices
from testbed.devices import load_profile
from testbed.devices.profile import load_profile_file
from testbed.errors import UsageError

GOOD_ADB = """\
name: phone
transport: adb
abi: arm64-v8a
work_dir: /data/local/tmp/testbed
connection: {serial: "", key: ~/.android/adbkey}
"""


def test_every_shipped_profile_loads():
    names = choices("device")
    assert {"host", "qemu-arm32", "qemu-aarch64", "pixel", "arm32", "hexagon", "board", "adb-loopback",
            "adb-loopback-arm64", "lavapipe"} <= set(names)
    for name in names:
        assert load_profile(name).name == name


def test_every_iree_capable_profile_names_its_target_and_hal_device():
    from testbed.backends.iree.device import check_target_fits

    capable = [p for p in map(load_profile, choices("device")) if p.has("iree")]
    assert {"host", "lavapipe", "qemu-aarch64", "adb-loopback-arm64", "arm32", "pixel"} <= {p.name for p in capable}
    for p in capable:
        check_target_fits(p.iree["target"], p)  # its own target fits it


def write(tmp_path, text, name="phone"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def test_a_good_user_profile_loads(tmp_path):
    p = load_profile_file(write(tmp_path, GOOD_ADB))
    assert (p.transport, p.abi, p.work_dir) == ("adb", "arm64-v8a", "/data/local/tmp/testbed")


@pytest.mark.parametrize("change, field", [
    (("abi: arm64-v8a", "abi: mips"), "'abi' 'mips'"),
    (("transport: adb", "transport: telnet"), "'transport' 'telnet'"),
    (("abi: arm64-v8a", "abi: arm64-v8a\nthreads: [4, 0]"), "'threads'"),
    (("abi: arm64-v8a", "abi: arm64-v8a\ncolour: red"), "'colour'"),
    (("key: ~/.android/adbkey", "key: ~/.android/adbkey, port: fast"), "'connection.port' 'fast'"),
    (("serial: \"\"", "serial: \"\", user: me"), "'connection.user'"),
    (("work_dir: /data/local/tmp/testbed", "work_dir: testbed"), "'work_dir' 'testbed'"),
    (("work_dir: /data/local/tmp/testbed", "work_dir: /"), "'work_dir' '/'"),
    (("abi: arm64-v8a", "abi: arm64-v8a\ntools: {llama-cli: /x}"), "'tools.llama-cli'"),
    (("abi: arm64-v8a", "abi: arm64-v8a\nhealth: {warmup: many}"), "'health.warmup' 'many'"),
    (("name: phone", "name: other"), "'name' 'other'"),
    (("abi: arm64-v8a", "abi: arm64-v8a\niree: {target: tpu, hal_device: vulkan}"), "'iree.target' 'tpu'"),
    (("abi: arm64-v8a", "abi: arm64-v8a\niree: {target: mali, hal_device: cuda}"), "'iree.hal_device' 'cuda'"),
    (("abi: arm64-v8a", "abi: arm64-v8a\niree: {target: mali, driver: vulkan}"), "'iree.driver'"),
])
def test_a_bad_profile_names_the_field(tmp_path, change, field):
    with pytest.raises(UsageError) as e:
        load_profile_file(write(tmp_path, GOOD_ADB.replace(*change)))
    assert field in str(e.value) and "phone.yaml" in str(e.value)


def test_ssh_profiles_must_say_how_host_keys_are_checked(tmp_path):
    text = "name: b\ntransport: ssh\nabi: arm64-v8a\nwork_dir: /tmp/tb\nconnection: {host: h, user: u, key: k}\n"
    with pytest.raises(UsageError, match="known_hosts.*never accepted blindly"):
        load_profile_file(write(tmp_path, text, "b"))


def test_missing_required_fields_are_named(tmp_path):
    with pytest.raises(UsageError, match="'abi' is required"):
        load_profile_file(write(tmp_path, "name: x\ntransport: local\n", "x"))
    with pytest.raises(UsageError, match="'connection.emulator' is required"):
        load_profile_file(write(tmp_path, "name: q\ntransport: qemu\nabi: armeabi-v7a\n", "q"))
