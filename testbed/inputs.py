"""Files that come from outside testbed (a user's checkpoint folder or module manifest, an engine's
response) read in memory bounded before anything is read, and parsed without a traceback: whatever is
wrong is one line naming the file and the value, raised as the caller's error (UsageError for a user's
input, exit 2; the engine runner's ContractError, exit 4)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from testbed.errors import UsageError


def read_bounded(path: Path, limit: int, shown: str, why: str, error: type[Exception] = UsageError) -> bytes:
    """The file's bytes, refused when it holds more than `limit` (`why` says what allows that much)."""
    try:
        size = path.stat().st_size
        if size > limit:
            raise error(f"{shown} is {size} bytes; accepted: at most {limit} ({why})")
        with open(path, "rb") as f:
            data = f.read(limit + 1)  # a file that grew since: no further
    except OSError as e:
        raise error(f"{shown} cannot be read: {e.strerror}") from None
    if len(data) > limit:
        raise error(f"{shown} is more than {limit} bytes; accepted: at most {limit} ({why})")
    return data


def parse_json(text: str | bytes, shown: str, error: type[Exception] = UsageError, kind: type | None = None):
    """The JSON value of `text`, of type `kind` when given (dict: an object, list: an array)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise error(f"{shown} is not JSON testbed reads: it nests deeper than {_depth()} levels") from None
    except json.JSONDecodeError as e:
        raise error(f"{shown} is not JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise error(f"{shown} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        said = str(e)
        if "digits" in said:
            import sys

            said = f"it holds an integer of more than {sys.get_int_max_str_digits()} digits"
        raise error(f"{shown} is not JSON testbed reads: {said}") from None
    if kind is not None and not isinstance(value, kind):
        raise error(f"{shown} is {json_kind(value)}, not {json_kind(kind())}")
    return value


def json_kind(value) -> str:
    """What a parsed JSON value is, in JSON's words: an object, an array, a string, a number, ..."""
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _depth() -> int:
    import sys

    return sys.getrecursionlimit()


def shown(value, limit: int = 80) -> str:
    """A value for a one-line message, however large or deep: a bounded repr (reprlib: the first entries
    of a long list, the start of a long string), an array by its first entries and its length."""
    import reprlib

    if isinstance(value, np.ndarray):
        if value.size > 8:
            return f"[{', '.join(map(repr, value.ravel()[:4].tolist()))}, ... ({value.size} entries)]"
        value = value.tolist()
    brief = reprlib.Repr()
    brief.maxlevel, brief.maxstring, brief.maxother, brief.maxlong = 3, limit, limit, 40
    brief.maxlist = brief.maxtuple = brief.maxdict = brief.maxset = 6
    text = brief.repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."
