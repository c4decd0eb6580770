"""Where the modules of testbed 0.1's flat layout went, for one release.

Issue 26 put testbed/'s thirty modules into packages. A lab's own experiment written against an old
path (`from testbed.token_oracle import TokenCase`, `from testbed import history`) still runs: the old
module name is an alias of the new module, and importing it warns with a DeprecationWarning naming the
new path. Three old modules are now packages of the same name (testbed.oracles, testbed.measure,
testbed.report); what they held is reached through the package for one release with the same warning.
The next release deletes this file and the hook that installs it (testbed/__init__.py).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module -> its new place
MODULES = {
    "testbed.token_oracle": "testbed.oracles.tokens",
    "testbed.tail_oracles": "testbed.oracles.tail",
    "testbed.hybrid_oracles": "testbed.oracles.hybrid",
    "testbed.checkpoints": "testbed.models.checkpoints",
    "testbed.hybrid_checkpoints": "testbed.models.hybrid_checkpoints",
    "testbed.prompts": "testbed.models.prompts",
    "testbed.contract": "testbed.models.contract",
    "testbed.history": "testbed.measure.history",
    "testbed.breakeven": "testbed.measure.breakeven",
    "testbed.emulation": "testbed.measure.emulation",
    "testbed.blas_reference": "testbed.measure.blas_reference",
    "testbed.seed": "testbed.measure.seed",
    "testbed.counts": "testbed.measure.counts",
    "testbed.tables": "testbed.report.tables",
    "testbed.plots": "testbed.report.plots",
    "testbed.implementations": "testbed.report.implementations",
    "testbed.nightly": "testbed.lab.nightly",
    "testbed.farm": "testbed.lab.farm",
    "testbed.ab": "testbed.lab.ab",
    "testbed.compare": "testbed.lab.compare",
    "testbed.ingest": "testbed.lab.ingest",
    "testbed.device_cli": "testbed.cli.devices",
    "testbed.records_cli": "testbed.cli.records",
}
# old module that is now a package -> the module that holds what it held
PACKAGES = {
    "testbed.oracles": "testbed.oracles.numerical",
    "testbed.measure": "testbed.measure.timing",
    "testbed.report": "testbed.report.build",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new} (issue 26); the old path goes in the next release",
                  DeprecationWarning, stacklevel=3)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name and loads it as the new module itself (one module object, two names)."""

    def find_spec(self, name, path=None, target=None):
        if name in MODULES:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        _warn(spec.name, MODULES[spec.name])
        return importlib.import_module(MODULES[spec.name])

    def exec_module(self, module):
        pass  # the new module has run already


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())


def package_attribute(package: str, name: str):
    """An attribute of an old module that is now a package (the package's __getattr__)."""
    held = PACKAGES[package]
    # A submodule not imported yet is asked for here first (`from testbed.report import plots`): the
    # import system must import it, not find a name of the held module.
    if name.startswith("__") or importlib.util.find_spec(f"{package}.{name}") is not None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    module = importlib.import_module(held)
    try:
        value = getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
    _warn(f"{package}.{name}", f"{held}.{name}")
    return value
