"""Benchmark harnesses run by `cargo xtask bench` with the venv's Python (see vllm_sweep.py)."""
