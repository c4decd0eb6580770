"""The lab on one machine: a Ray cluster of three nodes, each owning different devices (the host on the
head, qemu-arm32 on one worker node, two loopback adbd "phones" on another), driven by
`testbed nightly farm=ADDRESS`. Every job runs on the node that owns its device, devices in parallel
and one job at a time per device; a node killed mid-night ends in error records for its devices only.

The phones are profiles in a lab folder (TESTBED_LAB): Ray's workers are other processes, which see
the environment they were started with and never a monkeypatch.

The cluster lives in a network namespace of its own, made by these tests, with only `lo` up, and every
node is started with node_ip_address 127.0.0.1: Ray rewrites a loopback address to the machine's
outward interface (resolve_ip_for_localhost), and in the namespace there is none, so the nodes, the
driver and its workers talk over loopback and nothing leaves the machine (issue 24, item 18)."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from testbed import PROJECT_ROOT, config, netguard
from testbed.cli import main
from testbed.lab import farm
from testbed.report import build as report_module
from testbed.results import ResultsStore

ray = pytest.importorskip("ray", reason="the farm extra: pip install 'testbed[farm]'", exc_type=ImportError)
from ray.cluster_utils import Cluster  # noqa: E402

SMALL_STORE = 80 << 20  # Ray's default object store per node is ~450 MB; records are tiny
NODE = {"num_cpus": 1, "object_store_memory": SMALL_STORE, "node_ip_address": "127.0.0.1", "include_dashboard": False}
CLONE_NEWNET = 0x40000000


@pytest.fixture(scope="module", autouse=True)
def loopback_only_network():
    """This module's own network namespace, only `lo` up: this thread and everything it starts from now
    on (Ray's nodes, the drivers, their workers) is in it; the thread returns to its namespace after."""
    libc = ctypes.CDLL(None, use_errno=True)
    before = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    if libc.unshare(CLONE_NEWNET) != 0:
        os.close(before)
        pytest.skip(f"the farm tests need a network namespace of their own (unshare: "
                    f"{os.strerror(ctypes.get_errno())}; run as root)")
    try:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True, capture_output=True, timeout=30)
        ifaces = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
        assert all(line.split()[1] == "lo" for line in ifaces.splitlines()), ifaces
        yield
    finally:
        if libc.setns(before, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "cannot return to the network namespace the tests started in")
        os.close(before)


def phone(name: str) -> str:
    profile = (config.DEVICES_DIR / "adb-loopback.yaml").read_text()
    return profile.replace("name: adb-loopback", f"name: {name}")


@contextmanager
def environment(**values: str | None):
    """Set (None: unset) environment variables for what starts meanwhile (Ray nodes and their workers),
    then restore."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def lab(tmp_path_factory) -> Path:
    import tempfile

    # short: Ray's node sockets live under TMPDIR, and a socket's path has at most 107 bytes
    folder = Path(tempfile.mkdtemp(prefix="tblab-", dir="/tmp"))
    (folder / "tmp").mkdir()
    (folder / "devices").mkdir()
    for name in ("phone-a", "phone-b", "phone-c", "phone-d"):
        (folder / "devices" / f"{name}.yaml").write_text(phone(name))
    (folder / "suite").mkdir()
    (folder / "suite" / "lab.yaml").write_text(textwrap.dedent("""\
        devices: [host, qemu-arm32, phone-a, phone-b]
        runs:
          gdn:
            experiment: gdn
            overrides: [mode=oracle, matrix=awkward, "chunk=16,32"]
            devices: [host, qemu-arm32]
          gdn_phones:
            experiment: gdn
            overrides: [mode=oracle, matrix=awkward, chunk=16]
            devices: [phone-a, phone-b]
        lock_dir: ""
        lock_wait_s: 60
        report_out: ""
        """))
    (folder / "suite" / "unowned.yaml").write_text(textwrap.dedent("""\
        devices: [host, qemu-aarch64]
        runs:
          gdn:
            experiment: gdn
            overrides: [mode=oracle, matrix=awkward]
            devices: [host]
        lock_dir: ""
        """))
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (folder / "devices" / "phone-gone.yaml").write_text(
        phone("phone-gone").split("peer:")[0].replace("host: 127.0.0.1", f"host: 127.0.0.1\n  port: {port}"))
    (folder / "suite" / "gone.yaml").write_text(textwrap.dedent("""\
        devices: [host, phone-gone]
        runs:
          gdn:
            experiment: gdn
            overrides: [mode=oracle, matrix=awkward, "chunk=16,32"]
        lock_dir: ""
        """))
    (folder / "suite" / "doomed.yaml").write_text(textwrap.dedent("""\
        devices: [host, phone-c, phone-d]
        runs:
          gdn:
            experiment: gdn
            overrides: [mode=oracle, matrix=awkward, "chunk=16,32,48"]
            devices: [host]
          gdn_phones:
            experiment: gdn
            overrides: [mode=oracle, matrix=awkward, "chunk=16,32,48"]
            devices: [phone-c, phone-d]
        lock_dir: ""
        lock_wait_s: 60
        report_out: ""
        """))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def node_env(lab: Path, guarded: bool = True) -> dict:
    """What the drivers (guarded) and the Ray nodes run with. A node's processes run without the test
    suite's network guard: Ray's dashboard tries cloud metadata addresses and its vendor's usage
    report whatever it is told, which the guard would count against the test; in this module's network
    namespace the kernel is the guard (only `lo` exists), so no such packet can leave. A node's jobs
    take their device locks in a temporary folder of the lab's own (TMPDIR): the lab's "devices" are
    this host's, and another session on this machine holding one of them is not what is tested here."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not guarded:
        paths = [p for p in paths if p != str(netguard.SITE_DIR)]
    return {"TESTBED_LAB": str(lab), "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), *paths]),
            **farm.NO_USAGE_STATS,
            **({} if guarded else {netguard.ENV_LOG: None, "TMPDIR": str(lab / "tmp")})}


@pytest.fixture(scope="module")
def cluster(lab, loopback_only_network):
    """Three nodes; which node owns which device: {device: node id}."""
    with environment(**node_env(lab, guarded=False)):
        c = Cluster(initialize_head=True, head_node_args={**NODE, "resources": {farm.resource("host"): 1}})
        arm = c.add_node(**NODE, resources={farm.resource("qemu-arm32"): 1})
        phones = c.add_node(**NODE,
                            resources={farm.resource("phone-a"): 1, farm.resource("phone-b"): 1})
    c.owners = {"host": c.head_node.node_id, "qemu-arm32": arm.node_id,
                "phone-a": phones.node_id, "phone-b": phones.node_id}
    yield c
    c.shutdown()


def nightly(lab: Path, results: Path, *overrides: str, address: str) -> subprocess.Popen:
    env = {**os.environ, **node_env(lab), "TESTBED_RESULTS": str(results)}
    return subprocess.Popen([sys.executable, "-m", "testbed", "nightly", f"farm={address}",
                             f"lock_dir={results / 'locks'}", *overrides],
                            cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def farm_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "testbed", "farm", *args], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=120)


def overlaps(a: dict, b: dict) -> bool:
    return a["started"] < b["finished"] and b["started"] < a["finished"]


def test_each_job_runs_on_the_node_that_owns_its_device(lab, cluster, tmp_path):
    proc = nightly(lab, tmp_path, "suite=lab", address=cluster.address)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err
    records = ResultsStore(tmp_path).records()
    runs = {}
    for r in records:
        assert r["farm"]["node_id"] == cluster.owners[r["device"]], (r["device"], r["farm"])
        runs.setdefault(r["run_id"], r)
    assert sorted(r["device"] for r in runs.values()) == sorted(["host", "qemu-arm32"] * 2 + ["phone-a", "phone-b"])
    oracles = [r for r in records if r["kind"] == "oracle"]
    assert oracles and all(r["verdict"] == "pass" for r in oracles)
    # one job at a time per device (its resource is the lease), devices side by side
    by_device = {}
    for r in runs.values():
        by_device.setdefault(r["device"], []).append(r["farm"])
    for device in ("host", "qemu-arm32"):
        assert not overlaps(*by_device[device]), f"two jobs at once on {device}: {by_device[device]}"
    assert any(overlaps(a, b) for da, ja in by_device.items() for db, jb in by_device.items() if da < db
               for a in ja for b in jb), "no two devices ran at the same time"
    night = report_module.night_log(tmp_path)[-1]
    assert {d: s["status"] for d, s in night["devices"].items()} == dict.fromkeys(cluster.owners, "ok")
    assert (tmp_path / "report" / "report.html").exists()
    assert out.strip().splitlines()[-1] == "exit 0: all oracles pass, no regression"


def test_a_sweep_runs_each_job_on_its_devices_node(lab, cluster, tmp_path):
    env = {**os.environ, **node_env(lab), "TESTBED_RESULTS": str(tmp_path)}
    sweep = subprocess.run([sys.executable, "-m", "testbed", "sweep", "experiment=gdn", "device=host,qemu-arm32",
                            "mode=oracle", "matrix=awkward", f"farm={cluster.address}"], cwd=PROJECT_ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert sweep.returncode == 0, sweep.stdout + sweep.stderr
    assert re.search(r"^2 runs, oracles \d+ pass; ", sweep.stdout, re.M), sweep.stdout  # every oracle passed
    records = ResultsStore(tmp_path).records()
    assert {r["device"] for r in records} == {"host", "qemu-arm32"}
    assert all(r["farm"]["node_id"] == cluster.owners[r["device"]] for r in records)
    # a device no node owns: one line, exit 3, nothing run
    run = subprocess.run([sys.executable, "-m", "testbed", "run", "gdn", "device=qemu-aarch64", "mode=oracle",
                          f"farm={cluster.address}"], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 3, run.stdout + run.stderr
    assert run.stderr.splitlines()[-1] == ("testbed: device unreachable: qemu-aarch64: no farm node advertises "
                                           "device:qemu-aarch64")


def wait_for(what: str, check, limit_s: float):
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, f"waited {limit_s:g} s for {what}"
        time.sleep(0.5)


def test_a_node_that_dies_mid_night_ends_in_error_records_for_its_devices_only(lab, cluster, tmp_path):
    with environment(**node_env(lab, guarded=False)):
        doomed = cluster.add_node(**NODE,
                                  resources={farm.resource("phone-c"): 1, farm.resource("phone-d"): 1})
    cluster.wait_for_nodes()
    store = ResultsStore(tmp_path)
    proc = nightly(lab, tmp_path, "suite=doomed", address=cluster.address)
    try:
        # kill the phones' node once it has returned a record and `farm status` shows it running the
        # next one: some of its jobs are done, some not
        wait_for("a record from the doomed node",
                 lambda: any(r["device"].startswith("phone-") for r in store.records()), 300)
        seen = []

        def running() -> bool:
            seen.append(farm_cli("status", f"--address={cluster.address}"))
            return "running gdn mode=oracle matrix=awkward chunk=" in seen[-1].stdout

        wait_for("farm status showing a phone's job running", running, 300)
        status = seen[-1]
        cluster.remove_node(doomed)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 3, out + err  # a device unreachable, nothing else wrong
    # what ran where, as the lab sees it: the phones' node, one gdn job on a phone at least
    assert status.returncode == 0, status.stderr
    print(status.stdout)
    assert doomed.node_id[:8] in status.stdout
    assert "running gdn mode=oracle matrix=awkward chunk=" in status.stdout
    records = store.records()
    kept = [r for r in records if r["device"].startswith("phone-") and r["verdict"] != "error"]
    errors = [r for r in records if r["verdict"] == "error"]
    assert kept, "the records the doomed node returned before it died were lost"
    assert errors and {r["device"] for r in errors} <= {"phone-c", "phone-d"}
    for r in errors:  # each names the node
        assert doomed.node_id[:8] in r["detail"] and r["farm"]["node_id"] == doomed.node_id, r["detail"]
    jobs_per_phone = 3
    for device in ("phone-c", "phone-d"):  # every job of a dead device ends, as records or as one error
        assert len({r["run_id"] for r in records if r["device"] == device}) == jobs_per_phone, device
    host = [r for r in records if r["device"] == "host"]
    assert len({r["run_id"] for r in host}) == 3 and all(r["verdict"] == "pass" for r in host)
    night = report_module.night_log(tmp_path)[-1]
    assert night["devices"]["host"]["status"] == "ok"
    for device in ("phone-c", "phone-d"):
        assert night["devices"][device]["status"] == "unreachable"
        assert doomed.node_id[:8] in night["devices"][device]["reason"]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    nights = next(s for s in report["sections"] if s["id"] == "nights")["tables"][0]["rows"]
    assert "phone-c: unreachable (" in json.dumps(nights[-1])
    print(out)


def test_a_device_that_does_not_answer_ends_in_error_records_naming_its_node(lab, cluster, tmp_path):
    with environment(**node_env(lab, guarded=False)):
        node = cluster.add_node(**NODE, resources={farm.resource("phone-gone"): 1})
    cluster.wait_for_nodes()
    proc = nightly(lab, tmp_path, "suite=gone", address=cluster.address)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 3, out + err
    records = ResultsStore(tmp_path).records()
    gone = [r for r in records if r["device"] == "phone-gone"]
    assert len(gone) == 2 and all(r["verdict"] == "error" and r["farm"]["node_id"] == node.node_id for r in gone)
    assert "nothing answers at 127.0.0.1" in gone[0]["detail"] or "nothing answers at 127.0.0.1" in gone[1]["detail"]
    assert {r["device"] for r in records if r["verdict"] == "pass"} == {"host"}
    night = report_module.night_log(tmp_path)[-1]["devices"]
    assert night["host"]["status"] == "ok" and night["phone-gone"]["status"] == "unreachable"
    cluster.remove_node(node)


def test_a_device_no_node_advertises_is_listed_unreachable(lab, cluster, tmp_path):
    proc = nightly(lab, tmp_path, "suite=unowned", address=cluster.address)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 3, out + err
    night = report_module.night_log(tmp_path)[-1]["devices"]
    assert night["host"]["status"] == "ok"
    assert night["qemu-aarch64"] == {"status": "unreachable", "runs": [],
                                     "reason": "no farm node advertises device:qemu-aarch64"}


def test_a_farm_address_where_nothing_answers_is_one_clear_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "testbed", "nightly", "suite=smoke", "farm=127.0.0.1:9"],
                          cwd=PROJECT_ROOT, env={**os.environ, "TESTBED_RESULTS": str(tmp_path)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("testbed: error: farm=127.0.0.1:9: no Ray cluster answers there"), proc.stderr


def test_farm_node_starts_ray_with_one_resource_per_device_that_answers(monkeypatch, capsys):
    started = []

    def run_node(argv, log, on_up):
        started.append(argv)
        on_up("10.0.0.7")
        return 0

    monkeypatch.setattr(farm, "run_node", run_node)
    assert main(["farm", "node", "--address=10.0.0.1:6379", "--devices=host,pixel",
                 "--node-ip-address=10.0.0.7"]) == 0
    # Ray's `ray start`, its own address learned by routing towards the head (testbed.lab.farm.start_ray)
    assert started == [[sys.executable, "-m", "testbed.lab.farm", "10.0.0.1:6379", "start", "--address=10.0.0.1:6379",
                        '--resources={"device:host": 1.0}', "--node-ip-address=10.0.0.7", "--include-dashboard=false",
                        "--block"]]
    err = capsys.readouterr().err
    assert "pixel: left out, no: " in err and "farm node: starting Ray, advertising device:host" in err
    # testbed's next steps, never Ray's (`ray stop` would stop every Ray node on the host)
    assert "testbed nightly farm=10.0.0.1:6379" in err and "Ctrl-C here" in err and "ray stop" not in err
    # a head is on loopback unless told its address on the lab's network
    assert main(["farm", "node", "--devices=host", "--port=6390"]) == 0
    assert started[-1][3:5] == ["127.0.0.1:6390", "start"] and "--node-ip-address=127.0.0.1" in started[-1]
    assert "other hosts cannot join a head on loopback" in capsys.readouterr().err
    assert main(["farm", "node", "--devices=host,nosuch"]) == 2
    assert "--devices: unknown device 'nosuch'; accepted: " in capsys.readouterr().err
    assert main(["farm", "node", "--devices=host", "--node-ip-address=lab-host"]) == 2
    assert "--node-ip-address 'lab-host' is not an IP address" in capsys.readouterr().err


ASKED = """
import json, sys
from ray._private import services
asked = []  # every address Ray routes towards to learn its own (None: a public DNS server's, 8.8.8.8)
real = services.node_ip_address_from_perspective
services.node_ip_address_from_perspective = lambda address=None: asked.append(address) or real(address)
from testbed.lab import farm
farm.join(sys.argv[1])
print(json.dumps(asked))
"""


def test_the_driver_learns_its_address_towards_the_head_never_a_public_one(lab, cluster):
    """Issue 44, item 4: Ray's driver asked the route to 8.8.8.8 for its own address (ray.init rewrites
    a loopback head's address to this host's outward one). testbed's driver routes towards the head."""
    env = {k: v for k, v in {**os.environ, **node_env(lab)}.items() if v is not None}
    p = subprocess.run([sys.executable, "-c", ASKED, cluster.address], cwd=PROJECT_ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    asked = json.loads(p.stdout.splitlines()[-1])
    assert asked and None not in asked and set(asked) == {cluster.address}, asked


def test_farm_node_runs_a_head_on_loopback_and_stopping_it_stops_only_it(lab, tmp_path):
    """Issue 24, item 18: `farm node --node-ip-address 127.0.0.1` brings a head up, says testbed's next
    steps with its address, answers `farm status`, and ends its own node when it is stopped."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in {**os.environ, **node_env(lab, guarded=False)}.items() if v is not None}
    node = subprocess.Popen([sys.executable, "-m", "testbed", "farm", "node", "--devices=host", f"--port={port}",
                             "--node-ip-address=127.0.0.1"], cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 180
        while not any(line.startswith("farm node: up") for line in lines):
            assert node.poll() is None and time.monotonic() < deadline, "".join(lines) + node.stderr.read()
            lines.append(node.stderr.readline())
        said = "".join(lines) + "".join(node.stderr.readline() for _ in range(4))
        assert f"this is the head, at 127.0.0.1:{port}" in said and f"testbed nightly farm=127.0.0.1:{port}" in said
        assert "ray stop" not in said
        status = farm_cli("status", f"--address=127.0.0.1:{port}")
        assert status.returncode == 0 and "host" in status.stdout and "idle" in status.stdout, status.stderr
    finally:
        node.terminate()
        node.wait(timeout=120)
    with socket.socket() as s:  # its head is gone: nothing listens at its port any more
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_farm_status_on_a_busy_head_is_one_line_and_exit_3(monkeypatch, capsys):
    """Issue 24, item 13: under load the board's answer timed out: a GetTimeoutError traceback."""
    class Busy:
        exceptions = ray.exceptions

        def get(self, ref, timeout=None):
            raise ray.exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")

    monkeypatch.setattr(farm, "join", lambda address: Busy())
    monkeypatch.setattr(farm, "board", lambda r: type("B", (), {"show": type("S", (), {"remote": lambda: None})})())
    assert main(["farm", "status", "--address=127.0.0.1:6379"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did not say what runs where within 10 s" in err


@pytest.mark.parametrize("port, says", [(12345, "inside Ray's worker port range 10002-19999"),
                                        (10001, "Ray's client server"), (80, "accepted: 1024-65535")])
def test_farm_node_refuses_a_port_ray_takes_for_itself(port, says, monkeypatch, capsys):
    """Issue 24, item 13: `ray start --head --port` in its worker range failed inside Ray with a raw ValueError."""
    monkeypatch.setattr(farm, "node_resources", lambda names: pytest.fail("probed devices before checking --port"))
    assert main(["farm", "node", f"--port={port}", "--devices=host"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"testbed: error: --port={port} ") and says in err


def test_a_record_a_worker_returns_says_the_coordinators_store(tmp_path):
    """A worker composes its job with its own results_dir and stores into a scratch store; the record the
    coordinator appends to its store says that store (the worker's stays beside it, under farm)."""
    from types import SimpleNamespace

    from testbed.results import Record, RunInfo

    rc = config.load(["experiment=gdn", "device=host"])
    worker = RunInfo(experiment="gdn", device="host", backend="refimpl",
                     config={**rc.flat(), "results_dir": "/on/the/worker/results"}, fingerprint={})
    rows = [worker.mark("started"), worker.stamp(Record("gdn", "c", "oracle", "nmse", "pass", 1.0, {})),
            worker.mark("ended", "ok")]
    returned = {"status": "ok", "reason": "", "error": "", "info": None, "rows": rows}
    fake_ray = SimpleNamespace(get=lambda ref: returned)
    store = ResultsStore(tmp_path / "coordinator")
    farm.collect(fake_ray, "ref", rc, {"NodeID": "n1", "NodeManagerHostname": "worker"}, None, store, lambda *a: None)
    stored = store.records()
    assert stored and all(r["config"]["results_dir"] == str(store.root) for r in stored)
    assert all(r["farm"]["worker_results_dir"] == "/on/the/worker/results" for r in stored)
