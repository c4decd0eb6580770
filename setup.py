"""Builds the native kernels (kernels/) into the package as testbed/_tb_kernels*.so, for both
`pip install .` and `pip install -e .`. The metadata is in pyproject.toml; the build rules are in
testbed/backends/native/build.py, loaded by path because the package is not importable during its own build."""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup

_spec = importlib.util.spec_from_file_location("kernel_build", Path(__file__).parent / "testbed" / "backends" / "native" / "build.py")
kernel_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_build)

setup(ext_modules=[Extension(**kernel_build.library_extension_args())])
