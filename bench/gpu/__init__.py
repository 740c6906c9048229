"""Benchmarks and checks for a GPU machine, run from the repository root as modules (`python3 -m bench.gpu.parity`,
`bash gpu_machine/run_checks.sh` runs them); bench/gpu/README.md has their commands."""
