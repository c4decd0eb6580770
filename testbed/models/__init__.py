"""Models: what a run feeds the reference and the device.

  checkpoints         Gemma 3 checkpoints: a Hugging Face folder or a GGUF file
  hybrid_checkpoints  Qwen3.5 text checkpoints (a Hugging Face folder or a GGUF file) for refimpl.qwen35
  gguf_files          the GGUF of a Hugging Face folder (Gemma 3, Qwen3.5) as llama.cpp's converter
                      writes it, judged by testbed's own reader; cached by content
  gguf_reader         a GGUF file's metadata and tensors, read as llama.cpp's gguf.cpp reads them, in
                      memory bounded by the file (every count checked before anything is allocated)
  prompts             the token ids a run feeds the model, from ids or text through the checkpoint's
                      own tokenizer, and where they came from
  contract            the graph contract: each Gemma graph's arguments and results, in order, with
                      shapes and dtypes (IREE's modules and the native engine keep to it)

May use: numpy, refimpl, testbed.config, testbed.inputs, testbed.oracles.numerical (digests). Never devices, backends,
experiments, the report, the lab or the CLI (tests/test_layering.py).
"""
