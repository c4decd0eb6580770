"""Real peers for the test suite: a loopback adbd (the device side of ADB)."""
