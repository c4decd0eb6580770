"""Planted faults in testbed's Python code, for the tests that show a check catches them.

A mutant is one function of a module recompiled from its own source with one edit (the edit must match
exactly once, so a refactor cannot silently turn a planted-fault test into a test of the correct code;
tests/native_support.py does the same for kernels/). The test applies it where the code under test looks
the function up (monkeypatch.setattr(module, name, mutant)) and shows that the check which passes on the
real function fails on the mutant: the suite proves, run after run, that the fault would be caught.
"""

from __future__ import annotations

import inspect
import textwrap
from types import FunctionType, ModuleType


def mutant(owner: ModuleType | type, name: str, find: str, replace: str) -> FunctionType:
    """owner.NAME (a module's function or a class's method) with `find` replaced by `replace` in its source
    (exactly once), compiled among a copy of its module's globals (so the mutant calls what the real one calls)."""
    real = getattr(owner, name)
    where = f"{real.__module__}.{real.__qualname__}"
    source = textwrap.dedent(inspect.getsource(real))
    assert source.count(find) == 1, f"the planted edit must match {where} exactly once: {find!r}"
    scope = dict(real.__globals__)
    exec(compile(source.replace(find, replace), f"<mutant of {where}>", "exec"), scope)
    planted = scope[name]
    planted.__planted__ = (find, replace)
    return planted
