"""`testbed devices` and `testbed doctor DEVICE`.

  testbed devices            every profile in devices/, and whether each answers now (and why not)
  testbed doctor DEVICE      connect, then check every tool and path the profile names, the shell
                             utilities testbed relies on, the IREE runtime tools of a profile that
                             names an IREE target (where they come from, that they start on the
                             device, that their release is the compiler's), and the fingerprint; say
                             what is missing and how to get it (exit 0 all present, 1 something
                             missing, 3 unreachable or no IREE runtime for an IREE profile)
"""

from __future__ import annotations

import shlex
import sys
from concurrent.futures import ThreadPoolExecutor

from testbed.config import choices
from testbed.devices import connect, load_profile, one_line, reachability
from testbed.errors import DeviceUnreachable, UsageError
from testbed.heartbeat import heartbeat
from testbed.report import tables

# What the remote discipline runs on a device (testbed.devices.transport): cd, timeout, sha256, stat.
DEVICE_UTILITIES = ("sh", "timeout", "sha256sum", "stat", "mkdir", "rm")


def cmd_devices(args) -> int:
    import pandas as pd

    names = choices("device")
    profiles = {}
    for n in names:
        try:
            profiles[n] = load_profile(n)
        except UsageError as e:
            profiles[n] = e
    with ThreadPoolExecutor(max_workers=8) as pool:
        reach = dict(zip(names, pool.map(reachability, names))) if args.check else {}
    rows = []
    for n, p in profiles.items():
        if isinstance(p, UsageError):
            rows.append({"device": n, "transport": "", "abi": "", "capabilities": "",
                         "reachable": one_line(f"invalid: {p}")})
            continue
        rows.append({"device": n, "transport": p.transport, "abi": p.abi, "capabilities": ", ".join(p.capabilities),
                     "reachable": reach.get(n, "not checked")})
    print(tables.markdown(pd.DataFrame(rows)))
    return 0


def host_checks(profile) -> list[tuple[str, str, str]]:
    """What this host needs to reach the device at all, checked without reaching it."""
    if profile.transport != "adb" or profile.connection.get("host") or profile.connection.get("server"):
        return []
    try:
        import usb1  # noqa: F401 -- adb-shell's USB transport is built on it
    except ImportError:
        return [("adb-shell usb support", "MISSING", "a phone over USB needs libusb bindings: pip install 'testbed[usb]'")]
    return [("adb-shell usb support", "ok", "usb1 (libusb) importable")]


def doctor(name: str) -> tuple[list[tuple[str, str, str]], dict]:
    """[(check, 'ok' | 'MISSING', detail)], fingerprint. Raises DeviceUnreachable."""
    profile = load_profile(name)
    device = connect(profile)
    checks = [("reach", "ok", f"{profile.transport}; work folder {device.transport.work_dir} writable")]
    try:
        if profile.transport in ("adb", "ssh"):
            for util in DEVICE_UTILITIES:
                r = device.run(["sh", "-c", 'command -v "$1"', "sh", util], timeout=30)
                checks.append((f"utility {util}", "ok" if r.returncode == 0 else "MISSING",
                               r.stdout.strip() or "not on the device's PATH"))
        if profile.transport == "qemu":
            sysroot = profile.connection.get("sysroot")
            if sysroot:
                r = device.run(["test", "-d", sysroot], timeout=30)
                checks.append(("qemu sysroot", "ok" if r.returncode == 0 else "MISSING", sysroot))
        checks += hexagon_checks(profile)
        for tool, path in sorted(profile.tools.items()):
            path = shlex.split(path)[0] if path.strip() else path  # hexagon_runner may carry its arguments
            r = device.run(["sh", "-c", 'test -x "$1" || command -v "$1"', "sh", path], timeout=30)
            checks.append((f"tool {tool}", "ok" if r.returncode == 0 else "MISSING",
                           path if r.returncode == 0 else f"{path} is not an executable on the device"))
        if profile.has("native"):
            checks.append(native_check(device))
        if profile.iree:
            checks += iree_runtime_checks(device)
        fingerprint = device.fingerprint()
    finally:
        device.close()
    return checks, fingerprint


HEXAGON_RUNNER_HELP = ("a phone starts Hexagon programs on its DSP through the vendor SDK's runner "
                       "(e.g. run_main_on_hexagon over FastRPC, from Qualcomm's Hexagon SDK, which no registry here "
                       "serves): push it and name it in the profile as tools.hexagon_runner (its arguments after "
                       "the path, e.g. '/data/local/tmp/run_main_on_hexagon 3'). Note: testbed builds "
                       "hexagon-linux-musl executables (what qemu-hexagon runs); a DSP runs programs built by the "
                       "SDK for QuRT, which testbed does not build")


def hexagon_checks(profile) -> list[tuple[str, str, str]]:
    """A Hexagon device: qemu-hexagon runs its programs directly, a loopback phone's adbd through its exec
    shim; any other needs the SDK's runner (tools.hexagon_runner)."""
    if profile.abi != "hexagon":
        return []
    if profile.transport == "qemu":
        return [("hexagon runner", "ok", f"{profile.connection.get('emulator')} runs Hexagon ELF directly "
                                         f"(core {profile.accelerators.get('hexagon')})")]
    if profile.peer:
        return [("hexagon runner", "ok", "the loopback adbd runs Hexagon ELF under qemu-hexagon")]
    if not profile.tools.get("hexagon_runner"):
        return [("hexagon runner", "MISSING", HEXAGON_RUNNER_HELP)]
    return []


def native_check(device) -> tuple[str, str, str]:
    """backend=native builds its programs for the device's ABI here and pushes them: the toolchain must
    be on this host, and a program must start on the device (run without arguments, it prints its
    usage and exits 2)."""
    from testbed.backends.native.build import BuildError, build_programs, target_for_abi
    from testbed.backends.native.device import stage_program

    try:
        program = build_programs(target_for_abi(device.profile.abi)) / "tb_gdn_bench"
    except BuildError as e:
        return "native programs", "MISSING", str(e)
    remote = stage_program(device, program)
    r = device.run([f"./{remote}"], timeout=120)
    if r.returncode == 2 and "usage" in (r.stderr + r.stdout):
        return "native programs", "ok", f"{program.parent.name} builds here and runs on the device"
    return "native programs", "MISSING", (f"{remote} does not start on the device (exit {r.returncode}: "
                                          f"{(r.stderr or r.stdout).strip()[-200:]})")


IREE_RUNTIME = "iree runtime"


def iree_runtime_checks(device) -> list[tuple[str, str, str]]:
    """Where backend=iree's tools come from for this device, whether they start there (a dynamically
    linked tool needs its loader: qemu's sysroot), and whether their release is the compiler's."""
    from testbed.backends.iree.device import IreeDevice, RUNTIME_TOOLS, ToolMissing, compiler_release

    try:
        iree = IreeDevice(device)
    except ToolMissing as e:
        return [(IREE_RUNTIME, "MISSING", str(e))]
    checks = []
    version, _ = compiler_release()
    release = iree.source.release
    checks.append((IREE_RUNTIME, "ok", f"{iree.source.how}" + (f", IREE {release} = the compiler's {version}"
                                                                 if release else " (release not checked)")))
    with iree.folder() as run:
        for tool in RUNTIME_TOOLS:
            path = iree.tool(tool)
            r = device.run([path, "--help"], timeout=120, cwd=run.path)
            starts = r.returncode == 0 and "--module" in r.stdout + r.stderr
            checks.append((f"iree {tool}", "ok" if starts else "MISSING",
                           path if starts else f"{path} does not start on the device: "
                           f"{(r.stderr or r.stdout).strip()[-200:] or 'exit ' + str(r.returncode)}"))
    return checks


def cmd_doctor(args) -> int:
    needs = host_checks(load_profile(args.device))
    for check, status, detail in needs:
        print(tables.printable(f"{status:8} {check:28} {detail}"))
    try:
        # starting a loopback peer or building the programs takes a minute: a log shows it is alive
        with heartbeat(f"checking {args.device}", lambda msg: print(msg, file=sys.stderr, flush=True)):
            checks, fp = doctor(args.device)
    except DeviceUnreachable as e:
        print(tables.printable(f"{args.device}: UNREACHABLE: {e}"))
        return DeviceUnreachable.exit_status
    for check, status, detail in checks:  # what the device said
        print(tables.printable(f"{status:8} {check:28} {detail}"))
    print("fingerprint: " + ", ".join(f"{k}={fp.get(k)}" for k in ("model", "abi", "os", "governor", "cores")))
    temps = fp.get("temperatures_c") or {}
    print("temperatures: " + (", ".join(f"{k} {v:.1f} C" for k, v in temps.items()) or "not readable"))
    missing = [c for c in needs + checks if c[1] != "ok"]
    if missing:
        print(f"{args.device}: {len(missing)} missing: " + ", ".join(shlex.quote(c[0]) for c in missing))
        from testbed.backends.iree.device import ToolMissing

        return ToolMissing.exit_status if any(c[0] == IREE_RUNTIME for c in missing) else 1
    print(f"{args.device}: everything the profile names is present")
    return 0


def register(sub) -> None:
    """Add the two commands to testbed's argparse subcommands."""
    d = sub.add_parser("devices", help="list device profiles and whether each is reachable")
    d.add_argument("--no-check", dest="check", action="store_false", help="list only; do not connect")
    d.set_defaults(fn=cmd_devices)
    doc = sub.add_parser("doctor", help="check every tool and path a device profile names")
    doc.add_argument("device", help=f"one of: {', '.join(choices('device'))}")
    doc.set_defaults(fn=cmd_doctor)
