"""`testbed engine`: an engine under test's kept calls (testbed.backends.engine.keep).

  testbed engine replay RUN CALL     the call a run kept (CALL: its number in the run's FAIL line, or its
                                     request's sha256 or a prefix), rebuilt as a request folder on its
                                     device and run once by the engine: what it answered (status, logits
                                     rows and their tokens, cache/, timings), or how it failed
  testbed engine replay SHA          the same, by the request's sha256 (or a unique prefix)
  testbed engine replay RUN          the calls the run kept, numbered

--results DIR reads another store than the configured one (the FAIL line's command says it where the
run's store was not the project's results/); --device NAME replays on another device of the same ABI.
Before anything runs, the kept request is checked to be the one its folder is named by, and the program
and the model to be the bytes that ran. Exit 0 when the engine answered (ok or refused), 4 when it
failed again (the failure said in one line), 2 for a kept call that cannot be replayed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from testbed import config
from testbed.backends.engine import keep
from testbed.backends.engine.runner import ContractError, Expect, Request, call
from testbed.backends.engine.spec import EngineSpec
from testbed.devices import connect, load_profile


@dataclass
class StoredRequest(Request):
    """A kept request as it was sent: request.json's object exactly (its sha256 unchanged), whatever fields
    it holds."""

    body: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        return self.body


def spec_of(kept: keep.KeptCall) -> EngineSpec:
    """The engine as it was called: its name and yaml, invoke, timeout and counts from call.json."""
    c = kept.call
    return EngineSpec(name=c["engine"], path=Path(c["engine_yaml"]), yaml_sha256=c["engine_yaml_sha256"],
                      description="", source=None, command=None, prebuilt=None, program=kept.program.name, abis=(),
                      techniques=(), model_formats=(), weights=(), cache=(), invoke=tuple(c["invoke"]),
                      timeout_s=float(c["timeout_s"]), counts=c["counts"])


def request_of(kept: keep.KeptCall) -> StoredRequest:
    body = kept.body
    return StoredRequest(body["technique"], kept.tokens, kept.model, body["model"]["format"],
                         logits_at=list(body.get("logits_at") or []), state=bool(body.get("state")),
                         count=bool(body.get("count")), body=body)


def answered(response, request: StoredRequest) -> list[str]:
    """What the engine answered, in lines."""
    if response.refused:
        return [f"the engine refused: {response.reason}"]
    lines = [f"the engine answered ok: logits {list(response.logits.shape)} at logits_at {request.logits_at}"]
    for position, row in zip(request.logits_at, response.logits):
        top = np.argsort(row)[::-1][:2]
        lines.append(f"  position {position}: token {int(top[0])} (logit {float(row[top[0]]):.6g}; next {int(top[1])} "
                     f"at {float(row[top[1]]):.6g})")
    if response.cache_k is not None:
        lines.append(f"cache/: {len(response.cache_k)} layers, K and V {list(response.cache_k[0].shape)} "
                     "(kv_heads, rows, head_dim)")
    if response.state is not None:
        lines.append(f"state.bin: {response.state.size} bytes")
    calls = response.timings.get("calls") or []
    lines.append(f"timings.json: {len(calls)} calls, {sum(float(c['wall_s']) for c in calls):.6g} s wall by the "
                 f"engine's clock; engine {response.timings.get('engine')}")
    return lines


def cmd_replay(args) -> int:
    store = Path(args.results) if args.results else config.results_path(config.load([]).cfg.results_dir)
    listed = keep.read_index(store / keep.FOLDER / keep.BY_RUN / Path(args.what).name)
    if args.call is None and listed:  # RUN alone: its kept calls
        for entry in listed:
            print(f"{entry['call']}  {entry['sha256'][:16]}  {entry['why']}")
        return 0
    kept = keep.read(keep.find(store, args.what, args.call))
    device = connect(load_profile(args.device or kept.call["device"]))
    request, spec = request_of(kept), spec_of(kept)
    print(f"replaying request {kept.folder.name[:16]} ({kept.call['why']})")
    print(f"engine {spec.name} ({spec.path}), program {kept.program} (sha256 {kept.call['program_sha256'][:16]}), "
          f"on {device.name}")
    by_hand, gdb = keep.host_commands(device, spec.invoke, kept.program, kept.folder)
    print(f"by hand:   {by_hand}\nunder gdb: {gdb}")
    try:
        response = call(device, spec, request, Expect(**kept.call["expect"]), kept.program)
    except ContractError as e:
        print(f"testbed: the engine failed again: {e}", file=sys.stderr)
        return e.exit_status
    finally:
        device.close()
    if response.request_sha256 != kept.folder.name:  # the request sent is not the one kept: never say it was
        print(f"testbed: the request sent has sha256 {response.request_sha256}, not {kept.folder.name}",
              file=sys.stderr)
        return 6
    print("\n".join(answered(response, request)))
    return 0


def register(commands) -> None:
    e = commands.add_parser("engine", help="an engine under test's kept calls: replay")
    sub = e.add_subparsers(dest="action", required=True)
    r = sub.add_parser("replay", help="rebuild a kept request folder and run the engine once on it")
    r.add_argument("what", help="RUN (a run id) with CALL, or a request's sha256 (a prefix of 8+ hex digits)")
    r.add_argument("call", nargs="?", help="the call's number in the run's FAIL line, or its sha256 prefix")
    r.add_argument("--results", help="the results store (default: TESTBED_RESULTS or results_dir)")
    r.add_argument("--device", help="replay on this device (default: the one it ran on)")
    r.set_defaults(fn=cmd_replay)
