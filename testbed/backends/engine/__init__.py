"""backend=engine: an engine under test, judged by testbed's oracles through engine contract v1.

An engine is a program described by engines/NAME.yaml (the project's, or a lab's TESTBED_LAB/engines/):
how it is built per ABI, what it supports, how it is invoked (spec.py; the schema is
engines/contract-v1.schema.json). testbed builds it (cached by every file it reads), pushes it with the native
backend's machinery, and runs it once per request: a folder of request.json, request.args, tokens.npy
and the model file, answered by a response folder (status.json, logits.npy, state.bin, cache/,
timings.json) that runner.py pulls and validates strictly before any oracle sees it. testbed owns the
checkpoint, prompt, plan, reference, oracles and instruments; the engine owns only its computation.

  spec.load(name) -> EngineSpec                      the yaml, validated
  build.program_for(spec, target) -> Path            the program for a build target, cached by what it reads
  runner.call(device, spec, request, expect) -> Response
  keep.*                                             failing calls kept for replay (testbed engine replay)
  gemma.backend(...)                                 experiment chunk_prefill (the GemmaRunner interface)
  tail.*                                             experiment tail (state bytes, first token, TTFT; a
                                                     state restored and continued: tail.continue_from)
  state.StateFile, state.compare                     a pulled state.bin, compared in bounded memory

A refusal (status "refused") is a Response the experiments record as "not supported", never a pass; a
broken response is a ContractError (exit 4) naming the file and the value.
"""
