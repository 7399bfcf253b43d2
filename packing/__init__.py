"""raypack packing."""
