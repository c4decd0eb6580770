"""native backend."""
