"""Loaded by every Python process the test suite starts (this folder is first on their PYTHONPATH while
the guard is on): the network guard, when TESTBED_NETGUARD_LOG names where it reports."""

try:
    import _testbed_netguard

    _testbed_netguard.install_from_environment()
except Exception:  # noqa: BLE001 -- a process must start even if the guard cannot
    pass
