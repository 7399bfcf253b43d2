"""raypack pipeline."""
