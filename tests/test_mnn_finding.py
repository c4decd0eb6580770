"""MNN (engines/mnn.yaml) as a recorded finding: its adapter refuses every request, saying why, and the reason
stays true (engines/README.md, "MNN").

The finding, checked by running MNN's own exporter (llmexport 0.0.5, telemetry off) and runtime (mnn 3.6.1's
MNN.llm) on two transformers-made Gemma 3 that differ only in their RoPE (the tests' local base 100 and global
5000 with linear scaling x4, against Gemma 3's defaults 10000 and 1e6): MNN's logits are the same for both, and
neither is transformers'. Opt-in (`-m slow_build`: two exports, about a minute each under load): when it fails,
MNN's exporter changed, and an adapter over MNN.llm.Llm.forward (which keeps its cache across calls) is worth
writing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.exported_support import make_gemma3, prompt, serve, spec_of
from testbed.devices import connect, load_profile
from testbed.oracles.numerical import nmse


def test_the_adapter_refuses_every_request_saying_why(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra: pip install 'testbed[hf]'", exc_type=ImportError)
    model = make_gemma3(tmp_path / "gemma3")
    host = connect(load_profile("host"))
    try:
        response = serve(host, spec_of("mnn"), model.folder, model, prompt(model, 30), past=10, chunk=16)
    finally:
        host.close()
    assert response.refused
    assert "ignore the config's RoPE" in response.reason and "no float32 weights" in response.reason


# llmexport's converter imports MNN.tools.utils.log, which pip-installs aliyun's logging SDK when it is missing
# and reports each conversion to an Aliyun endpoint; the stand-in module below keeps both from happening.
QUIET_EXPORT = """
import sys, types
quiet = types.ModuleType("MNN.tools.utils.log")
quiet.mnn_logger = None
sys.modules["MNN.tools.utils.log"] = quiet
script = sys.argv[1] + "/llmexport.py"
sys.path.insert(0, sys.argv[1])  # llmexport.py imports its utils/ as a top-level package
sys.argv = [script, *sys.argv[2:]]
exec(compile(open(script).read(), script, "exec"), {"__name__": "__main__", "__file__": script})
"""


def mnn_logits(tmp_path, model, tokens) -> np.ndarray:
    found = importlib.util.find_spec("llmexport")  # found, not imported: its package imports `utils` top-level
    if found is None:
        pytest.skip("the mnn extra: pip install 'testbed[mnn]'")
    import MNN.llm

    out = tmp_path / f"{model.folder.name}-mnn"
    result = subprocess.run([sys.executable, "-c", QUIET_EXPORT, os.path.dirname(found.origin), "--path",
                             str(model.folder), "--export", "mnn", "--dst_path", str(out), "--quant_bit", "16"],
                            capture_output=True, text=True, timeout=1800, cwd=tmp_path)  # it writes .export.log here
    assert (out / "llm.mnn").is_file(), result.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    config["tokenizer_file"] = "tokenizer.txt"  # llmexport 0.0.5 names tokenizer.mtok but writes tokenizer.txt
    (out / "config.json").write_text(json.dumps(config))
    llm = MNN.llm.create(str(out / "config.json"))
    llm.set_config(json.dumps({"precision": "high", "thread_num": 1}))
    llm.load()
    return np.array(llm.forward([int(t) for t in tokens]).read(), np.float32).reshape(-1)


@pytest.mark.slow_build
def test_mnns_gemma3_export_ignores_the_configs_rope(tmp_path):
    pytest.importorskip("MNN", reason="the mnn extra: pip install 'testbed[mnn]'", exc_type=ImportError)
    ours = make_gemma3(tmp_path / "gemma3")
    default = make_gemma3(tmp_path / "gemma3-default-rope", rope=None)
    tokens = prompt(ours, 24)
    assert nmse(ours.transformers_logits(tokens)[None], default.transformers_logits(tokens)[None]) > 1e-3  # RoPE matters
    a, b = mnn_logits(tmp_path, ours, tokens), mnn_logits(tmp_path, default, tokens)
    assert np.array_equal(a, b), "MNN's logits now follow the config's RoPE: the finding is stale"
    assert nmse(default.transformers_logits(tokens)[None], b[None]) > 1e-3
