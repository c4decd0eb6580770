"""The lab: devices on many hosts, one nightly over all of them, one store, one report (Ray).

  testbed farm node [--address HEAD:PORT] [--devices a,b]   start this host's Ray node
  testbed farm status --address HEAD:PORT                   the nodes, their devices, what runs where
  testbed nightly farm=HEAD:PORT [suite=NAME ...]           the night, run on the cluster
  testbed run|sweep ... farm=HEAD:PORT                      a run or a sweep there (devices side by side)

Each host runs a Ray node that advertises one custom resource per device attached to it,
`device:NAME` with capacity 1, for each profile it can reach. The nightly submits one Ray task per
(device, job) asking for that device's resource, so Ray runs it on the host that owns the device, one
at a time per device: the resource is the lease. Ray is the scheduler; this module only says what
runs where and collects what comes back.

A task reaches its device through the ordinary transports, holds the host's device lock (so a local
`testbed nightly` on that host waits for it too), runs the job with the ordinary runner into a
scratch store on its node, and returns the records. The driver appends each job's records to the one
store as the job ends, so a record once returned is never lost; testbed.lab.nightly then writes the
night log and the one report.

A measurement is bound to its device: a task is never retried or moved (max_retries=0). When a node
dies, its running tasks fail with a Ray error, and the tasks still waiting for its devices would wait
for ever (Ray keeps them as infeasible), so the driver watches ray.nodes() and cancels them. A job
lost either way, or whose device stopped answering, ends as one error record naming the node; its
device is listed unreachable and its remaining jobs are cancelled; the rest of the night goes on.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from testbed import children, config, runner
from testbed.config import RunConfig
from testbed.devices import load_profile, reachability
from testbed.devices.private import DeviceBusy, device_lock
from testbed.errors import DeviceError, DeviceUnreachable, UsageError, did_you_mean
from testbed.lab import nightly
from testbed.results import Record, ResultsStore, RunInfo

RESOURCE = "device:"
NAMESPACE = "testbed"
BOARD = "board"  # the named actor that knows which job runs on which device now
CONNECT_S = 10.0  # how long the head may take to accept a connection
WATCH_S = 1.0  # how often the driver, while waiting for results, looks for nodes that died


def resource(device: str) -> str:
    return RESOURCE + device


def import_ray():
    try:
        import ray
    except ImportError:
        raise UsageError("the farm needs Ray, which is not installed; accepted: pip install 'testbed[farm]'") from None
    return ray


def join(address: str):
    """Connect this process to the lab's cluster as a driver (once)."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"farm={address!r} is not an address; accepted: HEAD:PORT, the head's Ray address")
    # ray.init keeps retrying an address where nothing listens, for minutes: ask once first, at the
    # address Ray will really dial (it rewrites a loopback host to this machine's outward interface).
    dialled = ray_dials(ray, address)
    try:
        socket.create_connection(dialled, timeout=CONNECT_S).close()
    except OSError as e:
        rewritten = "" if dialled == (host, int(port)) else f" (Ray dials {dialled[0]}:{dialled[1]} for it)"
        raise UsageError(f"farm={address}: no Ray cluster answers there{rewritten} ({e.strerror or e}); accepted: "
                         f"the HEAD:PORT of a head started by `testbed farm node`") from None
    for key, value in NO_USAGE_STATS.items():
        os.environ.setdefault(key, value)
    with addresses_seen_from(address):
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
    return ray


def ray_dials(ray, address: str) -> tuple[str, int]:
    """The host and port ray.init connects to for `address`."""
    host, _, port = address.rpartition(":")
    try:
        from ray._private.services import canonicalize_bootstrap_address  # not public; the rule is Ray's
        with addresses_seen_from(address), quiet_stderr():  # Ray's core may log while it looks
            host, _, port = canonicalize_bootstrap_address(address).rpartition(":")
    except (ImportError, AttributeError, ValueError):
        pass
    return host, int(port)


@contextmanager
def addresses_seen_from(address: str):
    """Meanwhile, Ray learns this host's own address by routing towards `address` (HOST:PORT: the head,
    or this node's own given address), never towards a public one. Ray asks whenever it meets a loopback
    address (resolve_ip_for_localhost: ray.init, `ray start --node-ip-address 127.0.0.1`) or none, and
    unless told whom to ask, it connects a UDP socket to a public DNS server (8.8.8.8) to read which
    local address the route takes. Routed towards the head instead, the answer is the address the head
    sees this host at (127.0.0.1 for a head on loopback), and nothing is sent anywhere."""
    import ray.util
    from ray._private import services  # not public; services.get_node_ip_address is what Ray asks

    real = services.get_node_ip_address

    def towards(address_asked=None):
        return real(address_asked or address)

    services.get_node_ip_address = ray.util.get_node_ip_address = towards
    try:
        yield
    finally:
        services.get_node_ip_address = ray.util.get_node_ip_address = real


@contextmanager
def quiet_stderr():
    """File descriptor 2 to /dev/null meanwhile (what C++ code writes there too)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class Board:
    """What runs where now, for `testbed farm status`: each task says when it starts and ends a job.
    Ray's own task listing needs its dashboard, which the plain `ray` package does not have."""

    def __init__(self):
        self.running: dict[str, dict] = {}

    def start(self, device: str, job: str, node_id: str) -> None:
        self.running[device] = {"job": job, "node_id": node_id, "since": time.time()}

    def end(self, device: str) -> None:
        self.running.pop(device, None)

    def show(self) -> dict[str, dict]:
        return self.running


def board(ray):
    """The cluster's one board, on the head (made by the first who asks; it lives as long as the cluster)."""
    return ray.remote(Board).options(name=BOARD, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                                     num_cpus=0, resources={"node:__internal_head__": 0.001}).remote()


# --- the nodes ------------------------------------------------------------------------------------


def node_label(node: dict) -> str:
    """How records and reports name a node: its host and the start of its Ray node id."""
    return f"{node['NodeManagerHostname']} {node['NodeID'][:8]}"


def owners(ray) -> dict[str, dict]:
    """device -> the live node that advertises it."""
    return {key[len(RESOURCE):]: node for node in ray.nodes() if node["Alive"]
            for key in node["Resources"] if key.startswith(RESOURCE)}


# --- on a node: one job ---------------------------------------------------------------------------


def run_job(experiment: str, overrides: list[str], lock_dir: str, lock_wait_s: float, holder: str) -> dict:
    """Runs on the node that owns the device: the job, into a scratch store; returns what it stored (its
    records between its run marks) and how it ended (status ok | unreachable | busy, the run's info, and
    the error if the run broke)."""
    import ray

    rc = config.load(overrides, experiment=experiment)
    node = {"node_id": ray.get_runtime_context().get_node_id(), "hostname": socket.gethostname(),
            "started": time.time()}
    shown = board(ray)
    shown.start.remote(rc.device, nightly.job_label(rc), node["node_id"])
    ended = {"status": "ok", "reason": "", "error": "", "info": None}
    before = os.environ.get("TESTBED_RESULTS")
    with tempfile.TemporaryDirectory(prefix="testbed-farm-") as scratch:
        os.environ["TESTBED_RESULTS"] = scratch  # a Ray worker runs one task at a time
        try:
            with device_lock(rc.device, lock_wait_s, holder, Path(lock_dir) if lock_dir else None):
                device = nightly.open_device(rc.device)
                try:
                    ended["info"] = asdict(runner.execute(rc, device=device).info)
                finally:
                    device.close()
        except DeviceBusy as e:
            ended.update(status="busy", reason=str(e))
        except DeviceUnreachable as e:
            ended.update(status="unreachable", reason=str(e))
        except Exception as e:  # noqa: BLE001 -- the runner stored an error record; the driver reports it
            ended["error"] = f"{type(e).__name__}: {e}"
        finally:
            if before is None:
                del os.environ["TESTBED_RESULTS"]
            else:
                os.environ["TESTBED_RESULTS"] = before
            shown.end.remote(rc.device)
        rows = ResultsStore(scratch).rows()
    node["finished"] = time.time()
    for row in rows:
        row["farm"] = node
    return {**ended, "rows": rows}


# --- the driver -----------------------------------------------------------------------------------


def error_rows(rc: RunConfig, why: str, node: dict) -> list[dict]:
    """The one record of a job that was lost before it could store its own (verdict error, naming the
    node), between the marks of a run that broke."""
    info = RunInfo(experiment=rc.experiment, device=rc.device, backend=str(rc.cfg.get("backend", "refimpl")),
                   config=rc.flat(), fingerprint={"profile": rc.device},
                   emulated=load_profile(rc.device).has("emulated"))
    row = info.stamp(Record(rc.experiment, "run", "oracle", "run", "error", None, {"records_before_error": 0},
                            detail=why))
    row["farm"] = {"node_id": node["NodeID"], "hostname": node["NodeManagerHostname"]}
    return [info.mark("started"), row, info.mark("ended", "broke")]


def on_the_farm(ray, jobs: list[RunConfig], store: ResultsStore, log: nightly.Log, lock_dir: Path | None,
                lock_wait_s: float, holder: str):
    """Every job as a task on its device's node. Yields (job, how it ended) as each job ends, its
    records already appended to `store`. A device no node advertises: its jobs end unreachable at once."""
    owner = owners(ray)
    task = ray.remote(max_retries=0, num_cpus=0)(run_job)
    pending: dict = {}  # ObjectRef -> job
    for device in dict.fromkeys(rc.device for rc in jobs):
        mine = [rc for rc in jobs if rc.device == device]
        if device not in owner:
            log(device, f"unreachable: {unowned(device)}")
            for rc in mine:
                yield rc, {"status": "unreachable", "reason": unowned(device), "rows": []}
            continue
        log(device, f"{len(mine)} job(s) on node {node_label(owner[device])}")
        # Ray starts its workers with OMP_NUM_THREADS=1; a job must see the host's cores as a local run
        # does (the numpy around a measurement uses them; measured sections set their own limits)
        cores = {"env_vars": {"OMP_NUM_THREADS": str(int(owner[device]["Resources"].get("CPU", 1)))}}
        for rc in mine:
            ref = task.options(resources={resource(device): 1}, name=f"{device}: {nightly.job_label(rc)}",
                               runtime_env=cores).remote(rc.experiment, rc.overrides,
                                                         str(lock_dir) if lock_dir else "", lock_wait_s, holder)
            pending[ref] = rc
    lost: dict[str, str] = {}  # device -> why its remaining jobs were cancelled
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=WATCH_S)
        for ref in done:
            rc = pending.pop(ref)
            ended = collect(ray, ref, rc, owner[rc.device], lost.get(rc.device), store, log)
            if ended["status"] != "ok" and rc.device not in lost:
                lost[rc.device] = ended["reason"]
                cancel(ray, pending, rc.device)
            yield rc, ended
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        for device in {rc.device for rc in pending.values()} - set(lost):
            if owner[device]["NodeID"] not in alive:
                lost[device] = f"node {node_label(owner[device])} died"
                log(device, f"{lost[device]}: its jobs end as error records")
                cancel(ray, pending, device)


def unowned(device: str) -> str:
    return f"no farm node advertises {resource(device)}"


def cancel(ray, pending: dict, device: str) -> None:
    for ref, rc in pending.items():
        if rc.device == device:
            ray.cancel(ref)


def stored_here(row: dict, store: ResultsStore) -> None:
    """A row a worker returned says where it is stored: the coordinator's store, not the results_dir the
    worker composed (its rows went to a scratch store on its node, then here); the worker's stays
    beside it under farm.worker_results_dir."""
    composed = row.get("config", {}).get("results_dir") if isinstance(row.get("config"), dict) else None
    if composed is None:
        return
    row.setdefault("farm", {})["worker_results_dir"] = composed
    row["config"]["results_dir"] = str(store.root)


def collect(ray, ref, rc: RunConfig, node: dict, lost: str | None, store: ResultsStore, log: nightly.Log) -> dict:
    """One finished task: how it ended, its rows (or the one error record of a lost job) stored, and its
    records (the rows that are not run marks)."""
    label = nightly.job_label(rc)
    try:
        ended = ray.get(ref)
    except ray.exceptions.TaskCancelledError:
        ended = {"status": "unreachable", "reason": f"not run: {lost}", "rows": []}
    except ray.exceptions.RayError as e:  # the node or the worker died under the task
        ended = {"status": "unreachable", "rows": [],
                 "reason": f"lost on node {node_label(node)}: it died under the job ({type(e).__name__})"}
    if ended["status"] != "ok" and not ended["rows"]:
        ended["rows"] = error_rows(rc, ended["reason"], node)
    for row in ended["rows"]:
        stored_here(row, store)
    store.append(ended["rows"])
    ended["records"] = [row for row in ended["rows"] if "record_id" in row]
    if ended["status"] != "ok":
        log(rc.device, f"{label}: {ended['status']}: {ended['reason']}")
    elif ended["error"]:
        log(rc.device, f"{label} broke on node {node_label(node)}: {ended['error']}")
    else:
        log(rc.device, f"{label}: {len(ended['records'])} records from node {node_label(node)}")
    return ended


# --- what runs on the farm: a night, a run, a sweep -----------------------------------------------


def driver(address: str, suite: nightly.Suite):
    """nightly.run_night's `drive` for farm=ADDRESS, for `suite`."""
    if any(isinstance(rc, nightly.ABJob) for jobs in suite.jobs.values() for rc in jobs):
        raise UsageError(f"suite {suite.name}: A/B runs (ab: true) are measured on this host's devices; "
                         "farm= does not take them yet (run this suite without farm=, or drop its ab runs)")

    def drive(suite: nightly.Suite, store: ResultsStore, night: str, log: nightly.Log) -> list[nightly.DeviceNight]:
        started = time.monotonic()
        ray = join(address)
        results = {d: nightly.DeviceNight(d) for d in suite.devices}
        for device in set(suite.devices) - set(owners(ray)):  # listed even if none of tonight's jobs is its
            results[device].status, results[device].reason = "unreachable", unowned(device)
        jobs = [rc for d in suite.devices for rc in suite.jobs[d]]
        for rc, ended in on_the_farm(ray, jobs, store, log, suite.lock_dir, suite.lock_wait_s, f"farm night {night}"):
            result = results[rc.device]
            result.seconds = time.monotonic() - started
            if ended["status"] != "ok":
                if result.status == "ok":  # the first reason a device was lost is the one that counts
                    result.status, result.reason = ended["status"], ended["reason"]
            elif ended["error"]:
                result.failures.append(f"{rc.device} {nightly.job_label(rc)}: run broke: {ended['error']}")
            else:
                result.count(ended["info"]["run_id"], ended["records"])
        for r in results.values():
            log(r.device, f"{r.status}{': ' + r.reason if r.reason else ''} ({r.seconds:.1f} s)")
        return list(results.values())
    return drive


def execute(address: str, jobs: list[RunConfig], store: ResultsStore) -> list[runner.Outcome]:
    """`testbed run` and `sweep` with farm=ADDRESS: the jobs on their devices' nodes (devices side by
    side), their records in `store`; the outcomes in the jobs' order. A job that did not end well
    raises as runner.execute would, once every job has ended."""
    locks = None  # each node's per-user default (testbed.devices.private), the one its nightly and pytest take
    ended = {id(rc): how for rc, how in on_the_farm(join(address), jobs, store, nightly.Log(), locks, 0.0,
                                                   f"farm run, pid {os.getpid()}")}
    for rc in jobs:
        how = ended[id(rc)]
        if how["status"] != "ok":
            raise DeviceUnreachable(f"{rc.device}: {how['reason']}")
        if how["error"]:
            raise DeviceError(f"{rc.device} {nightly.job_label(rc)}: {how['error']}")
    return [runner.Outcome(RunInfo(**ended[id(rc)]["info"]), ended[id(rc)]["records"]) for rc in jobs]


# --- the commands ---------------------------------------------------------------------------------


def node_resources(names: list[str]) -> tuple[dict[str, float], list[str]]:
    """The resources this host's node advertises, one per device that answers now, and a line for
    each device left out and why."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        reach = dict(zip(names, pool.map(reachability, names)))
    left_out = [f"{name}: left out, {answer}" for name, answer in reach.items() if answer != "yes"]
    return {resource(name): 1.0 for name, answer in reach.items() if answer == "yes"}, left_out


# The ports `ray start` gives to its own components by default: a head's --port there fails inside Ray
# (a ValueError) once the node is half started.
RAY_PORTS = {8265: "Ray's dashboard", 10001: "Ray's client server"}
RAY_WORKER_PORTS = range(10002, 20000)


def check_port(port: int) -> None:
    if not 1024 <= port <= 65535:
        raise UsageError(f"--port={port} is not a port a Ray head can take; accepted: 1024-65535 (default 6379)")
    taken = RAY_PORTS.get(port) or ("inside Ray's worker port range "
                                    f"{RAY_WORKER_PORTS.start}-{RAY_WORKER_PORTS.stop - 1}" if port in RAY_WORKER_PORTS else "")
    if taken:
        raise UsageError(f"--port={port} is {taken}; accepted: a port in 1024-65535 outside "
                         f"{RAY_WORKER_PORTS.start}-{RAY_WORKER_PORTS.stop - 1} and other than "
                         f"{', '.join(map(str, RAY_PORTS))} (default 6379)")


NODE_START_S = 120.0  # how long `ray start` may take to bring this host's node up


def node_ip(value: str | None, head: bool) -> str | None:
    """--node-ip-address: the address this node is reached at by the others (a lab's LAN address, or
    127.0.0.1 for a one-host farm). By default a head is on loopback (other hosts join a head started
    with its LAN address), and a joining node is at the address its route to the head takes (None:
    Ray reads it, routing towards the head: addresses_seen_from)."""
    if value is None:
        return LOOPBACK if head else None
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise UsageError(f"--node-ip-address {value!r} is not an IP address; accepted: this host's address on "
                         f"the lab's network, e.g. 10.0.0.5 (127.0.0.1: every node on this host)") from None


LOOPBACK = "127.0.0.1"


def next_steps(args, address: str, resources: dict, log: Path) -> str:
    """What to do once this node is up: testbed's commands, never Ray's (`ray stop` stops every Ray node
    on the host, other users' included)."""
    devices = ", ".join(name[len(RESOURCE):] for name in resources)
    lines = [f"farm node: up, advertising {devices}" + ("" if args.address else f"; this is the head, at {address}")]
    if not args.address and node_ip(args.node_ip_address, head=True) == LOOPBACK:
        lines.append("  other hosts cannot join a head on loopback: start it with --node-ip-address, this host's "
                     "address on the lab's network")
    elif not args.address:
        lines.append(f"  other hosts join with:  testbed farm node --address {address} "
                     f"[--node-ip-address THEIR_ADDRESS] [--devices a,b]")
    lines += [f"  run a night on the farm: testbed nightly farm={address}",
              f"  see the nodes and jobs:  testbed farm status --address {address}",
              f"  stop this node:          Ctrl-C here (or kill {os.getpid()}); Ray's own log: {log}"]
    return "\n".join(lines)


def cmd_node(args) -> int:
    if not args.address:
        check_port(args.port)
    ip = node_ip(args.node_ip_address, head=not args.address)
    known = config.choices("device")
    names = args.devices.split(",") if args.devices else known
    for name in names:
        if name not in known:
            raise UsageError(f"--devices: unknown device {name!r}{did_you_mean(name, known)}; "
                             f"accepted: {', '.join(known)}")
    resources, left_out = node_resources(names)
    for line in left_out:
        print(line, file=sys.stderr)
    if not resources:
        print("farm node: no device answers here; nothing to advertise", file=sys.stderr)
        return DeviceUnreachable.exit_status
    where = [f"--address={args.address}"] if args.address else ["--head", f"--port={args.port}"]
    # `ray start` under addresses_seen_from: towards the head, or this node's own address (python -m testbed.lab.farm)
    towards = args.address or f"{ip}:{args.port}"
    argv = [sys.executable, "-m", "testbed.lab.farm", towards, "start", *where, f"--resources={json.dumps(resources)}",
            *([f"--node-ip-address={ip}"] if ip else []), "--include-dashboard=false", "--block"]
    print(f"farm node: starting Ray, advertising {', '.join(resources)}", file=sys.stderr)
    from testbed.devices.private import user_temp

    log = user_temp("farm") / f"ray-node-{os.getpid()}.log"
    return run_node(argv, log, lambda up_at: print(next_steps(args, args.address or f"{up_at}:{args.port}",
                                                              resources, log), file=sys.stderr))


# Ray reports usage statistics to its vendor unless told not to, and its dashboard reports even that it
# was told not to (and probes cloud metadata addresses): a lab's farm sends nothing anywhere but to its
# own nodes, so usage stats are off, the report goes nowhere (a closed loopback port) and nodes start without
# the dashboard (testbed never uses it). Ray's dashboard process still asks the cloud metadata address
# (169.254.169.254, link-local) what cloud it runs in; nothing in Ray turns that off.
NO_USAGE_STATS = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/"}


def run_node(argv: list[str], log: Path, on_up) -> int:
    """`ray start --block` as a child, its output in `log`: once it says the node is up, `on_up(node IP)`;
    then wait. Ending this command (Ctrl-C, SIGTERM) stops this node, and only it."""
    with open(log, "w") as out:  # a child of testbed's (testbed.children): it stops with this command
        proc = children.start(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **NO_USAGE_STATS})
    try:
        deadline = time.monotonic() + NODE_START_S
        while True:
            text = log.read_text(errors="replace")
            if "Ray runtime started" in text:
                found = re.search(r"Local node IP: ([0-9a-fA-F.:]+)", text)
                on_up(found.group(1) if found else "THIS_HOST")
                return proc.wait()
            if proc.poll() is not None or time.monotonic() > deadline:
                said = [ln.strip() for ln in text.splitlines() if ln.strip()]
                how = f"exit {proc.returncode}" if proc.returncode is not None else f"not up after {NODE_START_S:g} s"
                last = said[-1][-300:] if said else "no output"
                print(f"farm node: Ray did not start ({how}): {last} (its output: {log})", file=sys.stderr)
                return DeviceUnreachable.exit_status
            time.sleep(0.2)
    finally:
        children.end(proc, grace_s=60)  # Ray's node drains and stops its own processes on SIGTERM


def cmd_status(args) -> int:
    ray = join(args.address)
    try:
        running = ray.get(board(ray).show.remote(), timeout=CONNECT_S)
    except ray.exceptions.GetTimeoutError:
        raise DeviceUnreachable(f"farm status: the head at {args.address} did not say what runs where within "
                                f"{CONNECT_S:g} s (busy, or its node is short of resources); try again") from None
    except ray.exceptions.RayError as e:
        raise DeviceUnreachable(f"farm status: the head at {args.address} could not be asked what runs where "
                                f"({type(e).__name__})") from None
    for node in sorted(ray.nodes(), key=lambda n: (not n["Alive"], n["NodeManagerHostname"], n["NodeID"])):
        devices = sorted(k[len(RESOURCE):] for k in node["Resources"] if k.startswith(RESOURCE))
        print(f"node {node_label(node)} at {node['NodeManagerAddress']}: {'alive' if node['Alive'] else 'dead'}, "
              f"{len(devices)} device(s)")
        for device in devices:
            job = running.get(device) if node["Alive"] else None
            now = (f"running {job['job']} for {time.time() - job['since']:.0f} s"
                   if job and job["node_id"] == node["NodeID"] else "idle" if node["Alive"] else "gone with its node")
            print(f"  {device:<16} {now}")
    return 0


def register(commands) -> None:
    f = commands.add_parser("farm", help="the lab's Ray cluster: start this host's node, or show the nodes")
    sub = f.add_subparsers(dest="farm_command", required=True)
    n = sub.add_parser("node", help="start this host's Ray node, advertising the devices that answer")
    n.add_argument("--address", help="the head's HEAD:PORT to join (default: start the head here)")
    n.add_argument("--port", type=int, default=6379, help="the head's port (with no --address)")
    n.add_argument("--devices", help="a,b,...: the profiles attached here (default: every profile that answers)")
    n.add_argument("--node-ip-address", help="this host's address the other nodes reach it at (default: 127.0.0.1 "
                                             "on a head, a farm on this host alone; on a joining host, its address "
                                             "towards the head)")
    n.set_defaults(fn=cmd_node)
    s = sub.add_parser("status", help="the nodes, their devices, which run a job now")
    s.add_argument("--address", required=True, help="the head's HEAD:PORT")
    s.set_defaults(fn=cmd_status)


def start_ray(argv: list[str]) -> int:
    """`python -m testbed.lab.farm TOWARDS start ...`: Ray's `ray start ...` (what `farm node` runs), its
    own address learned towards TOWARDS (addresses_seen_from), never towards a public server."""
    from ray.scripts.scripts import cli

    with addresses_seen_from(argv[0]):
        try:
            cli.main(args=argv[1:], prog_name="ray")
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    return 0


if __name__ == "__main__":
    sys.exit(start_ray(sys.argv[1:]))
