"""The lab: what runs over nights, trees and hosts, above single runs.

  nightly  `testbed nightly`: a suite on its devices, its records stored, regressions judged, the report
  farm     the same over a lab's hosts (Ray): each job on the node that owns its device
  ab       `testbed ab A B`: two source trees' kernels measured interleaved in one job, judged on pairs
  compare  `testbed compare A B`: two stores, nights or commits side by side, each change judged
  ingest   `testbed ingest FILE`: a tool's output from a run made elsewhere, into the store

May use every layer below it (experiments, the report, measure, devices, backends). Only the CLI
uses it (tests/test_layering.py).
"""
