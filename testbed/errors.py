"""The errors testbed tells users about. Each maps to an exit status; messages are one line."""

# testbed itself broke (a bug: an exception no error below names). A command that reads its exit status
# as a verdict (`testbed compare`: 1 is a regression) returns this instead, with the traceback.
INTERNAL_ERROR = 6


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


class StoreError(Exception):
    """The results store cannot take a run's records (read-only, full, not a folder): found before the
    run starts, or a batch that could not be written whole (and so was not written at all)."""

    exit_status = 5
