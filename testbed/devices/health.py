"""Device health: what identifies a device's measurements, and whether it was fit to measure.

One POSIX shell probe runs on any device (the host, a phone over ADB, a board over SSH) and reports
model, ABI, OS build, CPU governor and frequencies, thermal zones and battery; missing files are
simply absent from the answer ("where the device exposes them").

Measurement discipline (profile field `health`):
  cooldown_below_c     before measuring, wait until the hottest zone is below this (None: no gate)
  cooldown_delay_s     or simply wait this long
  cooldown_max_wait_s  give up waiting after this long (the record then says it was still hot)
  warmup               untimed runs before the measured one
  throttle_fraction    a record is flagged `throttled` when, right after the run, some CPU's current
                       frequency is below this fraction of its maximum while the governor claims
                       performance, or the hottest zone rose above the gate (default 0.8)
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any

from testbed import children

PROBE = r"""
p() { command -v getprop >/dev/null 2>&1 && getprop "$1"; }
echo "prop.model=$(p ro.product.model)"
echo "prop.abi=$(p ro.product.cpu.abi)"
echo "prop.build=$(p ro.build.fingerprint)"
echo "prop.release=$(p ro.build.version.release)"
echo "uname=$(uname -srm 2>/dev/null)"
echo "cores=$(grep -c ^processor /proc/cpuinfo 2>/dev/null)"
grep -m1 -i -E '^(model name|hardware)' /proc/cpuinfo 2>/dev/null | sed 's/^[^:]*: */cpuinfo.model=/'
[ -r /proc/device-tree/model ] && echo "dt.model=$(tr -d '\0' < /proc/device-tree/model)"
[ -r /etc/os-release ] && grep -m1 '^PRETTY_NAME=' /etc/os-release | sed 's/^PRETTY_NAME=/os.release=/; s/"//g'
echo "governor=$(cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>/dev/null)"
for c in /sys/devices/system/cpu/cpu[0-9]*; do
  [ -r "$c/cpufreq/scaling_cur_freq" ] && echo "freq.${c##*/}=$(cat $c/cpufreq/scaling_cur_freq) $(cat $c/cpufreq/cpuinfo_max_freq 2>/dev/null)"
done
for z in /sys/class/thermal/thermal_zone*; do
  [ -r "$z/temp" ] && echo "temp.$(cat $z/type 2>/dev/null || echo ${z##*/})=$(cat $z/temp 2>/dev/null)"
done
for b in /sys/class/power_supply/battery /sys/class/power_supply/BAT0; do
  [ -r "$b/capacity" ] && echo "battery.level=$(cat $b/capacity)" && echo "battery.temp=$(cat $b/temp 2>/dev/null)"
done
true
"""


def parse_probe(text: str) -> dict[str, Any]:
    """The probe's key=value lines -> a fingerprint and a health snapshot."""
    raw: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and value.strip():
            raw[key.strip()] = value.strip()
    temps = {}
    for key, value in raw.items():
        if key.startswith("temp.") and value.lstrip("-").isdigit():
            milli = int(value)
            temps[key[5:]] = milli / 1000.0 if abs(milli) > 200 else float(milli)  # some zones report C
    freqs = {}
    for key, value in raw.items():
        parts = value.split()
        if key.startswith("freq.") and parts and parts[0].isdigit():
            freqs[key[5:]] = {"cur_khz": int(parts[0]), "max_khz": int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None}
    battery = {}
    if raw.get("battery.level", "").isdigit():
        battery["level_pct"] = int(raw["battery.level"])
    if raw.get("battery.temp", "").lstrip("-").isdigit():
        battery["temp_c"] = int(raw["battery.temp"]) / 10.0  # power_supply reports tenths of a degree
    uname = raw.get("uname", "")
    return {
        "model": raw.get("prop.model") or raw.get("dt.model") or raw.get("cpuinfo.model") or "unknown",
        "abi": raw.get("prop.abi") or (uname.split()[-1] if uname else "unknown"),
        "os": raw.get("prop.build") or raw.get("os.release") or uname or "unknown",
        "kernel": uname,
        "cores": int(raw["cores"]) if raw.get("cores", "").isdigit() else None,
        "governor": raw.get("governor"),
        "frequencies": freqs,
        "temperatures_c": temps,
        "battery": battery,
    }


def probe_device(transport, timeout: float = 30.0) -> dict[str, Any]:
    return parse_probe(transport.run(["sh", "-c", PROBE], timeout=timeout).stdout)


def host_fingerprint() -> dict[str, Any]:
    """This machine: the same probe, run here."""
    out = children.run(["sh", "-c", PROBE], capture_output=True, text=True, timeout=30).stdout
    fp = parse_probe(out)
    fp["abi"] = platform.machine()
    fp["cores"] = fp["cores"] or os.cpu_count()
    fp["python"] = platform.python_version()
    return fp


def hottest(snapshot: dict[str, Any]) -> float | None:
    temps = list(snapshot.get("temperatures_c", {}).values())
    battery = snapshot.get("battery", {}).get("temp_c")
    temps += [battery] if battery is not None else []
    return max(temps) if temps else None


def throttled(after: dict[str, Any], fraction: float = 0.8, hot_limit: float | None = None) -> tuple[bool, str]:
    """Whether a measurement just taken may have run throttled, and why (a heuristic, stated as such:
    current frequency under `fraction` of max on a CPU the governor should keep at max, or a zone
    above the cool-down limit)."""
    reasons = []
    if after.get("governor") == "performance":
        slow = [cpu for cpu, f in after.get("frequencies", {}).items()
                if f.get("max_khz") and f["cur_khz"] < fraction * f["max_khz"]]
        if slow:
            reasons.append(f"{', '.join(slow)} below {fraction:.0%} of max frequency under the performance governor")
    peak = hottest(after)
    if hot_limit is not None and peak is not None and peak > hot_limit:
        reasons.append(f"hottest zone {peak:.1f} C above the {hot_limit:g} C limit")
    return bool(reasons), "; ".join(reasons)


def cool_down(read, below_c: float | None, delay_s: float = 0.0, max_wait_s: float = 300.0,
              poll_s: float = 2.0, sleep=None) -> dict[str, Any]:
    """Wait `delay_s`, then until `read()`'s hottest zone is below `below_c` (if set), for at most
    `max_wait_s`. Returns what happened, for the record."""
    sleep = sleep or time.sleep
    t0 = time.monotonic()
    if delay_s:
        sleep(delay_s)
    peak = None
    if below_c is not None:
        while True:
            peak = hottest(read())
            if peak is None or peak < below_c or time.monotonic() - t0 >= max_wait_s:
                break
            sleep(poll_s)
    return {"waited_s": round(time.monotonic() - t0, 2), "hottest_c": peak,
            "cool": below_c is None or peak is None or peak < below_c}
