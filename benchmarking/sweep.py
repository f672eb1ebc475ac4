"""Run train.py once per cell of a grid of overrides, each in a fresh process, and tabulate compile time, throughput,
memory and loss: the machinery of bench/compile_sweep.py, bench/e2e.py and bench/scaling.py.

Each cell is a fresh process (Dynamo's counters and caches are per process) with its own inductor and Triton cache
under OUT, so no cell compiles faster because an earlier one warmed a cache (keep_inductor_cache shares one). With
devices, cells run concurrently, one per GPU set. Results come from the cell's tensorboard events; a failing or
timed-out cell is recorded, never fatal. Writes OUT/sweep.md (headed by the date and the machine: GPUs, CPU, torch
and triton versions) and OUT/sweep.csv (rewritten as each cell ends, so an interrupted sweep keeps what it
measured), OUT/<cell>/output.log, and the cell's overrides and results as tensorboard hparams into OUT/<cell>/tb:
`tensorboard --logdir OUT` compares the cells in its HParams tab.

Columns: compile_s = step 1's time minus the median steady step time (what compiling added to step 1);
to_step1_s = wall time from launch to the end of step 1 (imports, data, model build and compile); tokens_per_s
and mfu = medians over the steps after --warmup; peak_mem_gib = memory/max_allocated_gib (memory/peak_rss_gib on CPU);
graph_breaks and graphs_compiled = the trainer's readings after step 2; recompiles = Dynamo's recompile log
lines (TORCH_LOGS=recompiles) over the whole run; cudagraph_skips = compiled graphs that a CUDA-graph mode
(reduce-overhead, max-autotune) ran without CUDA graphs, after step 2 (0: every graph was captured);
cudagraph_rerecords = steps after step 2 whose CUDA graphs were recorded again (a moved static input, or a
recompile): each one a step that paid for recording instead of replaying.
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import itertools
import os
import platform
import queue
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nsa_training.config import ConfigError

REPO = Path(__file__).resolve().parents[1]  # where train.py is: cells run there

Overrides = dict[str, str]
# e2e.py's and scaling.py's data unless --set says otherwise: random byte tokens (throughput does not depend on the
# text) into the model with GPT-2's vocabulary (50304 rows), the one the 125M+ recipes' tokenizer gives and every
# measured figure used, without needing the tokenizer's file. Random tokens have no documents to mask.
SYNTHETIC_DATA = ["data.source=synthetic", "data.tokenizer=byte", "model.vocab_size=50304", "data.document_mask=false"]
COLUMNS = ["status", "exit_code", "compile_s", "to_step1_s", "tokens_per_s", "mfu", "peak_mem_gib", "graph_breaks",
           "graphs_compiled", "recompiles", "cudagraph_skips", "cudagraph_rerecords", "final_loss", "error"]
# What TORCH_LOGS=recompiles prints once per recompile (torch/_dynamo/guards.py).
_RECOMPILE_LINE = "[__recompiles] Recompiling function"
# train.py's one-line ConfigError, then a Python exception line of rank 0, then of any process.
_ERROR_LINES = [re.compile(r"\berror: "), re.compile(r"^\[rank0?\]:\s*[\w.]*(Error|Exception)\b"),
                re.compile(r"^[\w.]*(Error|Exception)\b")]


def parse_override(text: str, option: str) -> tuple[str, str]:
    key, has_value, value = text.partition("=")
    if not has_value or not key:
        raise ConfigError(f"{option} {text!r}: expected KEY=VALUE, e.g. {option} compile.mode=max-autotune")
    return key, value


def cell_name(overrides: Overrides) -> str:
    """A directory name that reads as the cell's overrides (what tensorboard shows as the run's name)."""
    name = ",".join(f"{k}={v}" for k, v in overrides.items()) or "baseline"
    return re.sub(r"[^\w.=,+-]", "_", name)


def _as_number(value: str) -> int | float | str:
    """A grid value as tensorboard should sort it: numbers as numbers."""
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def read_results(tb_dir: Path, warmup: int, launched_at: float) -> dict[str, float | int | str]:
    """The sweep's columns from one cell's tensorboard events ("" for what the run did not log)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})  # 0: keep every step
    events.Reload()
    series = {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}

    def steady_median(tag: str) -> float | str:
        values = [e.value for e in series.get(tag, []) if e.step > warmup]
        return statistics.median(values) if values else ""

    results: dict[str, float | int | str] = {
        "tokens_per_s": steady_median("perf/tokens_per_s"), "mfu": steady_median("perf/mfu")}
    step_times = {e.step: e.value for e in series.get("perf/step_time_s", [])}
    steady_step_time = steady_median("perf/step_time_s")
    if 1 in step_times and steady_step_time != "":
        results["compile_s"] = step_times[1] - steady_step_time
    step1 = [e for e in series.get("train/loss", []) if e.step == 1]
    if step1:
        results["to_step1_s"] = step1[0].wall_time - launched_at
    # metrics.PEAK_MEMORY_TAGS (a GPU's allocator peak, or a CPU's peak RSS), spelt out: the sweep imports no torch
    peak_tag = next((tag for tag in ("memory/max_allocated_gib", "memory/peak_rss_gib") if tag in series), None)
    if peak_tag is not None:
        results["peak_mem_gib"] = max(e.value for e in series[peak_tag])
    if "compile/graph_breaks" in series:
        results["graph_breaks"] = int(series["compile/graph_breaks"][-1].value)
    if "compile/graphs_compiled" in series:
        # Dynamo's count of distinct graphs in this process, read by the trainer after step 2, when every block
        # and the loss have compiled: the frames compiled plus any recompile in steps 1-2 (recompiles counts those
        # over the whole run).
        results["graphs_compiled"] = int(series["compile/graphs_compiled"][0].value)
    if "compile/cudagraph_skips" in series:
        results["cudagraph_skips"] = int(series["compile/cudagraph_skips"][-1].value)
    if "compile/cudagraph_recorded_inputs" in series:  # logged at step 2, then at each step the count rose
        results["cudagraph_rerecords"] = len(series["compile/cudagraph_recorded_inputs"]) - 1
    if "train/loss" in series:
        results["final_loss"] = series["train/loss"][-1].value
    return results


def error_line(log: Path) -> str:
    """The most telling line of a failed cell's output: train.py's `error:`, else the exception, else the last."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for pattern in _ERROR_LINES:
        for line in reversed(lines):
            if pattern.search(line):
                return line
    return lines[-1] if lines else ""


def run_cell(command: list[str], env: dict[str, str], log: Path, timeout: float | None) -> tuple[int, bool]:
    """Run one cell in its own process group, output into `log`; (exit code, timed out)."""
    with open(log, "w") as output:
        # A session of its own, which stop_cell ends on timeout or Ctrl-C.
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            stop_cell(proc)
            return proc.wait(), True
        except BaseException:
            stop_cell(proc)
            raise


def stop_cell(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """End a cell started in a session of its own, its ranks included. torchrun starts each rank in a session of
    its own too, out of reach of a signal to the launcher's group: SIGKILLed, torchrun left them running (a hung
    2-GPU cell kept 35 GiB of each GPU after its timeout). SIGTERM lets torchrun stop its ranks (SIGTERM, then
    SIGKILL after its 30 s); the group is SIGKILLed if it is still there after grace_s."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def measure_cell(command: list[str], env: dict[str, str], run_dir: Path, warmup: int,
                 timeout: float | None) -> dict:
    """Run one cell and return its COLUMNS (those it produced)."""
    log = run_dir / "output.log"
    launched_at = time.time()
    code, timed_out = run_cell(command, env, log, timeout)
    row: dict = {"status": "ok" if code == 0 else "timeout" if timed_out else "failed", "exit_code": code}
    if (run_dir / "tb").is_dir():
        row.update(read_results(run_dir / "tb", warmup, launched_at))
    if "graphs_compiled" in row:  # compiled: Dynamo logged each recompile (any step, any cause) as one line
        row["recompiles"] = log.read_text(errors="replace").count(_RECOMPILE_LINE)
    if code != 0:
        row["error"] = (f"timed out after {timeout:g} s; last: " if timed_out else "") + error_line(log)
    return row


def grid_domains(cells: list[Overrides]) -> dict[str, list]:
    """Every key some cell sets, with its distinct values in grid order. Cells may set different keys
    (bench/scaling.py: only hsdp's name its replica groups)."""
    keys = dict.fromkeys(key for cell in cells for key in cell)
    return {key: list(dict.fromkeys(_as_number(cell[key]) for cell in cells if key in cell)) for key in keys}


def write_hparams(tb_dir: Path, overrides: Overrides, row: dict, domains: dict[str, list]) -> None:
    """The cell's overrides and numeric results as a tensorboard hparams session of the run in `tb_dir`."""
    from torch.utils.tensorboard import SummaryWriter

    metrics = {f"sweep/{k}": float(row[k]) for k in COLUMNS if isinstance(row.get(k), (int, float))}
    with SummaryWriter(str(tb_dir)) as writer:
        # run_name ".": the session joins the cell's own run, next to its training curves.
        writer.add_hparams({k: _as_number(v) for k, v in overrides.items()}, metrics,
                           hparam_domain_discrete={k: domains[k] for k in overrides}, run_name=".")


def _show(value) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value).replace("|", "\\|")


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_show(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def machine() -> str:
    """What a sweep ran on, for its table's header: the GPUs (nvidia-smi), the host's CPU and the torch and triton
    versions. Short-sequence throughput depends on the CPU as well as the GPU (nsa-125m at T = 2048 on one H100
    host: 231,584 tokens/s, and 309,186 once CUDA graphs took the host out; docs/PERFORMANCE.md)."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        names = []
    gpus = ", ".join(f"{names.count(n)} x {n.replace(', ', ' (driver ')})" for n in dict.fromkeys(names)) or "no GPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    import torch  # only here: the sweep's own process runs no torch (its version string names the CUDA build)

    versions = f"torch {torch.__version__}"
    try:
        versions += f", triton {importlib.metadata.version('triton')}"
    except importlib.metadata.PackageNotFoundError:
        pass
    return f"Machine: {gpus}; CPU {cpu}, {os.cpu_count()} cores; {versions}.\n"


def save_table(out: Path, stem: str, header: str, rows: list[dict], columns: list[str]) -> str:
    """Write OUT/<stem>.md (header + markdown table) and OUT/<stem>.csv (the columns only); returns the table."""
    table = markdown_table(rows, columns)
    (out / f"{stem}.md").write_text(header + table)
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns, restval="", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return table


def sweep(recipe: str, axes: list[list[Overrides]], *, overrides: Overrides, steps: int, warmup: int, out: Path,
          launcher: str = "", cell_timeout: float | None = None, keep_inductor_cache: bool = False,
          devices: list[str] | None = None, measure_only: bool = True) -> list[dict]:
    """Run every cell of the cartesian product of `axes` (each axis a list of override sets) and return one row
    per cell (its overrides and COLUMNS); also writes OUT/sweep.md, OUT/sweep.csv and the hparams events.
    With `devices` (CUDA_VISIBLE_DEVICES values, e.g. ["0", "1"] or ["0,1", "2,3"]), cells run concurrently, one
    per device set. `measure_only` turns off each cell's evaluations and checkpoints; False keeps the recipe's (a
    sweep whose runs are scored afterwards: bench/retrieval.py)."""
    if not 0 <= warmup < steps:
        raise ConfigError(f"--warmup {warmup}: must be >= 0 and < --steps ({steps}) so that steady steps remain")
    out = out.resolve()
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty (an earlier sweep, or a warm cache): choose another --out")
    words = shlex.split(launcher) if launcher else [sys.executable, "train.py"]
    launch_env = dict(w.split("=", 1) for w in itertools.takewhile(lambda w: re.match(r"^\w+=", w), words))
    launch_command = words[len(launch_env):]
    shared_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(out / "inductor_cache"))

    cells = [{k: v for part in combo for k, v in part.items()} for combo in itertools.product(*axes)]
    domains = grid_domains(cells)  # the columns, and the HParams tab's domains
    fixed = {"training.steps": str(steps), "metrics.log_freq": "1", "metrics.tensorboard": "true"}
    if measure_only:  # eval time would land in the next step's time; checkpoints and the export cost disk, not speed
        fixed |= {"training.eval_interval": "0", "checkpoint.enable": "false", "checkpoint.export_weights": "false"}

    header = (f"Sweep of `{recipe}` ({steps} steps, medians after {warmup}; overrides "
              f"{' '.join(f'{k}={v}' for k, v in overrides.items()) or 'none'}), {time.strftime('%Y-%m-%d')}.\n"
              f"{machine()}"
              "compile_s: step 1 minus the median steady step; to_step1_s: launch to the end of step 1.\n\n")
    columns = ["cell", *domains, *COLUMNS]
    slots: queue.Queue = queue.Queue()
    for device in devices or [None]:
        slots.put(device)
    start, done, lock = time.perf_counter(), {}, threading.Lock()

    def run(i: int, cell: Overrides) -> dict:
        device = slots.get()  # a free GPU set (None: whatever the cell sees)
        name = cell_name(cell)
        run_dir = out / name
        run_dir.mkdir(parents=True)
        with lock:
            elapsed = time.perf_counter() - start
            eta = _minutes(elapsed / len(done) * (len(cells) - len(done))) if done else "?"
            label = " ".join(f"{k}={v}" for k, v in cell.items()) or "baseline"
            where = f"  CUDA_VISIBLE_DEVICES={device}" if device is not None else ""
            print(f"[{i + 1}/{len(cells)}] {label}  elapsed {_minutes(elapsed)}  eta {eta}{where}", flush=True)

        cache = shared_cache if keep_inductor_cache else str(out / "inductor_cache" / name)
        torch_logs = ",".join(filter(None, [os.environ.get("TORCH_LOGS"), "recompiles"]))
        env = {**os.environ, **launch_env, "TORCHINDUCTOR_CACHE_DIR": cache,
               "TRITON_CACHE_DIR": str(Path(cache) / "triton_user"), "TORCH_LOGS": torch_logs,
               "PYTHONUNBUFFERED": "1", **({"CUDA_VISIBLE_DEVICES": device} if device is not None else {})}
        args = {**overrides, **cell, **fixed, "job.run_dir": str(run_dir)}
        command = [*launch_command, str(Path(recipe).resolve()), *(f"--{k}={v}" for k, v in args.items())]
        try:
            row = {"cell": name, **cell, **measure_cell(command, env, run_dir, warmup, cell_timeout)}
        finally:
            slots.put(device)
        with lock:
            if row["status"] != "ok":
                print(f"    [{i + 1}] {row['status']} (exit {row['exit_code']}): {row['error']}", flush=True)
            else:
                shown = ("tokens_per_s", "compile_s", "final_loss")
                print(f"    [{i + 1}] ok  " + "  ".join(f"{k} {_show(row.get(k, ''))}" for k in shown), flush=True)
            done[i] = row
            # The table so far, so that an interrupted sweep keeps the cells it finished.
            save_table(out, "sweep", header, [done[j] for j in sorted(done)], columns)
        write_hparams(run_dir / "tb", cell, row, domains)
        return row

    # One cell per free device at a time; rows come back in grid order.
    with ThreadPoolExecutor(max_workers=len(devices or [None])) as pool:
        rows = list(pool.map(run, range(len(cells)), cells))
    table = save_table(out, "sweep", header, rows, columns)
    print("\n" + table + f"\nsaved {out / 'sweep.md'} and {out / 'sweep.csv'}; tensorboard --logdir {out}",
          flush=True)
    return rows


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of every sweep script (bench/compile_sweep.py, e2e.py, scaling.py)."""
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override for every cell (train.py's --KEY VALUE)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per cell")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the steady medians")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory, must be new or empty (default runs/sweeps/<recipe>-<time>)")
    parser.add_argument("--cell-timeout", type=float, default=None, help="seconds before a cell is killed")
    parser.add_argument("--keep-inductor-cache", action="store_true",
                        help="one inductor cache for all cells ($TORCHINDUCTOR_CACHE_DIR, else OUT/inductor_cache) "
                             "instead of a fresh one per cell: later cells then compile from a warm cache")
    parser.add_argument("--devices", nargs="+", default=None, metavar="CUDA_VISIBLE_DEVICES",
                        help="run cells concurrently, one per device set (e.g. --devices 0 1 2 3, or 0,1 2,3 for "
                             "2-GPU cells); cells share the host's CPUs, so compare throughput within one setting")
    parser.add_argument("--launcher", default="",
                        help='command that runs train.py, env assignments first (e.g. "NGPU=2 ./run.sh"); '
                             "default: this Python on train.py")


def sweep_from_args(args: argparse.Namespace, recipe: str, axes: list[list[Overrides]],
                    measure_only: bool = True) -> list[dict]:
    """sweep() with the options of add_sweep_arguments; fills in args.out when it was not given."""
    args.out = args.out or REPO / "runs" / "sweeps" / f"{Path(recipe).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides = dict(parse_override(text, "--set") for text in args.set)
    return sweep(recipe, axes, overrides=overrides, steps=args.steps, warmup=args.warmup, out=args.out,
                 launcher=args.launcher, cell_timeout=args.cell_timeout, keep_inductor_cache=args.keep_inductor_cache,
                 devices=args.devices, measure_only=measure_only)
