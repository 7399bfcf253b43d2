"""The offline job's driver: check, build and run it; placement groups, live progress, dry run."""
