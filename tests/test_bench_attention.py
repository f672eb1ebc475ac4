"""bench/attention.py's occupancy arithmetic, on CPU: the CUDA occupancy calculator's counts for an H100 / H200 SM."""

from __future__ import annotations

import pytest

from bench.attention import programs_per_sm

HOPPER_SM = {"threads": 2048, "registers": 65536, "shared": 233472}


@pytest.mark.parametrize("warps, registers, shared_kib, expected", [
    (2, 168, 38, (5, "shared memory")),  # 40 KiB with the reserve: 5 fit in 228 KiB; registers would allow 6
    (4, 128, 36, (4, "registers")),  # 16K registers per program
    (2, 204, 0, (4, "registers")),  # 204 x 32 = 6528 rounds up to 6656 per warp: 4 programs, not 5
    (8, 24, 0, (8, "threads")),
    (1, 16, 0, (32, "programs")),  # threads alone would allow 64
])
def test_programs_per_sm_counts_the_limiting_resource(warps, registers, shared_kib, expected):
    assert programs_per_sm(warps, registers, shared_kib * 1024, HOPPER_SM) == expected
