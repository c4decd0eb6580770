"""iree backend."""
