"""raypack in a user's own Ray Data program: build_processor, its config, Ray Data LLM's shape."""
