"""The native backend: the C kernels and the model engine of kernels/, built per target and run on a
device (engine.py: the model engine)."""
