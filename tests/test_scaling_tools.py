"""bench/scaling.py on CPU (torchrun of 1 and 2 gloo ranks) and scripts/plot_tb.py on a run's event files."""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import env

REPO = Path(__file__).resolve().parents[1]
# 2 sequences of 64 tokens per rank per step of the debug model.
TINY = ["--set", "training.device=cpu", "--set", "data.seq_len=64", "--set", "training.micro_batch_size=2", "--set",
        "lr_scheduler.warmup_steps=1", "--set", "model.vocab_size=264", "--steps", "4", "--warmup", "1"]


def run_script(path: str, *args: str) -> subprocess.CompletedProcess:
    # One thread per process: the ranks of 2 processes share 2 cores (see tests/test_compile_sweep.py).
    return subprocess.run([sys.executable, path, *args], cwd=REPO, env={**env(), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)


def test_weak_scaling_rows_efficiency_and_a_failing_plan(tmp_path):
    out = tmp_path / "scaling"
    # hsdp with 3 replica groups fails at 2 ranks (train.py's check); at 1 rank every plan shares ddp's cell.
    result = run_script("bench/scaling.py", "recipes/debug.toml", "--plans", "ddp", "hsdp", "fsdp", "--gpus", "1",
                        "2", "--grad-accum", "2", "--dp-replicate", "3", "--out", str(out), *TINY)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(out / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["plan"], r["gpus"], r["global_batch_tokens"]) for r in rows] == [
        ("ddp", "1", "256"), ("ddp", "2", "512"), ("hsdp", "1", "256"), ("hsdp", "2", "512"), ("fsdp", "1", "256"),
        ("fsdp", "2", "512")]
    by_cell = {(r["plan"], int(r["gpus"])): r for r in rows}
    assert [p.name for p in (out / "1gpu").glob("parallelism.*")] == ["parallelism.data_parallel=ddp"]  # one cell

    for plan in ("ddp", "hsdp", "fsdp"):
        one, two = by_cell[(plan, 1)], by_cell[(plan, 2)]
        assert one["cell"] == "1gpu/parallelism.data_parallel=ddp"
        runs = ((1, one), (2, two)) if plan != "hsdp" else ((1, one),)
        for gpus, row in runs:
            assert row["status"] == "ok" and row["exit_code"] == "0" and row["error"] == ""
            assert float(row["tokens_per_s"]) > 0 and float(row["peak_mem_gib"]) > 0
            assert float(row["tokens_per_s_per_gpu"]) == pytest.approx(float(row["tokens_per_s"]) / gpus)
            # No GPU kernels on CPU: the communication columns stay empty, though the last 2 steps were profiled.
            assert row["exposed_comm_ms"] == row["comm_ms"] == ""
            run_dir = out / row["cell"]
            assert len(list((run_dir / "profile").glob("rank*.json"))) == gpus
            assert f"on {gpus} rank(s), cpu" in (run_dir / "output.log").read_text()  # torchrun started N ranks
            config = (run_dir / "config.toml").read_text()
            assert f"global_batch_tokens = {64 * 2 * 2 * gpus}\n" in config and "start_step = 3\n" in config
            assert f'data_parallel = "{plan if gpus == 2 else "ddp"}"' in config and 'source = "synthetic"' in config
        assert float(one["efficiency"]) == 1.0
        if plan != "hsdp":
            assert float(two["efficiency"]) == pytest.approx(float(two["tokens_per_s_per_gpu"]) /
                                                             float(one["tokens_per_s_per_gpu"]))
    # The same batch and math per GPU count: the plans differ only in how ranks hold the model and accumulate.
    assert float(by_cell[("ddp", 2)]["final_loss"]) == pytest.approx(float(by_cell[("fsdp", 2)]["final_loss"]),
                                                                      rel=1e-4)
    hsdp = by_cell[("hsdp", 2)]
    assert hsdp["status"] == "failed" and hsdp["exit_code"] not in ("", "0")
    assert hsdp["error"] == ("error: parallelism.dp_replicate = 3 must divide the world size (2): set it to the node "
                             "count")
    assert hsdp["tokens_per_s"] == hsdp["efficiency"] == ""

    # The printed table is the saved one: a row per plan and GPU count, numeric tokens/s where the cell ran.
    table = [line for line in (out / "scaling.md").read_text().splitlines() if line.startswith("| ")]
    assert table[0].startswith("| plan | gpus | cp | global_batch_tokens | tokens_per_s | tokens_per_s_per_gpu | "
                               "efficiency | peak_mem_gib | exposed_comm_ms | comm_ms |")
    assert all(line in result.stdout for line in table) and len(table) == 1 + len(rows)
    ddp_two = table[2].split(" | ")
    assert ddp_two[:4] == ["| ddp", "2", "1", "512"] and float(ddp_two[4].replace(",", "")) > 0


def test_context_parallel_cells_share_each_sequence_and_match_one_process(tmp_path):
    out = tmp_path / "cp"
    tiny_cp = [arg if not arg.startswith("data.seq_len") else "data.seq_len=256" for arg in TINY]
    result = run_script("bench/scaling.py", "recipes/debug.toml", "--plans", "fsdp", "--gpus", "1", "2",
                        "--context-parallel", "--out", str(out), *tiny_cp)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(out / "scaling.csv") as f:
        one, two = list(csv.DictReader(f))
    # Both cells train the same 2 sequences a step: 2 GPUs share each one (cp = 2) instead of taking one each.
    assert [(r["gpus"], r["cp"], r["global_batch_tokens"], r["status"]) for r in (one, two)] == [
        ("1", "1", "512", "ok"), ("2", "2", "512", "ok")]
    config = (out / two["cell"] / "config.toml").read_text()
    assert "context_parallel_degree = 2\n" in config and "global_batch_tokens = 512\n" in config
    assert "(1 data-parallel x 2 context-parallel)" in (out / two["cell"] / "output.log").read_text()
    assert float(two["efficiency"]) == pytest.approx(float(two["tokens_per_s"]) / 2 / float(one["tokens_per_s"]))
    # The same sequences and math: the CP losses are the one process's (fp32 on CPU).
    assert float(two["final_loss"]) == pytest.approx(float(one["final_loss"]), rel=1e-5)
    assert "Context parallelism (N GPUs share each sequence)" in (out / "scaling.md").read_text()


@pytest.mark.parametrize("overrides, expected", [
    # CUDA, compile.mode = auto: one process gets CUDA graphs, FSDP2 / HSDP on several GPUs cannot use them.
    ({}, [({"parallelism.data_parallel": "ddp"}, ["ddp"]),
          ({"parallelism.data_parallel": "fsdp", "compile.mode": "default"}, ["fsdp", "hsdp"])]),
    ({"compile.mode": "default"}, [({"parallelism.data_parallel": "ddp"}, ["ddp", "fsdp", "hsdp"])]),
    ({"compile.enable": "false"}, [({"parallelism.data_parallel": "ddp"}, ["ddp", "fsdp", "hsdp"])]),
    ({"training.device": "cpu"}, [({"parallelism.data_parallel": "ddp"}, ["ddp", "fsdp", "hsdp"])]),
], ids=["auto", "default", "eager", "cpu"])
def test_one_gpu_baselines_run_in_the_compile_mode_of_their_plans(overrides, expected):
    from bench.scaling import one_gpu_cells

    # nsa_125m_ddp.toml: CUDA, compiled, compile.mode left at auto.
    assert one_gpu_cells("recipes/nsa_125m_ddp.toml", overrides, ["ddp", "fsdp", "hsdp"]) == expected
    fsdp_first = one_gpu_cells("recipes/nsa_125m_ddp.toml", overrides, ["fsdp", "ddp"])
    assert sorted(plan for _, plans in fsdp_first for plan in plans) == ["ddp", "fsdp"]


def test_grid_domains_cover_keys_that_only_some_cells_set():
    from benchmarking.sweep import grid_domains

    cells = [{"parallelism.data_parallel": "hsdp", "parallelism.dp_replicate": "2"},
             {"parallelism.data_parallel": "fsdp"}, {"parallelism.data_parallel": "ddp", "compile.mode": "default"}]
    assert grid_domains(cells) == {"parallelism.data_parallel": ["hsdp", "fsdp", "ddp"],
                                   "parallelism.dp_replicate": [2], "compile.mode": ["default"]}


def kernel(name: str, start: float, end: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": end - start}


def test_comm_breakdown_counts_only_communication_no_compute_overlaps():
    from bench.scaling import comm_breakdown

    trace = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#5", "ts": 0.0, "dur": 10_000.0},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#6", "ts": 10_000.0, "dur": 10_000.0},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#5", "ts": 0.0, "dur": 9_000.0},  # GPU's mark
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 20_000.0},  # host time: not a kernel
        kernel("sm90_xmma_gemm_bf16", 0.0, 4_000.0), kernel("triton_per_fused_0", 3_000.0, 6_000.0),
        kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 5_000.0, 9_000.0),
        kernel("triton_red_fused_1", 11_000.0, 12_500.0),
        kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(...)", 12_000.0, 13_000.0),
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)", 12_800.0, 13_400.0)]}
    got = comm_breakdown(trace)
    # compute: [0, 6] + [11, 12.5] ms; NCCL: [5, 9] + [12, 13.4] ms, of which [5, 6] and [12, 12.5] overlap compute.
    assert got == pytest.approx({
        "step_ms": 10.0, "compute_ms": 7.5 / 2, "comm_ms": 5.4 / 2, "exposed_comm_ms": 3.9 / 2,
        "gpu_idle_ms": (20.0 - 9.0 - 2.4) / 2, "all_gather_ms": 4.0 / 2, "reduce_scatter_ms": 1.0 / 2,
        "all_reduce_ms": 0.6 / 2, "profiled_steps": 2})
    assert comm_breakdown({"traceEvents": trace["traceEvents"][:4]}) is None  # a CPU run: no kernels


def test_kernel_report_reads_rank_0s_trace_and_skips_cpu_runs(tmp_path):
    import json

    from bench.scaling import kernel_report, read_traces

    step = {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0.0, "dur": 10_000.0}
    (tmp_path / "profile").mkdir()
    for rank, names in ((0, ["_fwd_kernel", "sm90_xmma_gemm_bf16"]), (1, ["triton_poi_fused_0"])):
        events = [step] + [kernel(name, 1000.0 * i, 1000.0 * i + 2000.0) for i, name in enumerate(names)]
        (tmp_path / "profile" / f"rank{rank}.123.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    report = kernel_report(read_traces(tmp_path), n_layers=2)
    assert "| NSA Triton kernels | 2.00 | 50.0% | 1 | 0.5 |" in report and "| GEMM | 2.00 | 50.0% | 1 | 0.5 |" in report
    assert "inductor" not in report  # rank 1's kernels are not rank 0's
    (tmp_path / "profile" / "rank0.123.pt.trace.json").write_text(json.dumps({"traceEvents": [step]}))
    assert kernel_report(read_traces(tmp_path), n_layers=2) is None  # a CPU run's trace: no GPU kernels


def test_per_rank_tokens_and_argument_errors(capsys):
    from bench.scaling import main, tokens_per_rank
    from nsa_training.config import ConfigError

    assert tokens_per_rank("recipes/debug.toml", {}, 1) == 8 * 256  # the recipe's micro-batch of 8 x 256
    assert tokens_per_rank("recipes/debug.toml", {"data.seq_len": "64"}, 3) == 8 * 64 * 3
    with pytest.raises(ConfigError, match=r"--set training.micro_batch_size=two: expected a positive integer"):
        tokens_per_rank("recipes/debug.toml", {"training.micro_batch_size": "two"}, 1)
    for args, message in ((["--gpus", "1", "1"], "error: --gpus 1 1: repeated value; list each once"),
                          (["--gpus", "0"], "error: --gpus 0 --grad-accum 1 --dp-replicate 2: must be >= 1"),
                          (["--launcher", "x"], "error: --launcher: scaling.py launches torchrun itself"),
                          (["--devices", "0"], "error: --devices: each scaling cell uses the first N GPUs"),
                          (["--plans", "ddp", "bogus"], "error: --plans bogus: expected some of ddp, fsdp, hsdp"),
                          (["--steps", "10", "--warmup", "5", "--profile-steps", "5"],
                           "error: --profile-steps 5: must be >= 0 and leave unprofiled steady steps")):
        with pytest.raises(SystemExit) as stopped:
            main(["recipes/debug.toml", *args])
        assert stopped.value.code == 2
        assert capsys.readouterr().err.startswith(message)


def write_events(run_dir: Path) -> None:
    """A run's tb/ with a loss, a throughput and per-layer NSA stats of 4 layers as train.py tags them
    (`nsa/<stat>/layer<i>`; layer10 sorts after layer2)."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(run_dir / "tb")) as writer:
        for step in range(1, 11):
            writer.add_scalar("train/loss", 6.0 - 0.1 * step, step)
            writer.add_scalar("perf/tokens_per_s", 1000.0 + step, step)
            for layer in (0, 1, 2, 10):
                writer.add_scalar(f"nsa/gate_cmp/layer{layer}", layer + 0.01 * step, step)
                writer.add_scalar(f"nsa/gate_slc/layer{layer}", -layer - 0.01 * step, step)


def test_plot_groups_layers_into_one_png_grid(tmp_path):
    from PIL import Image

    from scripts.plot_tb import panels, read_scalars

    run_dir, png = tmp_path / "run", tmp_path / "docs" / "health.png"
    write_events(run_dir)
    grid = panels(read_scalars(run_dir), ["nsa/", "perf/"])
    assert list(grid) == ["nsa/gate_cmp", "nsa/gate_slc", "perf/tokens_per_s"]
    assert list(grid["nsa/gate_cmp"]) == ["layer0", "layer1", "layer2", "layer10"]
    steps, values = grid["nsa/gate_slc"]["layer10"]
    assert steps == list(range(1, 11)) and values == pytest.approx([-10 - 0.01 * s for s in steps])
    assert list(grid["perf/tokens_per_s"]) == ["tokens_per_s"]

    result = run_script("scripts/plot_tb.py", str(run_dir), "--out", str(png), "--tags-prefix", "nsa/", "perf/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"saved {png}: 3 subplots (nsa/gate_cmp, nsa/gate_slc, perf/tokens_per_s)"
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (1350, 320)  # one row of three 4.5 x 3.2 in subplots
        low, high = image.convert("L").getextrema()
        assert high - low > 100  # drawn on, not a blank canvas


@pytest.mark.parametrize("make_dir", [False, True], ids=["missing", "empty"])
def test_plot_without_events_is_one_error_line(tmp_path, make_dir):
    run_dir, png = tmp_path / "run", tmp_path / "out.png"
    if make_dir:
        (run_dir / "tb").mkdir(parents=True)
    result = run_script("scripts/plot_tb.py", str(run_dir), "--out", str(png))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (f"error: RUN_DIR {run_dir}: no tensorboard event files in it or in its tb/; give a "
                             "run's job.run_dir (metrics.tensorboard = true)\n")
    assert not png.exists()


def test_compare_runs_counts_equal_steps_and_finds_the_largest_difference(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    losses = {"a": [5.0 - 0.1 * s for s in range(1, 11)], "b": [5.0 - 0.1 * s for s in range(1, 11)]}
    losses["b"][6] *= 1.001  # step 7
    losses["b"][8] *= 1.0005  # step 9
    for name, values in losses.items():
        with SummaryWriter(str(tmp_path / name / "tb")) as writer:
            for step, value in enumerate(values, start=1):
                writer.add_scalar("train/loss", value, step)
    runs = [str(tmp_path / "a"), str(tmp_path / "b")]
    result = run_script("scripts/compare_runs.py", *runs, "--from-step", "3", "--rtol", "1e-2")
    assert result.returncode == 0, result.stderr
    summary, *table = result.stdout.splitlines()
    assert summary.startswith(f"train/loss: {runs[0]} (A) vs {runs[1]} (B), steps 3-10: 8 common, 6 bitwise equal; "
                              "max |A-B| 0.0043")
    assert summary.endswith("max relative 0.001 (step 7)")
    assert [row.split(" | ")[0] for row in table[2:]] == ["| 3", "| 7", "| 10"]

    assert run_script("scripts/compare_runs.py", *runs, "--rtol", "1e-4").returncode == 1
    missing = run_script("scripts/compare_runs.py", *runs, "--tag", "eval/loss")
    assert missing.returncode == 2 and missing.stderr == (f"error: --tag eval/loss: {runs[0]} did not log it (it has "
                                                          "train/loss)\n")


def test_compare_runs_takes_the_restarts_values_of_a_resumed_run_quietly(tmp_path):
    """A killed run logged steps 1-7; its restart from the step-4 checkpoint redid 5-7 with a writer that purges
    them (as `nsa_training.metrics` opens it): the comparison sees the restart's values, with no tensorboard
    warning on stderr."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path / "a" / "tb")) as writer:
        for step in range(1, 11):
            writer.add_scalar("train/loss", 10.0 - step, step)
    with SummaryWriter(str(tmp_path / "b" / "tb")) as writer:
        for step in range(1, 8):
            writer.add_scalar("train/loss", 10.0 - step + (step > 4), step)  # 5-7 differ: replaced below
    # Event files are read in name order, which starts with the second the writer opened (a restart is later).
    time.sleep(1.01)
    with SummaryWriter(str(tmp_path / "b" / "tb"), purge_step=5) as writer:
        for step in range(5, 11):
            writer.add_scalar("train/loss", 10.0 - step, step)
    result = run_script("scripts/compare_runs.py", str(tmp_path / "a"), str(tmp_path / "b"))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert ", steps 1-10: 10 common, 10 bitwise equal; max |A-B| 0," in result.stdout.splitlines()[0]
