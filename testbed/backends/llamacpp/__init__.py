"""llamacpp backend: llama.cpp's own tools on a device.

  build.py          test-backend-ops, llama-bench and tb_ggml_gdn built from a llama.cpp source tree
                    (the llama-cpp-python sdist's by default) for the device's ABI, cached by content
  CMakeLists.txt    the CMake project build.py configures (llama.cpp itself is never in this repository)
  runner.py         the tools run on the device (the profile's, or built and pushed) into records
  output.py         their console and JSON outputs parsed
  ggml_gdn.py       ggml's GATED_DELTA_NET judged by testbed's float64 reference (tb_ggml_gdn.c runs it)
"""
