"""testbed: validation and benchmarking of on-device LLM prefill."""

from pathlib import Path

__version__ = "0.2.0"

_PACKAGE = Path(__file__).resolve().parent

# In a checkout (installed editable or not at all) the configuration, experiments/ and devices/, sits
# beside the package, and so do results/ and .cache/. An installed wheel carries a copy of the
# configuration inside the package, as _shipped/ (setup.py puts it there); its results and caches go
# where testbed is run, since site-packages is no place for them.
if (_PACKAGE.parent / "experiments" / "config.yaml").is_file():
    PROJECT_ROOT = CONFIG_ROOT = _PACKAGE.parent
else:
    PROJECT_ROOT, CONFIG_ROOT = Path.cwd(), _PACKAGE / "_shipped"

# The old flat module paths of 0.1 (testbed.token_oracle, testbed.history, ...), for one release.
from testbed import _moved  # noqa: E402

_moved.install()
