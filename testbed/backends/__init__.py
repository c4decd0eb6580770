"""Backends: everything one backend needs, from building its artifacts to running a technique's graphs
on a device through the device's transport (testbed/backends/NAME/)."""
