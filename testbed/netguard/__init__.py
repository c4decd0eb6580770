"""The test suite's network guard (testbed/netguard/_testbed_netguard.py; the pytest plugin turns it on)."""

from pathlib import Path

from testbed.netguard._testbed_netguard import ENV_LOG, ENV_UNPOLICED, install, outside, take, unpoliced

# First on a Python process's PYTHONPATH, this folder's sitecustomize installs the guard there too.
SITE_DIR = Path(__file__).parent

__all__ = ["ENV_LOG", "ENV_UNPOLICED", "SITE_DIR", "install", "outside", "take", "unpoliced"]
