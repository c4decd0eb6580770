"""llamacpp backend."""
