"""parallelisms: AC policies, compile, float8 conversion, plan checks, and DDP / FSDP2 / HSDP on 2 gloo ranks.

2-process runs go through torchrun (tests/dist/train_worker.py) with a timeout, so a hang fails the test; they
inherit conftest's TORCHINDUCTOR_CACHE_DIR.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nsa_models import Transformer, get_flavor  # noqa: E402
from parallelisms import apply_ac, apply_compile, apply_float8, check_plan, compile_counters, resolve_compile_mode  # noqa: E402
from parallelisms.config import ActivationCheckpointConfig, CompileConfig, Float8Config, ParallelismConfig, PlanError  # noqa: E402
from tests.dist.train_worker import build_model, global_batches, train_losses  # noqa: E402
from tests.helpers import needs_flash_attn_4  # noqa: E402

SELECT_BLOCKS = torch.ops.nsa.select_blocks.default


def run_torchrun(tmp_path: Path, steps: int, plans: list[str], timeout: int) -> dict[str, list[list[float]]]:
    out = tmp_path / "losses.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tests/dist/train_worker.py"), str(out), str(steps), *plans]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def assert_histories_close(got: list[list[float]], want: list[list[float]], rtol: float) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=rtol, atol=0)


# --- data parallel on 2 ranks ----------------------------------------------------------------------------------

DP_PLANS = ["ddp", "fsdp", "hsdp_2x1", "hsdp_1x2"]


@pytest.fixture(scope="module")
def dp_histories(tmp_path_factory) -> dict[str, list[list[float]]]:
    return run_torchrun(tmp_path_factory.mktemp("dp"), 10, DP_PLANS, timeout=180)


@pytest.fixture(scope="module")
def single_process_history() -> list[list[float]]:
    return train_losses(build_model(), 10)


@pytest.mark.parametrize("plan", DP_PLANS)
def test_data_parallel_matches_single_process(plan, dp_histories, single_process_history):
    assert_histories_close(dp_histories[plan], single_process_history, rtol=1e-5)


def test_fsdp_mixed_precision_leaves_the_rope_table_fp32(tmp_path):
    """FSDP2's bf16 parameters (`apply_fsdp`) must not reach the blocks' other inputs: the fp32 cos / sin table
    every block takes would otherwise arrive rounded to bf16 (FSDP2 casts floating forward inputs by default), a
    rotation that DDP and one process do not round."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from parallelisms.data_parallel import apply_fsdp

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = Transformer(get_flavor("debug"))
        apply_fsdp(model, init_device_mesh("cpu", (1,)), param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                   reshard_after_forward=False)
        seen = []
        for block in model.layers.values():
            block.attention.register_forward_pre_hook(lambda _, args: seen.append(args[1]))
        model(torch.randint(0, model.args.vocab_size, (1, 64)))
    finally:
        dist.destroy_process_group()
    assert len(seen) == len(model.layers)
    for rope in seen:
        assert rope.dtype == torch.float32 and torch.equal(rope, model.rope)


COMPILED_DDP_PLANS = ["ddp_full_ac_compile", "ddp_compile_model"]


@pytest.fixture(scope="module")
def compiled_ddp_histories(tmp_path_factory) -> dict[str, list[list[float]]]:
    return run_torchrun(tmp_path_factory.mktemp("compiled_ddp"), 3, COMPILED_DDP_PLANS, timeout=360)


@pytest.mark.parametrize("plan", COMPILED_DDP_PLANS)
def test_compiled_ddp_trains(plan, compiled_ddp_histories, single_process_history):
    assert_histories_close(compiled_ddp_histories[plan], single_process_history[:3], rtol=1e-4)


# --- activation checkpointing ----------------------------------------------------------------------------------

class CountOp(TorchDispatchMode):
    """Counts calls of one op that reach the dispatcher (a value served from a checkpoint's cache does not)."""

    def __init__(self, op):
        super().__init__()
        self.op, self.calls = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is self.op
        return func(*args, **(kwargs or {}))


def loss_grads_and_backward_selections(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    window = global_batches(1, model.args.vocab_size)[0]
    loss = F.cross_entropy(model(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())
    with CountOp(SELECT_BLOCKS) as counter:
        loss.backward()
    # state_dict-style names: checkpoint_wrapper's prefix removed, so the grads line up with the plain model's.
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}
    return loss.detach(), grads, counter.calls


@pytest.fixture(scope="module")
def no_ac_result():
    return loss_grads_and_backward_selections(build_model())


@pytest.mark.parametrize("cfg", [
    ActivationCheckpointConfig(mode="full"),
    ActivationCheckpointConfig(mode="every_n", every_n=1),
    ActivationCheckpointConfig(mode="every_n", every_n=2),
    ActivationCheckpointConfig(mode="selective_op"),
], ids=["full", "every_1", "every_2", "selective_op"])
def test_ac_policy_matches_no_ac_and_never_reselects(cfg, no_ac_result):
    model = build_model()
    apply_ac(model, cfg)
    wrapped = [name for name, block in model.layers.named_children() if isinstance(block, CheckpointWrapper)]
    assert wrapped == (["1"] if cfg.mode == "every_n" and cfg.every_n == 2 else ["0", "1"])
    loss, grads, selections_in_backward = loss_grads_and_backward_selections(model)
    want_loss, want_grads, _ = no_ac_result
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], msg=lambda m, name=name: f"{name}: {m}")
    assert selections_in_backward == 0


def test_plain_checkpoint_would_reselect():
    """The control for the test above: without the policy, backward recomputes the selection in every block."""
    model = build_model()
    for name, block in model.layers.named_children():
        model.layers.register_module(name, checkpoint_wrapper(block))
    assert loss_grads_and_backward_selections(model)[2] == model.args.n_layers


# --- compile ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scope", ["block", "model"])
def test_compile_matches_eager_without_graph_breaks(scope, single_process_history):
    model = build_model()
    apply_compile(model, CompileConfig(enable=True, scope=scope, fullgraph=True))
    before = compile_counters()
    history = train_losses(model, 3)
    after = compile_counters()
    assert after["graphs_compiled"] > before["graphs_compiled"]  # it really compiled
    assert after["graph_breaks"] == before["graph_breaks"]
    assert_histories_close(history, single_process_history[:3], rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("window_backend", ["flex", "flash_attn_4"])
@pytest.mark.parametrize("mode, scope", [("full", "block"), ("selective_op", "block"), ("full", "model")])
def test_window_in_checkpointed_compiled_model(mode, scope, window_backend):
    """The triton backend's library windows inside checkpointed compiled blocks (FlexAttention's block mask is built
    once per forward, outside them; FA4 runs bf16, so under autocast): no graph break, no recompile on later steps,
    the eager model's loss and grads."""
    args = get_flavor("debug")
    args.nsa.backend, args.nsa.window_backend = "triton", window_backend
    bf16 = window_backend == "flash_attn_4"
    if bf16:
        needs_flash_attn_4()
        args.head_dim = 64  # a head size FA4 compiles for
    tokens = torch.randint(0, args.vocab_size, (2, 257), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(0))

    def build() -> Transformer:
        torch.manual_seed(0)
        model = Transformer(args).cuda()
        model.init_weights()
        return model

    def loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        # Names as the plain model's: the checkpoint wrapper's and torch.compile's prefixes removed.
        return loss.detach(), {name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""):
                               p.grad.clone() for name, p in model.named_parameters()}

    want_loss, want_grads = loss_and_grads(build())
    model = build()
    apply_ac(model, ActivationCheckpointConfig(mode=mode))
    apply_compile(model, CompileConfig(enable=True, scope=scope, fullgraph=True))
    before = compile_counters()
    loss, grads = loss_and_grads(model)
    loss_and_grads(model)
    compiled = compile_counters()  # read after step 2, as the trainer does
    for _ in range(2):
        loss_and_grads(model)
    after = compile_counters()
    assert after["graph_breaks"] == before["graph_breaks"], (before, after)
    assert after["graphs_compiled"] == compiled["graphs_compiled"], (compiled, after)  # no recompile
    # bf16: compiled and eager round the autocast products and their fused neighbours differently
    torch.testing.assert_close(loss, want_loss, rtol=2e-3 if bf16 else 1e-4, atol=0)
    assert grads.keys() == want_grads.keys()
    # All gradients as one vector, as test_triton_gpu's compile test: compiled rounding may flip a near-tied
    # selection for a few queries, which moves a few small gradients (e.g. the compressed keys' bias, zero in
    # exact arithmetic) by much more than rounding.
    got, want = (torch.cat([g[name].flatten() for name in want_grads]) for g in (grads, want_grads))
    # Measured on an H200: fp32 (flex) 3e-7; bf16 (FA4) 1.3e-2 to 2.6e-2, the loss within 1.4e-4.
    assert ((got - want).norm() / want.norm()).item() <= (5e-2 if bf16 else 1e-2)


# --- float8 ----------------------------------------------------------------------------------------------------

def float8_candidate() -> Transformer:
    """Debug NSA model whose gate (48 outputs), compression MLPs and head have float8-compatible sizes, so only
    the name rules can keep them out."""
    args = get_flavor("debug")
    args.n_heads, args.n_kv_heads, args.head_dim, args.vocab_size = 16, 4, 16, 256
    with torch.device("meta"):
        return Transformer(args)


def float8_linears(model: nn.Module) -> set[str]:
    from torchao.float8.float8_linear import Float8Linear

    return {name for name, module in model.named_modules() if isinstance(module, Float8Linear)}


@pytest.mark.parametrize("min_features, kinds", [
    (16, {"attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
          "feed_forward.w3"}),
    (128, {"attention.wq", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"}),
])
def test_float8_converts_large_linears_only(min_features, kinds):
    model = float8_candidate()
    apply_float8(model, Float8Config(enable=True, min_features=min_features))
    assert float8_linears(model) == {f"layers.{i}.{kind}" for i in range(model.args.n_layers) for kind in kinds}


def test_float8_that_converts_nothing_is_an_error():
    with pytest.raises(PlanError, match="float8.min_features = 100000: no linear layer"):
        apply_float8(float8_candidate(), Float8Config(enable=True, min_features=100000))


def test_float8_rowwise_recipe():
    from torchao.float8.config import ScalingGranularity

    model = float8_candidate()
    apply_float8(model, Float8Config(enable=True, recipe="rowwise", min_features=16))
    linear = model.layers["0"].feed_forward.w1
    assert linear.config.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE


# --- check_plan ------------------------------------------------------------------------------------------------

def plan(world_size=2, device_type="cpu", gpu_capability=None, **sections):
    return dict(parallelism=sections.get("parallelism", ParallelismConfig()),
                ac=sections.get("ac", ActivationCheckpointConfig()), compile=sections.get("compile", CompileConfig()),
                float8=sections.get("float8", Float8Config()), world_size=world_size, device_type=device_type,
                gpu_capability=gpu_capability)


@pytest.mark.parametrize("kwargs, key", [
    (plan(world_size=4, parallelism=ParallelismConfig(data_parallel="hsdp", dp_replicate=3)),
     "parallelism.dp_replicate"),
    (plan(world_size=4, parallelism=ParallelismConfig(data_parallel="hsdp", dp_replicate=1)),
     "parallelism.dp_replicate"),
    (plan(float8=Float8Config(enable=True)), "float8.enable"),
    (plan(device_type="cuda", gpu_capability=(8, 0), float8=Float8Config(enable=True)), "float8.enable"),
    (plan(device_type="cuda", gpu_capability=(9, 0), compile=CompileConfig(enable=True, mode="max-autotune")),
     "compile.mode"),
    (plan(parallelism=ParallelismConfig(data_parallel="hsdp", dp_replicate=2), world_size=8,
          compile=CompileConfig(enable=True, mode="max-autotune")), "compile.mode"),
    (plan(compile=CompileConfig(enable=True, scope="model")), "compile.scope"),
    (plan(device_type="cuda", gpu_capability=(9, 0), compile=CompileConfig(enable=True, mode="reduce-overhead")),
     "compile.mode"),  # CUDA graphs under FSDP2
    (plan(world_size=1, compile=CompileConfig(enable=True, mode="reduce-overhead")), "compile.mode"),  # on CPU
    (plan(parallelism=ParallelismConfig(dist_backend="nccl")), "parallelism.dist_backend"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_check_plan_rejects(kwargs, key):
    with pytest.raises(PlanError, match=key.replace(".", r"\.")) as error:
        check_plan(**kwargs)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("kwargs", [
    plan(world_size=1, parallelism=ParallelismConfig(data_parallel="hsdp", dp_replicate=1),
         compile=CompileConfig(enable=True, scope="model")),  # parallelism is ignored with one process
    plan(world_size=8, parallelism=ParallelismConfig(data_parallel="hsdp", dp_replicate=2),
         ac=ActivationCheckpointConfig(mode="selective_op"), compile=CompileConfig(enable=True)),
    plan(parallelism=ParallelismConfig(data_parallel="ddp"), device_type="cuda", gpu_capability=(9, 0),
         compile=CompileConfig(enable=True, scope="model", mode="max-autotune")),
    plan(world_size=1, device_type="cuda", gpu_capability=(9, 0),
         compile=CompileConfig(enable=True, mode="reduce-overhead")),
    plan(device_type="cuda", gpu_capability=(8, 9), float8=Float8Config(enable=True)),
    # One process per node: a 2 x 1 mesh (replicated across nodes, shard groups of one), as in the 2-node test.
    plan(world_size=2, parallelism=ParallelismConfig(data_parallel="hsdp", dp_replicate=2)),
])
def test_check_plan_accepts(kwargs):
    check_plan(**kwargs)


@pytest.mark.parametrize("device_type, data_parallel, world_size, mode, want", [
    ("cuda", "fsdp", 1, "auto", "reduce-overhead"),  # one process: no data parallelism applied
    ("cuda", "ddp", 2, "auto", "reduce-overhead"),
    ("cuda", "fsdp", 2, "auto", "default"),  # FSDP2's all-gathers: no CUDA graphs
    ("cuda", "hsdp", 4, "auto", "default"),
    ("cpu", "ddp", 1, "auto", "default"),
    ("cuda", "ddp", 2, "default", "default"),  # a recipe's explicit mode stays
    ("cpu", "ddp", 1, "max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs"),
])
def test_auto_compile_mode_uses_cuda_graphs_where_the_plan_allows(device_type, data_parallel, world_size, mode,
                                                                   want):
    resolved = resolve_compile_mode(CompileConfig(enable=True, mode=mode), device_type=device_type,
                                    data_parallel=data_parallel, world_size=world_size)
    assert resolved.mode == want
    parallelism = ParallelismConfig(data_parallel=data_parallel, dp_replicate=2 if data_parallel == "hsdp" else 1)
    check_plan(parallelism, ActivationCheckpointConfig(), resolved, Float8Config(), world_size=world_size,
               device_type=device_type, gpu_capability=(9, 0))  # what it resolves to is a valid plan


def test_model_package_does_not_import_parallelisms():
    imports = re.compile(r"^\s*(from|import)\s+parallelisms\b", re.MULTILINE)
    offenders = [p.name for p in (REPO / "nsa_models").rglob("*.py") if imports.search(p.read_text())]
    assert offenders == []
