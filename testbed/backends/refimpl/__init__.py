"""refimpl backend."""
