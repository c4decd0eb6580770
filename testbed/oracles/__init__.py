"""Oracles: the verdicts that decide whether an optimised path gives what the reference gives.

  numerical  the comparison arithmetic every verdict is built on: NMSE against a float64 reference,
             bit-exactness, digests, the Verdict record. Plain numpy; any layer may use it.
  tokens     the token at a chosen position, first-token equality and mask-head checks for chunk
             prefill with past (seed 000): runs a backend's Gemma runner against refimpl's.
  tail       the padded prefill tail (seed 003): first token, byte-identical caches after rollback.
  hybrid     the hybrid model (Qwen3.5-style): chunk prefill with past and the padded tail over GDN
             recurrent state, conv state and KV cache.

May use: numpy, refimpl, testbed.backends (the runners it judges) and below. Never experiments, the
report, the lab or the CLI (tests/test_layering.py).
"""


def __getattr__(name: str):
    # testbed.oracles was a module before issue 26; what it held is testbed.oracles.numerical
    from testbed import _moved

    return _moved.package_attribute(__name__, name)
