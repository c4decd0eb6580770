"""Measurement: how a figure is taken and how figures over time are judged.

  timing          warm-up then repetitions on a monotonic clock, CPU time beside wall time;
                  alternating and interleaved timing of what a table compares
  counts/         exact instruction counts: the QEMU plugin and valgrind, between the harness's marks
  blas_reference  the library a kernel's rate is divided by (the faster per shape of numpy's OpenBLAS and
                  oneMKL where installed), and when a ratio over it may be judged
  history         which stored runs are comparable, and where regressions are decided (step fits,
                  the machine probe as covariate, exact counts)
  breakeven       breakeven tables of the padded tail
  decisions       a decision with its confidence: the best variant and those not distinguishable from it,
                  a crossing on a grid as an interval, "undecided" with the repetitions it would take
  emulation       figures from emulated devices: real for correctness, never for speed
  seed            the seed documents' measured figures, to set beside our own

May use: numpy, scipy, refimpl, testbed.config and testbed.results. Never devices, backends,
experiments, the report, the lab or the CLI (tests/test_layering.py).
"""


def __getattr__(name: str):
    # testbed.measure was a module before issue 26; what it held is testbed.measure.timing
    from testbed import _moved

    return _moved.package_attribute(__name__, name)
