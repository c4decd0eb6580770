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


class ToolMissing(Exception):
    """A tool testbed needs on this host is not installed (a compiler, zig, make, valgrind, llama.cpp's
    source offline); the message says how to get it. Exit status 3, as for an unreachable device: as
    the host stands, this cannot run."""

    exit_status = 3


class DeviceError(Exception):
    """The device was reached, but an operation on it failed and a retry (where safe) did not help:
    a transfer that could not be verified, a full device, a command killed at its timeout."""

    exit_status = 4


class StoreError(Exception):
    """The results store cannot take a run's records (read-only, full, not a folder): found before the
    run starts, or a batch that could not be written whole (and so was not written at all)."""

    exit_status = 5


def closest(name: str, accepted) -> str | None:
    """The accepted name closest to a mistyped one, None when none is close (difflib's ratio >= 0.6:
    `gdm` -> gdn, `nosuch` -> nothing)."""
    from difflib import get_close_matches

    close = get_close_matches(str(name), [a for a in map(str, accepted) if a != str(name)], n=1)
    return close[0] if close else None


def did_you_mean(name: str, accepted) -> str:
    """' (did you mean 'X'?)', or '' when no accepted name is close: put after the bad value in a
    UsageError's line, before what is accepted."""
    close = closest(name, accepted)
    return f" (did you mean {close!r}?)" if close else ""
