"""testbed: validation and benchmarking of on-device LLM prefill."""

from pathlib import Path

__version__ = "0.1.0"

# The checkout holds the configuration (experiments/, devices/) beside the code; the package is
# installed editable, so the project root is one folder up from here.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
