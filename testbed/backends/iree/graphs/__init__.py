"""Graphs in jax.numpy for export to StableHLO and compilation with IREE: the same math as refimpl/,
written so that every shape is static and loops are lax control flow (one compiled body, not an
unrolled copy per token)."""
