"""The errors testbed tells users about. Each maps to an exit status; messages are one line."""


class UsageError(Exception):
    """Bad input from the user: an unknown name, key or an out-of-range value. Exit status 2."""

    exit_status = 2


class DeviceUnreachable(Exception):
    """A device profile is valid but the device cannot be reached, with the reason why."""

    exit_status = 3


class DeviceError(Exception):
    """The device was reached, but an operation on it failed and a retry (where safe) did not help:
    a transfer that could not be verified, a full device, a command killed at its timeout."""

    exit_status = 4
