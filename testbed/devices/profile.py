"""Device profiles: devices/NAME.yaml, validated on load with errors that name the field.

A profile says what a device is (ABI, capabilities, accelerators, thread counts), how to reach it
(`transport` and its `connection` fields), where it may write (`work_dir`), where its tools live
(`tools`) and how measurements on it are disciplined (`health`). Users add a device by adding a file.

Fields by transport (all optional unless marked):
  local   connection: {}
  qemu    connection: {emulator (required): qemu-arm | qemu-aarch64 | qemu-hexagon, sysroot: path for -L}
  adb     connection: {serial: USB serial, or host + port for TCP; key: adbkey path (created if
          absent), auth_timeout_s}; peer: {command: [argv]} starts a loopback device on connect;
          or {server: "HOST:PORT" of an adb server (adb -H HOST -P PORT), serial: as it lists it}
  ssh     connection: {host (required), port, user (required), key (required), known_hosts,
          host_key_sha256}; one of known_hosts or host_key_sha256 is required

`sizes: {EXPERIMENT: {key: value, ...}}` names the sizes a run of that experiment takes on this device
unless the command line names its own (testbed.config.apply_device_sizes): an emulated device's smaller
matrix, shapes and repetitions, so that each command finishes in about a CPU-minute there; the full ones
stay one override away (`matrix=all`, `bench.tokens=[...]`). Keys are the experiment's own (dotted or
nested), checked against its config when a run composes it.

`iree: {target, hal_device}` names what backend=iree compiles for (experiments/iree_target/TARGET.yaml)
and the HAL device iree-run-module uses there (local-sync, local-task, vulkan).

ABI `hexagon`: the device runs Hexagon programs (kernels/ built by zig for hexagon-linux-musl, ELF
machine 164). `accelerators.hexagon` names its core (v67: what qemu-hexagon 7.2 emulates, and the core
the programs are built for). Under qemu-user they run directly; on a phone a Hexagon program is started
on the DSP by the vendor SDK's runner (e.g. run_main_on_hexagon over FastRPC), `tools.hexagon_runner`,
which then prefixes every native command (`testbed doctor` says when it is missing).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from testbed.config import CONFIG_DIR, choices, group_file, not_sizes
from testbed.errors import UsageError

TRANSPORTS = ("local", "qemu", "adb", "ssh")
ABIS = ("host", "armeabi-v7a", "arm64-v8a", "x86_64", "hexagon")
TOOLS = ("iree-run-module", "iree-benchmark-module", "test-backend-ops", "llama-bench", "hexagon_runner")
# The ELF machine (e_machine) of the programs a device of each ABI runs: every program a device run's
# evidence names must be an ELF for it (testbed.runner.check_evidence). A new ABI adds a line here.
ELF_MACHINE_FOR_ABI = {"armeabi-v7a": 40, "arm64-v8a": 183, "hexagon": 164, "x86_64": 62}
# The newest Hexagon core qemu-hexagon 7.2 knows (an ELF flagged v68 or later is refused).
QEMU_HEXAGON_MAX_CORE = 67
# ABI `host`: this machine's own, by platform.machine()
HOST_ELF_MACHINE = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183, "armv7l": 40}


def elf_machine_for(abi: str) -> int | None:
    """The e_machine of the programs a device of `abi` runs (None: not known here)."""
    import platform

    return HOST_ELF_MACHINE.get(platform.machine().lower()) if abi == "host" else ELF_MACHINE_FOR_ABI.get(abi)

# Per transport: connection field -> (type, required). Types are checked, unknown keys refused.
CONNECTION_FIELDS: dict[str, dict[str, tuple[type, bool]]] = {
    "local": {},
    "qemu": {"emulator": (str, True), "sysroot": (str, False)},
    "adb": {"serial": (str, False), "host": (str, False), "port": (int, False), "key": (str, False),
            "auth_timeout_s": (float, False), "server": (str, False)},
    "ssh": {"host": (str, True), "port": (int, False), "user": (str, True), "key": (str, True),
            "known_hosts": (str, False), "host_key_sha256": (str, False)},
}
ACCELERATOR_FIELDS = {"vulkan_target": str, "htp": str, "backend": str, "hexagon": str}
HEALTH_FIELDS = {"cooldown_below_c": float, "cooldown_delay_s": float, "cooldown_max_wait_s": float,
                 "warmup": int, "throttle_fraction": float}
IREE_FIELDS = {"target": str, "hal_device": str}
IREE_HAL_DEVICES = ("local-sync", "local-task", "vulkan")
TIMEOUT_FIELDS = {"connect_s": float, "command_s": float, "transfer_s": float}


@dataclass
class Profile:
    """What a device is and how to reach it (validated from devices/NAME.yaml)."""

    name: str
    transport: str
    abi: str
    description: str = ""
    capabilities: list[str] = field(default_factory=list)
    threads: list[int] = field(default_factory=lambda: [1])
    work_dir: str = ""
    tools: dict[str, str] = field(default_factory=dict)
    connection: dict[str, Any] = field(default_factory=dict)
    accelerators: dict[str, Any] = field(default_factory=dict)
    health: dict[str, Any] = field(default_factory=dict)
    timeouts: dict[str, float] = field(default_factory=dict)
    peer: dict[str, Any] = field(default_factory=dict)
    iree: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, dict[str, Any]] = field(default_factory=dict)

    REQUIRED = ("name", "transport", "abi")

    @classmethod
    def from_config(cls, node: DictConfig | dict, source: str) -> "Profile":
        bad = _Checker(source)
        try:
            data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
        except OmegaConfBaseException as e:  # an interpolation that does not resolve, and its kin
            raise UsageError(f"{source}: field {str(e.full_key).removeprefix('device.')!r}: "
                             f"{str(e.msg).splitlines()[0]}") from None
        known = [f.name for f in fields(cls)]
        for key in data:
            if key not in known:
                bad(key, data[key], f"is not a profile field; accepted: {', '.join(known)}")
        for key in cls.REQUIRED:
            if data.get(key) in (None, ""):
                bad(key, None, "is required")
        bad.choice("transport", data["transport"], TRANSPORTS)
        bad.choice("abi", data["abi"], ABIS)
        for key in ("name", "description", "work_dir"):
            bad.typed(key, data.get(key, ""), str)
        caps = data.get("capabilities", [])
        if not isinstance(caps, list) or not all(isinstance(c, str) for c in caps):
            bad("capabilities", caps, "must be a list of names")
        threads = data.get("threads", [1])
        if not isinstance(threads, list) or not threads or not all(
                isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in threads):
            bad("threads", threads, "must be a non-empty list of positive integers")
        tools = data.get("tools", {}) or {}
        bad.mapping("tools", tools, {t: str for t in TOOLS})
        conn = data.get("connection", {}) or {}
        spec = CONNECTION_FIELDS[data["transport"]]
        bad.mapping("connection", conn, {k: t for k, (t, _) in spec.items()})
        for key, (_, required) in spec.items():
            # an address left empty ("") is a template's (not_configured); absent is a mistake
            if required and (conn.get(key) is None or (conn.get(key) == "" and key != "host")):
                bad(f"connection.{key}", None, f"is required for transport {data['transport']}")
        if data["transport"] == "ssh" and not (conn.get("known_hosts") or conn.get("host_key_sha256")):
            bad("connection.known_hosts", None,
                "or connection.host_key_sha256 is required: ssh host keys are checked, never accepted blindly")
        if data["transport"] == "adb" and conn.get("host") and conn.get("serial"):
            bad("connection.serial", conn["serial"], "and connection.host are exclusive (USB or TCP)")
        if data["transport"] == "adb" and conn.get("server"):
            host, _, port = conn["server"].rpartition(":")
            if not host or not port.isdigit():
                bad("connection.server", conn["server"], "is not accepted; accepted: HOST:PORT of an adb server "
                                                         "(its default: 127.0.0.1:5037)")
            if conn.get("host"):
                bad("connection.host", conn["host"], "and connection.server are exclusive (adbd directly, or "
                                                     "through an adb server)")
        if data["transport"] in ("adb", "ssh"):
            work = str(data.get("work_dir", ""))
            # cleanup empties this folder: it must be absolute and at least two levels deep
            if not work.startswith("/") or len([p for p in work.split("/") if p]) < 2:
                bad("work_dir", data.get("work_dir"), "must be an absolute device path at least two levels "
                                                      "deep (e.g. /data/local/tmp/testbed)")
        accelerators = data.get("accelerators", {}) or {}
        bad.mapping("accelerators", accelerators, ACCELERATOR_FIELDS)
        core = accelerators.get("hexagon")
        if data["abi"] == "hexagon" or core is not None:
            if not (isinstance(core, str) and core[:1] == "v" and core[1:].isdigit() and 60 <= int(core[1:]) <= 99):
                bad("accelerators.hexagon", core, "must name the Hexagon core, v60 to v99 (e.g. v67)"
                    + (" (required for ABI hexagon)" if data["abi"] == "hexagon" else ""))
        if (data["transport"] == "qemu" and conn.get("emulator") == "qemu-hexagon"
                and core is not None and int(core[1:]) > QEMU_HEXAGON_MAX_CORE):
            bad("accelerators.hexagon", core, f"is newer than qemu-hexagon emulates (up to v{QEMU_HEXAGON_MAX_CORE})")
        if tools.get("hexagon_runner") and data["abi"] != "hexagon":
            bad("tools.hexagon_runner", tools["hexagon_runner"], "is only for ABI hexagon")
        bad.mapping("health", data.get("health", {}) or {}, HEALTH_FIELDS)
        bad.mapping("timeouts", data.get("timeouts", {}) or {}, TIMEOUT_FIELDS)
        iree = data.get("iree", {}) or {}
        bad.mapping("iree", iree, IREE_FIELDS)
        if iree:
            targets = tuple(sorted(p.stem for p in (CONFIG_DIR / "iree_target").glob("*.yaml")))
            bad.choice("iree.target", iree.get("target"), targets)
            bad.choice("iree.hal_device", iree.get("hal_device"), IREE_HAL_DEVICES)
        peer = data.get("peer", {}) or {}
        bad.mapping("peer", peer, {"command": list})
        if peer and data["transport"] != "adb":
            bad("peer", peer, "is only for adb profiles (a loopback adbd)")
        sizes = data.get("sizes", {}) or {}
        if not isinstance(sizes, dict):
            bad("sizes", sizes, "must be a mapping of experiment names to mappings of their keys")
        experiments, shared = choices("experiment"), not_sizes()
        for name, values in sizes.items():
            if name not in experiments:
                bad(f"sizes.{name}", None, f"names no experiment; accepted: {', '.join(experiments)}")
            if not isinstance(values, dict) or not values:
                bad(f"sizes.{name}", values, "must be a non-empty mapping of the experiment's keys to values")
            for key in values:
                if key in shared:  # results_dir here would move the store for runs on this device, silently
                    bad(f"sizes.{name}.{key}", values[key], "is not a size; accepted: the experiment's own keys")
        return cls(**{**data, "tools": tools, "connection": conn, "peer": peer, "iree": iree, "sizes": sizes,
                      "accelerators": data.get("accelerators") or {}, "health": data.get("health") or {},
                      "timeouts": data.get("timeouts") or {}})

    def has(self, capability: str) -> bool:
        return capability in self.capabilities

    def not_configured(self) -> str | None:
        """Why the profile cannot be reached as it stands: a shipped template of real hardware whose
        address (connection.host) is left empty until a lab sets it. Such a profile is never probed,
        so nothing is sent to an address nobody chose. None when it is configured."""
        if self.transport in ("adb", "ssh") and "host" in self.connection and not self.connection["host"] \
                and not self.peer and not self.connection.get("server"):
            return (f"not configured: connection.host is empty (devices/{self.name}.yaml is a template: set the "
                    f"device's address there, or in a copy under $TESTBED_LAB/devices/)")
        return None

    def timeout(self, kind: str) -> float:
        # transfer_s: the longest a push or pull may go without progress
        defaults = {"connect_s": 5.0, "command_s": 600.0, "transfer_s": 60.0}
        return float(self.timeouts.get(kind, defaults[kind]))


class _Checker:
    """Raises a UsageError naming the file, the field, the bad value and what is accepted."""

    def __init__(self, source: str):
        self.source = source

    def __call__(self, key: str, value: Any, problem: str):
        shown = "" if value is None else f" {value!r}"
        raise UsageError(f"{self.source}: field {key!r}{shown} {problem}")

    def choice(self, key: str, value: Any, accepted: tuple) -> None:
        if value not in accepted:
            self(key, value, f"is not accepted; accepted: {', '.join(accepted)}")

    def typed(self, key: str, value: Any, kind: type) -> None:
        ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            self(key, value, f"is not {'a' if kind is not int else 'an'} {kind.__name__}")

    def mapping(self, key: str, value: Any, spec: dict[str, type]) -> None:
        if not isinstance(value, dict):
            self(key, value, "must be a mapping")
        for k, v in value.items():
            if k not in spec:
                self(f"{key}.{k}", v, f"is not accepted; accepted: {', '.join(spec) or '(none)'}")
            if v is not None:
                self.typed(f"{key}.{k}", v, spec[k])


def load_profile(name: str) -> Profile:
    return load_profile_file(group_file("device", name))


def load_profile_file(path: Path) -> Profile:
    try:
        node = OmegaConf.load(path)
    except Exception as e:  # noqa: BLE001 -- YAML errors come in many types; all are bad input
        raise UsageError(f"{path.name}: not a valid YAML profile: {str(e).splitlines()[0]}") from None
    if not isinstance(node, DictConfig):
        raise UsageError(f"{path.name}: a profile must be a mapping of fields")
    profile = Profile.from_config(node, f"devices/{path.name}")
    if profile.name != path.stem:
        raise UsageError(f"devices/{path.name}: field 'name' {profile.name!r} must equal the file name {path.stem!r}")
    return profile
