# SPDX-License-Identifier: Apache-2.0
"""How fast this machine multiplies matrices in fp32 and in bf16 (one process, no DeepSpeed).

    python benchmarks/cpu_matmul.py

Autocast step times in the benchmark tables depend on it: on a CPU without native bf16 (AVX512-BF16 or AMX) torch
emulates bf16 matmuls, many times slower than fp32, and every autocast row, eager ones included, slows down alike.
"""
import time

import torch


def matmul_seconds(dtype: torch.dtype, m: int = 512, k: int = 1024, n: int = 1024, repeats: int = 10) -> float:
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return (time.perf_counter() - start) / repeats


if __name__ == "__main__":
    fp32, bf16 = matmul_seconds(torch.float32), matmul_seconds(torch.bfloat16)
    print(f"512x1024 @ 1024x1024: fp32 {fp32:.4f} s, bf16 {bf16:.4f} s ({bf16 / fp32:.1f}x)")
