"""Health: the probe's parsing, the throttling flag and the cool-down gate; the fingerprint of real
peers (a phone's getprop over ADB, the host)."""

from testbed.devices import health

ANDROID_PROBE = """\
prop.model=Pixel 8
prop.abi=arm64-v8a
prop.build=google/shiba/shiba:14/AP1A.240305.019/11354436:user/release-keys
prop.release=14
uname=Linux 5.15.110-android14 aarch64
cores=9
governor=performance
freq.cpu0=1704000 1704000
freq.cpu4=1100000 2367000
freq.cpu8=2900000 2900000
temp.cpu-0-0-0=41200
temp.skin-therm=36
temp.battery=33500
battery.level=87
battery.temp=312
"""


def test_an_android_probe_becomes_a_fingerprint():
    fp = health.parse_probe(ANDROID_PROBE)
    assert (fp["model"], fp["abi"], fp["governor"], fp["cores"]) == ("Pixel 8", "arm64-v8a", "performance", 9)
    assert fp["os"].startswith("google/shiba/shiba:14/")
    assert fp["temperatures_c"] == {"cpu-0-0-0": 41.2, "skin-therm": 36.0, "battery": 33.5}
    assert fp["battery"] == {"level_pct": 87, "temp_c": 31.2}


def test_throttling_is_flagged_with_its_reason():
    fp = health.parse_probe(ANDROID_PROBE)
    flagged, why = health.throttled(fp, fraction=0.8)
    assert flagged and "cpu4" in why and "cpu0" not in why
    calm = health.parse_probe(ANDROID_PROBE.replace("1100000 2367000", "2300000 2367000"))
    assert health.throttled(calm, fraction=0.8) == (False, "")
    assert health.throttled(calm, hot_limit=40.0)[0]  # cpu-0-0-0 at 41.2 C


def test_the_cool_down_gate_waits_until_cool_and_gives_up_when_told():
    readings = iter([45.0, 43.0, 39.5])
    slept = []
    out = health.cool_down(lambda: {"temperatures_c": {"cpu": next(readings)}}, below_c=40.0,
                           poll_s=2.0, sleep=slept.append)
    assert out["cool"] and out["hottest_c"] == 39.5 and slept == [2.0, 2.0]
    out = health.cool_down(lambda: {"temperatures_c": {"cpu": 50.0}}, below_c=40.0, max_wait_s=0.0,
                           sleep=slept.append)
    assert not out["cool"] and out["hottest_c"] == 50.0


def test_the_host_fingerprint_has_the_fields_records_need():
    fp = health.host_fingerprint()
    assert {"model", "abi", "os", "governor", "temperatures_c", "cores"} <= set(fp)
    assert fp["model"] != "unknown" and fp["cores"] >= 1


def test_a_phone_fingerprint_comes_from_its_getprop(adb_device):
    fp = adb_device.fingerprint()
    assert (fp["model"], fp["abi"], fp["transport"]) == ("Loopback", "armeabi-v7a", "adb")
    assert set(adb_device.health()) == {"temperatures_c", "battery", "frequencies", "governor"}


class ScriptedDevice:
    """Only the health readings are scripted; Device.measured's logic is the real one."""

    def __init__(self, profile, readings):
        from testbed.devices import Device

        self.device = Device(profile, transport=None)
        self.device.health = lambda: next(readings)


def snapshot(temp_c, cur_khz=2_000_000):
    return {"temperatures_c": {"cpu": temp_c}, "battery": {"level_pct": 80},
            "frequencies": {"cpu0": {"cur_khz": cur_khz, "max_khz": 2_000_000}}, "governor": "performance"}


def test_measured_gates_warms_up_and_flags_throttling(monkeypatch):
    from testbed.devices import Profile

    profile = Profile(name="p", transport="local", abi="host",
                      health={"cooldown_below_c": 40.0, "warmup": 2, "throttle_fraction": 0.8})
    readings = iter([snapshot(45.0), snapshot(39.0), snapshot(39.0), snapshot(44.0, cur_khz=1_000_000)])
    calls = []
    dev = ScriptedDevice(profile, readings).device
    monkeypatch.setattr(health.time, "sleep", lambda s: None)  # the gate's polling pause
    result, notes = dev.measured(lambda: calls.append(1) or len(calls))
    assert result == 3 and notes["warmup_runs"] == 2  # two warm-ups, then the measured call
    assert notes["cooldown"]["cool"] and notes["hottest_c_before"] == 39.0
    assert notes["throttled"] and "cpu0" in notes["throttle_reason"] and "44.0 C" in notes["throttle_reason"]
