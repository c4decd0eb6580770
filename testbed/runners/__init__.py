"""Device-side runners: what to push, what to run, what to pull back, and how to read it.

  native.py    a benchmark-and-dump program with .npy inputs and outputs and a timings.json
  iree.py      iree-run-module / iree-benchmark-module command builders and runs
  llamacpp.py  test-backend-ops and llama-bench on a device, into records
"""
