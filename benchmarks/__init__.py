"""raypack's benchmarks and the comparison code they need: scripts (`python
benchmarks/bench_*.py --json`), not part of the installed packages. They import the packages;
the packages never import them (tests/test_house.py checks)."""
