"""Benchmarks of the library, run from the repository root as modules: `.venv/bin/python -m bench.bench_train`;
bench/gpu holds the GPU machine's benchmarks and checks (bench/gpu/README.md)."""
