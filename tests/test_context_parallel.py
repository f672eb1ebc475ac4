"""Context parallelism (parallelisms/context_parallel.py, ParallelDims): the layout and its checks, the reference
NSA's query offset, and 2-rank CP training of the debug model at T = 1024 against one process (gloo, torchrun with a
timeout: a hang fails the test)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nsa_models import Transformer, get_flavor  # noqa: E402
from nsa_models.args import NSAArgs  # noqa: E402
from nsa_models.nsa.reference import nsa_reference  # noqa: E402
from nsa_training.config import ConfigError, load_config  # noqa: E402
from nsa_training.exit_codes import BAD_INPUT_EXIT_CODE  # noqa: E402
from nsa_training.launch import check_world_size  # noqa: E402
from nsa_training.launch import main as launch  # noqa: E402
from parallelisms import ParallelDims, check_plan  # noqa: E402
from parallelisms.config import (  # noqa: E402
    ActivationCheckpointConfig,
    CompileConfig,
    Float8Config,
    ParallelismConfig,
    PlanError,
)
from tests.dist.cp_worker import CONTROLS, build_model, train  # noqa: E402
from tests.helpers import env, event_files, scalars  # noqa: E402

RECIPE = str(REPO / "recipes/debug.toml")
CP2 = ["--parallelism.context_parallel_degree", "2"]

# --- the layout --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("data_parallel, dp_replicate, world_size, cp, want", [
    ("fsdp", 1, 8, 2, (1, 4, 2)),
    ("ddp", 1, 8, 2, (4, 1, 2)),
    ("hsdp", 2, 8, 2, (2, 2, 2)),
    ("fsdp", 1, 2, 2, (1, 1, 2)),  # every rank in one CP group: one data-parallel rank
    ("hsdp", 2, 1, 1, (1, 1, 1)),  # one process: the data-parallel keys are ignored
])
def test_parallel_dims_layout(data_parallel, dp_replicate, world_size, cp, want):
    cfg = ParallelismConfig(data_parallel=data_parallel, dp_replicate=dp_replicate, context_parallel_degree=cp)
    dims = ParallelDims.from_config(cfg, world_size)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp) == want
    assert dims.dp_size == world_size // cp
    assert (dims.dp_rank, dims.cp_rank, dims.groups()) == (0, 0, [])  # no mesh before build_mesh


def test_parallel_dims_validates_at_construction():
    with pytest.raises(PlanError, match="must be the world size"):
        ParallelDims(dp_replicate=2, dp_shard=2, cp=2, world_size=6)


@pytest.mark.parametrize("world_size, parallelism, key", [
    (3, ParallelismConfig(context_parallel_degree=2), "parallelism.context_parallel_degree = 2 must divide the world "
                                                      "size (3)"),
    (1, ParallelismConfig(context_parallel_degree=2), "parallelism.context_parallel_degree = 2 must divide the world "
                                                      "size (1)"),
    (4, ParallelismConfig(data_parallel="hsdp", dp_replicate=4, context_parallel_degree=2),
     "parallelism.dp_replicate = 4 must divide the data-parallel ranks"),
])
def test_check_plan_rejects_degrees_that_do_not_fit(world_size, parallelism, key):
    with pytest.raises(PlanError) as error:
        check_plan(parallelism, ActivationCheckpointConfig(), CompileConfig(), Float8Config(), world_size=world_size,
                   device_type="cpu", gpu_capability=None)
    assert key in str(error.value) and "\n" not in str(error.value)


# --- bad input: one `error:` line, exit status 2 ------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--data.seq_len", "96"], "data.seq_len = 96 does not split into 2 x parallelism.context_parallel_degree = 4 "
                               "chunks of whole selection blocks (model.nsa.sel_block_size = 16): make it a multiple "
                               "of 64"),
    # the triton backend runs CP with the kernels that take a query offset; the others are named with the fix
    (["--model.nsa.backend", "triton", "--model.nsa.window_backend", "flash_attn"],
     "parallelism.context_parallel_degree = 2: model.nsa.window_backend = 'flash_attn' takes no query offset (queries "
     "that start mid-sequence, as context parallelism's): set it to 'flex' or 'sdpa', or context_parallel_degree = 1"),
    (["--model.nsa.backend", "triton", "--model.nsa.window_backend", "fused_with_selected"],
     "model.nsa.window_backend = 'fused_with_selected' takes no query offset"),
    (["--model.nsa.backend", "triton", "--model.nsa.cmp_backend", "flash_attn_4"],
     "model.nsa.cmp_backend = 'flash_attn_4' takes no query offset"),
    (["--model.flavor", "dense-debug"], "needs NSA attention"),
    (["--data.document_mask", "true"], "with data.document_mask = true is not implemented"),
    (["--passkey.enable", "true"], "with passkey.enable = true"),
])
def test_unsupported_cp_recipe_is_one_config_error(argv, message):
    with pytest.raises(ConfigError) as error:
        load_config([RECIPE, *CP2, *argv])
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("nproc, argv, message", [
    ("3", CP2, "error: parallelism.context_parallel_degree = 2 must divide the world size (3)"),
    ("4", [*CP2, "--parallelism.data_parallel", "hsdp", "--parallelism.dp_replicate", "4"],
     "error: parallelism.dp_replicate = 4 must divide the data-parallel ranks"),
    ("2", [*CP2, "--model.nsa.backend", "triton", "--model.nsa.window_backend", "flash_attn_4"],
     "error: parallelism.context_parallel_degree = 2: model.nsa.window_backend = 'flash_attn_4' takes no query "
     "offset"),
])
def test_launcher_refuses_before_any_process_starts(monkeypatch, capsys, nproc, argv, message):
    monkeypatch.setenv("NGPU", nproc)
    assert launch([RECIPE, *argv]) == BAD_INPUT_EXIT_CODE
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_one_process_with_cp_is_refused_by_the_trainer(tmp_path):
    """A plain `python train.py` (no launcher) checks the degree against its one process."""
    proc = subprocess.run([sys.executable, "train.py", RECIPE, *CP2, "--job.run_dir", str(tmp_path / "run")],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == BAD_INPUT_EXIT_CODE
    assert proc.stderr.startswith("error: parallelism.context_parallel_degree = 2 must divide the world size (1)")
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "run").exists()


def test_gradient_accumulation_counts_data_parallel_ranks():
    """2 ranks as one CP group are one data-parallel rank: 2048 tokens a step are one micro-batch of 8 x 256, where
    2 data-parallel ranks would need 4096."""
    argv = [RECIPE, "--training.global_batch_tokens", "2048"]
    check_world_size(load_config([*argv, *CP2])[0], 2)
    with pytest.raises(ConfigError, match="data-parallel ranks = 4096"):
        check_world_size(load_config(argv)[0], 2)


# --- the model's seams and the reference's query offset -------------------------------------------------------------

def test_attention_seams_add_no_state_dict_keys():
    """NSACore and SequenceKV hold no parameters: checkpoints of runs before them load as they are."""
    with torch.device("meta"):
        model = Transformer(get_flavor("debug"))
    attention = {key.split("attention.", 1)[1] for key in model.state_dict() if key.startswith("layers.0.attention.")}
    compression = {f"{c}.{p}" for c in ("compress_k", "compress_v")
                   for p in ("pos_emb", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")}
    assert attention == {"wq.weight", "wk.weight", "wv.weight", "wo.weight", "gate.weight", "gate.bias", *compression}
    assert type(model.layers["0"].attention.core).__name__ == "NSACore"


def test_reference_queries_at_an_offset_are_the_whole_sequence_ones():
    """Queries q_start .. q_start+C-1 against the whole sequence's keys give that slice of the whole forward: the
    compressed and window masks, the top-n candidates and the forced blocks all follow the global positions."""
    args = NSAArgs(cmp_block_size=16, cmp_stride=8, sel_block_size=16, n_selected=4, window_size=32, query_chunk=48)
    B, T, H, G, D = 2, 256, 2, 2, 8
    generator = torch.Generator().manual_seed(0)
    shapes = [(B, T, H * G, D)] + [(B, T, H, D)] * 4 + [(B, args.num_cmp_blocks(T), H, D)] * 2
    q, *kv = [torch.randn(s, dtype=torch.float64, generator=generator) * (3.0 if i == 0 else 1.0)
              for i, s in enumerate(shapes)]
    gates = torch.rand(B, T, H * G, 3, dtype=torch.float64, generator=generator)
    out, idx, entropy = nsa_reference(q, *kv, gates, args)
    for start, end in ((0, 64), (64, 128), (192, 256)):
        part = nsa_reference(q[:, start:end], *kv, gates[:, start:end], args, q_start=start)
        torch.testing.assert_close(part[0], out[:, start:end], rtol=1e-12, atol=1e-12)
        assert torch.equal(part[1], idx[:, :, start:end])
        torch.testing.assert_close(part[2], entropy[:, start:end], rtol=1e-12, atol=1e-12)
    shifted = nsa_reference(q[:, 192:], *kv, gates[:, 192:], args)  # the control: no offset, other outputs
    assert not torch.allclose(shifted[0], out[:, 192:])


# --- 2 ranks as one CP group vs one process --------------------------------------------------------------------------

STEPS = 20
SHORT_STEPS = 3  # the plans that compose CP with AC and compile, and the controls


def run_cp_worker(out: Path, steps: int, plans: list[str], timeout: int) -> tuple[dict, dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tests/dist/cp_worker.py"), str(out), str(steps), *plans]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(Path(f"{out}.json").read_text()), torch.load(f"{out}.pt")


@pytest.fixture(scope="module")
def single_process() -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    return train(build_model(), STEPS)


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory) -> tuple[dict, dict]:
    return run_cp_worker(tmp_path_factory.mktemp("cp") / "out", STEPS, ["fsdp", "ddp"], timeout=480)


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory) -> tuple[dict, dict]:
    plans = ["fsdp_full_ac", "fsdp_compile", *(f"fsdp_{name}" for name in CONTROLS)]
    return run_cp_worker(tmp_path_factory.mktemp("cp_short") / "out", SHORT_STEPS, plans, timeout=360)


def relative_errors(got: list[list[float]], want: list[list[float]]) -> torch.Tensor:
    got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    return (got - want).abs() / want.abs()


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["fsdp", "ddp"])
def test_cp_losses_match_single_process(plan, cp_runs, single_process):
    """20 steps of [loss, grad norm] (the grad norm catches a gradient scaled by the CP degree, which AdamW's
    update would hide from the losses)."""
    assert relative_errors(cp_runs[0][plan], single_process[0]).max() <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["fsdp", "ddp"])
def test_cp_gradients_match_single_process(plan, cp_runs, single_process):
    """Every parameter's step-1 gradient within 1e-5 of the one-process gradient's norm. The floor of 1e-10 x the
    whole gradient's norm is for compress_k.fc2.bias, whose exact gradient is zero (adding one vector to every
    compressed key shifts each query's compressed scores by a constant): it is rounding noise of ~1e-12 there."""
    got, want = cp_runs[1][plan], single_process[1]
    assert got.keys() == want.keys()
    total = torch.cat([g.flatten() for g in want.values()]).norm()
    for name, grad in want.items():
        error = (got[name] - grad).norm()
        assert error <= 1e-5 * grad.norm() + 1e-10 * total, f"{name}: {error / grad.norm():.3g} relative"


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["fsdp_full_ac", "fsdp_compile"])
def test_cp_composes_with_ac_and_compile(plan, short_runs, single_process):
    """The all-gather inside checkpointed blocks (recomputed in backward) and inside compiled blocks."""
    assert relative_errors(short_runs[0][plan], single_process[0][:SHORT_STEPS]).max() <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("control", list(CONTROLS))
def test_cp_without_global_positions_differs(control, short_runs, single_process):
    """The controls: CP with the shard's RoPE positions, or its queries' positions in the NSA core, left local
    gives other losses and gradients: the tests above see both offsets."""
    assert relative_errors(short_runs[0][f"fsdp_{control}"], single_process[0][:SHORT_STEPS]).max() > 1e-3
    got, want = (torch.cat([g[name].flatten() for name in single_process[1]])
                 for g in (short_runs[1][f"fsdp_{control}"], single_process[1]))
    assert (got - want).norm() > 1e-3 * want.norm()


@pytest.mark.slow
def test_trainer_with_cp_matches_one_process(tmp_path):
    """The whole trainer through the launcher: both ranks of the CP group read the one data-parallel rank's batch,
    shard it, and log the one-process losses (train and eval) and throughput over the same global batch."""
    common = [RECIPE, "--data.source", "synthetic", "--training.steps", "4", "--training.global_batch_tokens", "2048",
              "--training.micro_batch_size", "4", "--training.eval_interval", "2", "--checkpoint.enable", "false",
              "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2"]
    runs = {"single": ([sys.executable, "train.py"], {}),
            "cp": ([sys.executable, "-m", "nsa_training.launch"], {"NGPU": "2"})}
    logged = {}
    for name, (command, extra_env) in runs.items():
        extra = CP2 if name == "cp" else []
        proc = subprocess.run([*command, *common, *extra, "--job.run_dir", str(tmp_path / name)], cwd=REPO,
                              env={**env(), **extra_env}, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        logged[name] = scalars(event_files(tmp_path / name)[-1])
    assert "(1 data-parallel x 2 context-parallel)" in proc.stdout
    for tag in ("train/loss", "eval/loss", "train/grad_norm"):
        got, want = logged["cp"][tag], logged["single"][tag]
        assert got.keys() == want.keys() and all(abs(got[s] - want[s]) <= 1e-5 * abs(want[s]) for s in want), tag


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["fsdp", "ddp"])
def test_cp_on_two_gpus_trains_as_one_gpu(plan, tmp_path):
    """nsa-125m as users run it long (triton kernels, FlexAttention window with the chunks' masks, compiled blocks,
    bf16, NCCL) at 8k: 2 GPUs sharing each sequence log one GPU's losses over 3 steps of the same batches, within
    bf16 rounding (step 1: the same weights and batch through kernels run in two pieces; measured 5e-5 of 11.1 at
    32k), with no graph break and no recompile, and exit. Under DDP `compile.mode = auto` replays the blocks, their
    all-gathers included, as CUDA graphs (a 2-GPU DDP run at 32k once took minutes past its last step; its log was
    lost)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    common = [str(REPO / "recipes/nsa_125m.toml"), "--data.source", "synthetic", "--data.tokenizer", "byte",
              "--model.vocab_size", "50304", "--data.document_mask", "false", "--model.nsa.window_backend", "flex",
              "--model.nsa.selected_kernels", "triton", "--data.seq_len", "8192",
              "--model.max_seq_len", "8192", "--training.micro_batch_size", "1", "--training.global_batch_tokens",
              "8192", "--training.steps", "3", "--lr_scheduler.warmup_steps", "1", "--training.eval_interval", "0",
              "--checkpoint.enable", "false", "--metrics.log_freq", "1", "--parallelism.data_parallel", plan]
    runs = {"one": ([sys.executable, "train.py"], {"CUDA_VISIBLE_DEVICES": "0"}, []),
            "cp": ([sys.executable, "-m", "nsa_training.launch"], {"NGPU": "2"}, CP2)}
    losses, compiled = {}, {}
    for name, (command, extra_env, extra) in runs.items():
        proc = subprocess.run([*command, *common, *extra, "--job.run_dir", str(tmp_path / name)], cwd=REPO,
                              env={**env(), **extra_env}, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        losses[name] = scalars(event_files(tmp_path / name)[-1])["train/loss"]
        compiled[name] = re.findall(r"compile: graph_breaks (\d+), graphs_compiled (\d+)", proc.stdout)
    assert "(1 data-parallel x 2 context-parallel)" in proc.stdout
    # As many graphs as one GPU's (the block, the loss, the window mask's kernel: one for both chunks' offsets).
    assert len(compiled["one"]) == 1 and compiled["cp"] == compiled["one"], compiled
    assert compiled["one"][0][0] == "0"  # graph breaks
    assert losses["cp"].keys() == losses["one"].keys() == {1, 2, 3}
    assert abs(losses["cp"][1] - losses["one"][1]) <= 1e-3 * losses["one"][1]
    assert all(abs(losses["cp"][s] - losses["one"][s]) <= 2e-2 * losses["one"][s] for s in (2, 3)), losses


@pytest.mark.slow
def test_killed_cp_run_resumes_bitwise(tmp_path):
    """A CP run whose rank 1 is killed (SIGKILL) in step 5, started again with the same command, resumes from its
    step-4 checkpoint and logs bitwise the losses of the run that was never interrupted."""
    common = [RECIPE, "--data.source", "synthetic", "--data.seq_len", "256", "--training.steps", "6",
              "--training.global_batch_tokens", "1024", "--training.micro_batch_size", "4",
              "--training.eval_interval", "0", "--checkpoint.interval", "2", "--metrics.log_freq", "1",
              "--lr_scheduler.warmup_steps", "2", *CP2]

    def launch_run(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "nsa_training.launch", *common, "--job.run_dir", str(run_dir),
                               *extra], cwd=REPO, env={**env(), "NGPU": "2"}, capture_output=True, text=True,
                              timeout=300)

    whole = launch_run(tmp_path / "whole")
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    killed = launch_run(tmp_path / "killed", "--debug.fault_rank", "1", "--debug.die_at_step", "5")
    assert killed.returncode != 0
    resumed = launch_run(tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    want = scalars(event_files(tmp_path / "whole")[-1])["train/loss"]
    got = scalars(event_files(tmp_path / "killed")[-1])["train/loss"]
    assert sorted(got) == [5, 6], got  # the second start began from step 4's checkpoint
    assert all(got[step] == want[step] for step in got), (got, want)
