"""bench/compile_sweep.py and bench/e2e.py on CPU: one row per cell, failures recorded, hparams for tensorboard."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.helpers import env, event_files, scalars

REPO = Path(__file__).resolve().parents[1]
# Tiny steps of the debug recipe (tests/helpers.py's FAST without the settings the sweep fixes itself).
TINY = ["--set", "data.seq_len=128", "--set", "training.global_batch_tokens=512", "--set",
        "training.micro_batch_size=4", "--set", "lr_scheduler.warmup_steps=2", "--steps", "4", "--warmup", "1"]


def run_bench(script: str, *args: str) -> subprocess.CompletedProcess:
    # One thread per cell: on 2 shared cores, OpenMP threads of concurrent processes spin against each other
    # (measured: this test's e2e sweep 54 s with the default threads, 13 s with one).
    result = subprocess.run([sys.executable, f"bench/{script}", *args], cwd=REPO, env={**env(), "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result


def read_csv(out: Path) -> list[dict[str, str]]:
    with open(out / "sweep.csv") as f:
        return list(csv.DictReader(f))


def hparams_of(run_dir: Path) -> dict[str, str | float]:
    """The hparams session written into a cell's tb dir: {name: value}."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    for path in event_files(run_dir):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == "_hparams_/session_start_info":
                    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    hparams = data.session_start_info.hparams
                    return {k: v.string_value or v.number_value for k, v in hparams.items()}
    return {}


def test_grid_sweep_one_row_per_cell(tmp_path):
    out = tmp_path / "sweep"
    # The shared test cache keeps the compiled cell's compile short (the sweep's default is a cache per cell).
    result = run_bench("compile_sweep.py", "recipes/debug.toml", "--grid", "compile.enable=false,true", "--grid",
                       "model.flavor=dense-debug", "--keep-inductor-cache", "--out", str(out), *TINY)
    assert "[1/2] compile.enable=false model.flavor=dense-debug  elapsed" in result.stdout
    assert "[2/2] compile.enable=true model.flavor=dense-debug  elapsed" in result.stdout

    eager, compiled = read_csv(out)
    for row in (eager, compiled):
        assert row["status"] == "ok" and row["exit_code"] == "0" and row["error"] == ""
        assert float(row["tokens_per_s"]) > 0 and 0 < float(row["final_loss"]) < 10
        assert float(row["to_step1_s"]) > 0 and float(row["peak_mem_gib"]) > 0
        assert row["mfu"] == "" or float(row["mfu"]) >= 0
        run_dir = out / row["cell"]
        final_loss = scalars(event_files(run_dir)[0])["train/loss"][4]  # the trainer's own event file
        assert abs(float(row["final_loss"]) - final_loss) < 1e-6
        assert hparams_of(run_dir) == {"compile.enable": row["compile.enable"], "model.flavor": "dense-debug"}
    assert eager["graph_breaks"] == eager["recompiles"] == "" and compiled["graph_breaks"] == "0"
    assert int(compiled["graphs_compiled"]) >= 1

    table = (out / "sweep.md").read_text().splitlines()
    rows = [line for line in table if line.startswith("| compile.enable=")]
    assert len(rows) == 2 and "| ok |" in rows[0] and "| ok |" in rows[1]
    machine = table[1]  # under the title: what the sweep ran on
    assert machine.startswith("Machine: ") and "; CPU " in machine and f" cores; torch {torch.__version__}" in machine


def test_failing_cell_is_recorded_and_the_sweep_goes_on(tmp_path):
    """Also with two device slots: both cells start at once and the rows keep the grid's order."""
    out = tmp_path / "sweep"
    result = run_bench("compile_sweep.py", "recipes/debug.toml", "--grid", "model.nsa.window_size=0,48", "--out",
                       str(out), "--devices", "7", "8", *TINY)
    lines = result.stdout.splitlines()
    started = [i for i, line in enumerate(lines) if line.startswith(("[1/2]", "[2/2]"))]
    finished = [i for i, line in enumerate(lines) if line.startswith(("    [1]", "    [2]"))]
    assert len(started) == len(finished) == 2 and max(started) < min(finished), result.stdout
    assert {line.rsplit("=", 1)[1] for line in lines if line.startswith("[")} == {"7", "8"}
    bad, good = read_csv(out)
    assert bad["status"] == "failed" and bad["exit_code"] == "2"
    assert bad["error"] == "error: model.nsa.window_size = 0: must be > 0"
    assert bad["tokens_per_s"] == "" and bad["final_loss"] == ""
    assert good["status"] == "ok" and float(good["tokens_per_s"]) > 0 and float(good["final_loss"]) > 0
    assert "failed (exit 2): error: model.nsa.window_size = 0: must be > 0" in result.stdout
    assert hparams_of(out / bad["cell"]) == {"model.nsa.window_size": 0.0}


def test_timeout_launcher_env_and_private_caches(tmp_path):
    from benchmarking.sweep import sweep

    out = tmp_path / "sweep"
    launcher = ("SWEEP_TEST=7 " + sys.executable +
                " -c 'import os, time; print(os.environ[\"SWEEP_TEST\"], os.environ[\"TORCHINDUCTOR_CACHE_DIR\"], "
                "flush=True); time.sleep(60)'")
    (row,) = sweep(str(REPO / "recipes/debug.toml"), [[{"training.seed": "3"}]], overrides={}, steps=4, warmup=1,
                   out=out, launcher=launcher, cell_timeout=1)
    assert row["status"] == "timeout" and row["exit_code"] != 0
    assert row["error"] == f"timed out after 1 s; last: 7 {out / 'inductor_cache' / 'training.seed=3'}"
    assert os.environ.get("SWEEP_TEST") is None


def test_e2e_ratio_per_seq_len(tmp_path):
    out = tmp_path / "e2e"
    result = run_bench("e2e.py", "--recipe", "recipes/debug.toml", "--flavors", "debug", "dense-debug",
                       "--seq-lens", "64", "128", "--tokens-per-micro-batch", "256", "--out", str(out), *TINY,
                       "--set", "model.vocab_size=264")  # the debug flavor's own, not e2e's GPT-2-sized default
    rows = read_csv(out)
    assert [(r["model.flavor"], r["data.seq_len"], r["training.micro_batch_size"]) for r in rows] == [
        ("debug", "64", "4"), ("debug", "128", "2"), ("dense-debug", "64", "4"), ("dense-debug", "128", "2")]
    for row in rows:
        config = (out / row["cell"] / "config.toml").read_text()
        assert f"max_seq_len = {row['data.seq_len']}\n" in config and 'source = "synthetic"' in config
    tokens_per_s = {(r["model.flavor"], r["data.seq_len"]): float(r["tokens_per_s"]) for r in rows}
    for T in ("64", "128"):
        ratio = tokens_per_s[("debug", T)] / tokens_per_s[("dense-debug", T)]
        line = next(line for line in result.stdout.splitlines() if line.startswith(f"| {T} |"))
        assert line.endswith(f"| {ratio:.2f} |")
    header = "| T | debug tokens/s | dense-debug tokens/s | debug / dense-debug |"
    assert (out / "e2e.md").read_text().splitlines()[0] == header


def test_cell_command_and_recompile_count(tmp_path):
    """A stand-in trainer: prints its command line, recompiles a function twice and logs the compile counters (CUDA
    graphs recorded at step 2 and again at steps 4 and 5)."""
    from benchmarking.sweep import sweep

    fake_train = tmp_path / "fake_train.py"
    fake_train.write_text(
        "import sys, torch\n"
        "from torch.utils.tensorboard import SummaryWriter\n"
        "print('argv', *sys.argv[1:], flush=True)\n"
        "double = torch.compile(lambda x: x * 2, backend='eager', dynamic=False)\n"
        "for n in (2, 3, 4):\n"
        "    double(torch.ones(n))\n"
        "run_dir = next(a.split('=', 1)[1] for a in sys.argv if a.startswith('--job.run_dir='))\n"
        "with SummaryWriter(run_dir + '/tb') as writer:\n"
        "    writer.add_scalar('compile/graphs_compiled', 1.0, 2)\n"
        "    for step, recorded in ((2, 40.0), (4, 48.0), (5, 56.0)):  # graphs recorded again at steps 4 and 5\n"
        "        writer.add_scalar('compile/cudagraph_recorded_inputs', recorded, step)\n")
    out = tmp_path / "sweep"
    recipe = str(REPO / "recipes/debug.toml")
    (row,) = sweep(recipe, [[{"compile.mode": "max-autotune"}]], overrides={"data.seq_len": "64"}, steps=6,
                   warmup=2, out=out, launcher=f"OMP_NUM_THREADS=1 {sys.executable} {fake_train}")
    assert row["status"] == "ok" and row["graphs_compiled"] == 1 and row["recompiles"] == 2
    assert row["cudagraph_rerecords"] == 2
    argv = next(line for line in (out / row["cell"] / "output.log").read_text().splitlines()
                if line.startswith("argv "))
    assert argv.split()[1:] == [recipe, "--data.seq_len=64", "--compile.mode=max-autotune", "--training.steps=6",
                                "--metrics.log_freq=1", "--metrics.tensorboard=true", "--training.eval_interval=0",
                                "--checkpoint.enable=false", "--checkpoint.export_weights=false",
                                f"--job.run_dir={out / row['cell']}"]


def test_stop_cell_ends_torchruns_ranks(tmp_path):
    """A timed-out cell leaves no rank behind: torchrun starts its ranks in sessions of their own, which a signal
    to the launcher's process group does not reach."""
    from benchmarking.sweep import stop_cell

    pid_file = tmp_path / "rank.pid"
    rank = tmp_path / "rank.py"
    rank.write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                             str(rank)], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not pid_file.exists() or not pid_file.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, "torchrun did not start its rank"
        time.sleep(0.1)
    rank_pid = int(pid_file.read_text())
    stop_cell(proc)
    assert proc.returncode is not None

    def running(pid: int) -> bool:  # a zombie (exited, not yet reaped) does not count
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    assert not running(rank_pid)  # torchrun waited for it before exiting
