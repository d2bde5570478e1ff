#!/usr/bin/env python3
"""PyTorch's f32 matmul on the shapes `cargo run --release -p features --example bf16_gemm` times
(a SmolLM2-135M forward pass's frozen products, 2048 rows): GFLOP/s of x Wᵀ (forward) and g W
(the backward's product), best of 3, on --threads threads. Run with the bench venv's python:
`.venv-bench/bin/python scripts/bench_matmul_torch.py` — beside the example's candle column it
says whether a training-step gap to PyTorch is its matmul or the rest."""
import argparse
import time

import torch


def best(f, reps=3):
    f()
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        t = min(t, time.perf_counter() - t0)
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = a.rows
    print(f"torch {torch.__version__}, {a.threads} threads, {m} rows")
    print(f"{'n × k':>14} {'x Wᵀ GFLOP/s':>14} {'g W GFLOP/s':>13}")
    for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]:
        x, w, g = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
        flop = 2.0 * m * n * k
        fwd = best(lambda: x @ w.t())
        bwd = best(lambda: g @ w)
        print(f"{n:>6} × {k:<5} {flop / fwd / 1e9:>14.1f} {flop / bwd / 1e9:>13.1f}")


if __name__ == "__main__":
    main()
