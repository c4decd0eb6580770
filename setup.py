"""Builds the native kernels (kernels/) into the package as testbed/_tb_kernels*.so (one per x86-64
level: build.library_variants), for both `pip install .` and `pip install -e .`, and puts the configuration (experiments/, devices/) and the
kernel sources (kernels/: the device programs are built from them at first use) inside the package of
a wheel, as testbed/_shipped/, so an installed testbed has its experiments, models, suites and device
profiles and can build native programs for any device (an editable install reads them from the checkout). The metadata is in
pyproject.toml; the build rules are in testbed/backends/native/build.py, loaded by path because the
package is not importable during its own build."""

import importlib.util
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
SHIPPED = ("experiments", "devices", "kernels", "fixtures")

_spec = importlib.util.spec_from_file_location("kernel_build", Path(__file__).parent / "testbed" / "backends" / "native" / "build.py")
kernel_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_build)



class build_py_with_config(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        for folder in SHIPPED:
            shutil.copytree(ROOT / folder, Path(self.build_lib) / "testbed" / "_shipped" / folder,
                            ignore=shutil.ignore_patterns("*.md", "*.o", "*.so"), dirs_exist_ok=True)


setup(ext_modules=[Extension(**args) for args in kernel_build.library_extension_args()], cmdclass={"build_py": build_py_with_config})
