"""Experiment `iree_artifact`: a user's own IREE artifact through the same runners and oracle.

The folder holds the module, optionally a parameter archive, and manifest.json with the contract
(function, args, results: name, shape, dtype each). The contract is checked against the module's
signature and the inputs against the contract before anything runs; a module built for another
device kind is refused. Each output is compared with the expected .npy by NMSE.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from testbed.backends.iree.artifacts import Artifact
from testbed.backends.iree.runtime import DRIVERS, RuntimeSession, run_tool
from testbed.config import Choice, Float, project_path
from testbed.errors import UsageError
from testbed.oracles.numerical import check_nmse
from testbed.results import Record

PARAMS = {
    "backend": Choice(("iree",)),
    "driver": Choice(DRIVERS),
    "runner": Choice(("python", "tool")),
    "threshold": Float(0.0, 1.0),
}


def _folder(cfg: DictConfig, key: str) -> Path:
    value = cfg.get(key)
    if value is None:
        raise UsageError(f"{key} is not set; accepted: a folder path ({key}=path/to/folder)")
    path = project_path(value)
    if not path.is_dir():
        raise UsageError(f"{key}={value!r} is not a folder")
    return path


def _arrays(folder: Path, stem: str, count: int, key: str) -> list[np.ndarray]:
    paths = [folder / f"{stem}{i}.npy" for i in range(count)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise UsageError(f"{key}: {folder} lacks {missing[0]}; accepted: {stem}0.npy .. {stem}{count - 1}.npy "
                         f"in the contract's order")
    return [np.load(p, allow_pickle=False) for p in paths]


def load(cfg: DictConfig) -> tuple[Artifact, list[np.ndarray], list[np.ndarray]]:
    parameters = project_path(cfg.parameters) if cfg.parameters else None
    artifact = Artifact.load(_folder(cfg, "artifact"), parameters)
    contract = artifact.contract
    inputs = _arrays(_folder(cfg, "inputs"), "input", len(contract.args), "inputs")
    expected = _arrays(_folder(cfg, "expected"), "output", len(contract.results), "expected")
    return artifact, inputs, expected


def validate(cfg: DictConfig) -> None:
    load(cfg)


def run(cfg: DictConfig, ctx) -> Iterator[Record]:
    artifact, inputs, expected = load(cfg)
    contract = artifact.contract
    ctx.progress(f"running {artifact.module.name} ({contract.function}) on {cfg.driver} by {cfg.runner}")
    outputs = (RuntimeSession(artifact, cfg.driver)(*inputs) if cfg.runner == "python"
               else run_tool(artifact, cfg.driver, inputs))
    names = [r.name for r in contract.results]
    v = check_nmse(dict(zip(names, expected)), dict(zip(names, outputs)), cfg.threshold)
    yield Record("iree_artifact", f"{artifact.folder.name}/{contract.function}", "oracle", "nmse", v.verdict,
                 v.margin, v.metrics, params={"driver": cfg.driver, "runner": cfg.runner},
                 artifacts={"folder": str(artifact.folder), "module": artifact.module.name,
                            "parameters": str(artifact.parameters or "")}, detail=v.detail)


def view(df: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame([{"case": r["case"], "driver": r.get("params.driver"), "runner": r.get("params.runner"),
                          "verdict": r["verdict"], "margin": r["margin"], "nmse": r.get("metrics.nmse"),
                          "detail": r["detail"]} for _, r in df.iterrows()])
