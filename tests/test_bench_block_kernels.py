"""bench/block_kernels.py: the launches it reads from inductor's generated code, on a hand-made module whose
answers are known and on a compiled NSA block."""

from __future__ import annotations

import os

import pytest
import torch

from bench.block_kernels import block_kernels, graph_kernels, table

# The shape of inductor's GPU wrapper: Triton kernels launched by `.run(`, extern and custom-op calls, and lines
# that launch nothing (allocations, a helper's definition before `call`).
GPU_MODULE = '''
def helper(x):
    triton_poi_fused_decoy_9.run(x)
def call(args):
    buf0 = empty_strided_cuda((4, 4), (4, 1), torch.bfloat16)
    triton_poi_fused__to_copy_0.run(arg0_1, buf0, 16, stream=stream0)
    extern_kernels.mm(buf0, arg1_1, out=buf1)
    buf2 = torch.ops.nsa.select_topn.default(buf1, arg2_1)
    triton_per_fused_sum_1.run(buf2, buf3, 4, 4, stream=stream0)
    return (buf3, )
'''


def test_graph_kernels_counts_the_launches_of_call_only():
    fused, extern = graph_kernels(GPU_MODULE)
    assert fused == ["triton_poi_fused__to_copy_0", "triton_per_fused_sum_1"]
    assert extern == ["extern_kernels.mm", "torch.ops.nsa.select_topn.default"]
    assert "| nsa | 2 / 2 | 2 / 2 | 8 |" in table({"nsa": [(fused, extern), (fused, extern)]})


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU block runs NSA's kernels interpreted")
def test_compiled_nsa_block_launches_its_ops_once_per_direction():
    """The debug flavor's block on the CPU (Triton interpreter): a forward and a backward graph, each with NSA's
    custom ops called once, and the glue around them as fused kernels."""
    (fwd_fused, fwd_extern), (bwd_fused, bwd_extern) = block_kernels("debug", 64, torch.device("cpu"),
                                                                     "fused_with_selected")
    for op in ("compressed_attention_fwd", "select_topn", "selected_window_fwd"):
        assert fwd_extern.count(f"torch.ops.nsa.{op}.default") == 1, (op, fwd_extern)
    for op in ("compressed_attention_bwd", "selected_window_bwd"):
        assert bwd_extern.count(f"torch.ops.nsa.{op}.default") == 1, (op, bwd_extern)
    assert fwd_fused and bwd_fused and all(name.startswith("cpp_fused_") for name in fwd_fused + bwd_fused)
