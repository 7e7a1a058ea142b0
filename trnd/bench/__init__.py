"""Benchmarks behind docs/RESULTS.md. Every table names the CPU it ran on: figures from two CPU classes
(AVX-512 with bf16 vs AVX2 + FMA only) are not comparable."""

import os


def cpu_line() -> str:
    """The CPU, its relevant flags and ISA level, printed beside every benchmark's figures."""
    from trnd_kernels.cpuinfo import cpu_info

    return f"cpu: {cpu_info().summary()}; {os.cpu_count()} cores"
