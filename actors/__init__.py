"""raypack actors."""
