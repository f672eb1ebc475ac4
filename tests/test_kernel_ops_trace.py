"""Compiled, the NSA triton_ops (`triton_common.kernel_op`) become kernel launches that inductor runs itself, and each
launch writes only buffers its op allocated. Inductor decides what a user kernel writes by analysing its Triton IR;
every tensor it counts as written and still needed is copied before each launch (a copy of q per sweep call, and
its launch, before the sweep's tiles stopped reading q inside the call that addresses their stores). Checked on the
CPU: the triton backend's forward and backward, traced as torch.compile traces them (functionalized, fake tensors),
with Triton's analysis run for a Hopper target, in a process of its own (the kernels must be JIT functions, not the
interpreter's)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend builds the kernels' IR")

REPO = Path(__file__).resolve().parents[1]

TRACE = """
import sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.functional_tensor import dispatch_functionalize
from torch.fx.experimental.proxy_tensor import make_fx


class Hopper:  # what inductor's analysis asks of Triton's driver, on a machine without a GPU
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


triton.runtime.driver.set_active(Hopper())
from nsa_models.args import NSAArgs
from nsa_models.nsa.triton_backend import nsa_triton

ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default}
for D in (64, 128):  # pointer loads; device-side TMA descriptors
    for documents in (False, True):
        T, H, G = 256, 2, 3
        args = NSAArgs(sel_block_size=64, n_selected=2, window_size=64, backend="triton",
                       window_backend="fused_with_selected")
        q = torch.randn(1, T, H * G, D, dtype=torch.bfloat16)
        k, v = torch.randn(1, T, H, D, dtype=torch.bfloat16), torch.randn(1, T, H, D, dtype=torch.bfloat16)
        k_cmp = torch.randn(1, args.num_cmp_blocks(T), H, D, dtype=torch.bfloat16)
        gates = torch.rand(1, T, H * G, 3)
        doc = (torch.arange(T, dtype=torch.int32) // 128 * 128)[None] if documents else None

        def step(q, k, v, k_cmp, gates, doc):
            out = nsa_triton(q, k, v, k, v, k_cmp, k_cmp, gates, args, doc_start=doc)[0]
            return torch.autograd.grad(out.float().sum(), (q, k, v, k_cmp))

        leaves = [x.requires_grad_() for x in (q, k, v, k_cmp)]
        graph = make_fx(dispatch_functionalize(step), tracing_mode="fake")(*leaves, gates, doc).graph
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            if str(node.target).startswith("nsa."):
                print(f"D={D} documents={documents}: {node.target} stayed opaque")
            if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
                kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__
                tensors = node.kwargs["kwargs"]
                print(f"D={D} documents={documents} {kernel}:", *(
                    f"{name}({'allocated' if tensors[name].target in ALLOCATIONS else tensors[name].target})"
                    for name in node.kwargs["tensors_to_clone"]))
"""


def test_compiled_kernels_write_only_their_own_outputs():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # JIT functions, not the interpreter's
    done = subprocess.run([sys.executable, "-c", TRACE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    launches = done.stdout.splitlines()
    assert not [line for line in launches if "opaque" in line], launches
    kernels = {line.split(":")[0].split()[-1] for line in launches}
    # Every kernel of the compressed branch, the selection and the sweep, launched by inductor in each case.
    assert kernels >= {"_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel", "_select_kernel"}, launches
    assert len(launches) == 4 * 7, launches  # 4 cases x (compressed 3, selection 1, sweep 3)
    written = [name for line in launches for name in line.split(":")[1].split()]
    assert written and all(name.endswith("(allocated)") for name in written), launches
