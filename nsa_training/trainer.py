"""The trainer: everything one rank does for a run, from the resolved config to the exit status."""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

from nsa_training.config import Config, ConfigError, config_to_toml
from nsa_training.watchdog import (
    DIVERGED_EXIT_CODE,
    HangWatchdog,
    MemorySnapshots,
    ReportFailures,
    RunFailed,
    StopOnSignal,
    enable_flight_recorder,
)


def _importable(module: str) -> bool:
    """Whether `module` (dotted) is installed, without importing it (its parent package is imported; a missing
    parent counts as missing)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


class TrainingDiverged(RunFailed):
    """`training.max_skipped_steps` steps in a row had a non-finite loss or gradient norm."""

    def __init__(self, message: str) -> None:
        super().__init__(message, DIVERGED_EXIT_CODE)


class Trainer:
    """Everything one rank needs for a run, built in the order TorchTitan uses: devices and process group,
    data, model on meta -> parallelisms -> materialise + init, optimizer, checkpoint (resume), metrics."""

    def __init__(self, config: Config):
        import torch

        self.config = config
        cfg = config.training
        self.device = self._pick_device(cfg.device)
        self.rank, self.world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self._init_distributed(config)

        torch.manual_seed(cfg.seed)
        if config.debug.deterministic:
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        self.run_dir = Path(config.job.run_dir)
        self._prepare_run_dir()
        # Recording starts before the model is built: the snapshot shows parameters, gradients and optimizer state.
        self.memory = (MemorySnapshots(self.run_dir, self.rank, self.device, config.debug.memory_snapshot_step)
                       if config.debug.memory_snapshot else None)
        self.compute_dtype = (torch.bfloat16 if cfg.mixed_precision == "bf16" or
                              (cfg.mixed_precision == "auto" and self.device.type == "cuda") else torch.float32)

        import datasets

        from nsa_training.data import build_data_loader

        datasets.disable_progress_bars()  # "Generating train split" bars on stderr would bury a one-line error

        dp_rank, dp_size = self.rank, self.world_size  # every parallelism here is data parallel
        per_step = cfg.micro_batch_size * config.data.seq_len * dp_size
        if cfg.global_batch_tokens % per_step:
            raise ConfigError(f"training.global_batch_tokens = {cfg.global_batch_tokens} is not a multiple of "
                              f"micro_batch_size x seq_len x data-parallel ranks = {per_step}: pick a multiple")
        self.grad_accum = cfg.global_batch_tokens // per_step
        loader_args = dict(batch_size=cfg.micro_batch_size, dp_rank=dp_rank, dp_world_size=dp_size, seed=cfg.seed)
        self.train_loader = build_data_loader(config.data, split="train", **loader_args)
        self.eval_loader = build_data_loader(config.data, split="eval", **loader_args) if cfg.eval_interval else None
        vocab = self.train_loader.tokenizer.vocab_size
        if vocab > config.model.vocab_size:
            raise ConfigError(f"model.vocab_size = {config.model.vocab_size} is smaller than the tokenizer's "
                              f"vocabulary ({vocab}, data.tokenizer = {config.data.tokenizer!r}): raise it")

        self.model = self._build_model()
        from nsa_training.optim import build_lr_scheduler, build_optimizer
        from parallelisms import CUDA_GRAPH_MODES, compile_loss

        self.loss_fn = compile_loss(cross_entropy, config.compile) if config.compile.enable else cross_entropy
        self.cuda_graphs = config.compile.enable and config.compile.mode in CUDA_GRAPH_MODES
        if self.cuda_graphs:
            # A first backward would adopt its CUDA graph's output buffers as the .grad tensors, and the next
            # micro-batch's replay would overwrite them: accumulate into gradients of our own, zeroed in place.
            for p in self.model.parameters():
                p.grad = torch.zeros_like(p)
        self.optimizer = build_optimizer(self.model, config.optimizer, self.device.type)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.lr_scheduler, cfg.steps)

        from nsa_training.checkpoint import CheckpointManager, ModelState, OptimizerState, RankLocalState, RNGState

        self.checkpointer = CheckpointManager(config.checkpoint, self.run_dir)
        self.states = {"model": ModelState(self.model), "optimizer": OptimizerState(self.model, self.optimizer),
                       "lr_scheduler": self.lr_scheduler, "data": RankLocalState(self.train_loader),
                       "rng": RankLocalState(RNGState())}
        self.step = 0
        self.skipped_steps = self.skipped_in_a_row = 0
        self.stop = StopOnSignal()
        self.stop_signum = 0  # a signal received by any rank, as agreed by all ranks (see _agree)
        resume = self.checkpointer.resume_path()
        if resume is not None:
            self.step = self.checkpointer.load(resume, self.states)
            self._print(f"resumed from {resume} at step {self.step}")

        from nsa_training.metrics import MetricLogger

        self.metrics = MetricLogger(config.metrics, self.run_dir, rank=self.rank, total_steps=cfg.steps,
                                    config_text=config_to_toml(config))

    def _pick_device(self, choice: str):
        import torch

        if choice == "cuda" and not torch.cuda.is_available():
            raise ConfigError("training.device = 'cuda' but no CUDA GPU is visible: run on a GPU machine or set "
                              "--training.device cpu")
        if choice == "cpu" or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))

    def _init_distributed(self, config: Config) -> None:
        import torch
        import torch.distributed as dist

        from parallelisms import build_mesh, check_plan

        capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        check_plan(config.parallelism, config.activation_checkpoint, config.compile, config.float8,
                   world_size=self.world_size, device_type=self.device.type, gpu_capability=capability)
        backend = config.parallelism.dist_backend
        if backend == "auto":
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # Object collectives (checkpoint metadata) go over gloo, tensors over NCCL.
            backend = "cuda:nccl,cpu:gloo" if backend == "nccl" else backend
            enable_flight_recorder(config.job.run_dir)
        # The generous timeout until the first step is done (see train()); the store's rendezvous uses it too.
        timeout = timedelta(seconds=config.debug.init_timeout_s)
        if "RANK" in os.environ:  # torchrun
            dist.init_process_group(backend, timeout=timeout,
                                    device_id=self.device if self.device.type == "cuda" else None)
        else:  # plain `python train.py`: a one-process group, so the same code paths run
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        self.mesh = build_mesh(config.parallelism, self.world_size, self.device.type)
        self._set_collective_timeout(config.debug.init_timeout_s)  # the mesh's own groups got torch's default

    def _set_collective_timeout(self, seconds: float) -> None:
        """Timeout of every later collective, in the default group and the mesh's groups (FSDP's, HSDP's)."""
        import torch.distributed as dist

        groups = {dist.group.WORLD, *(self.mesh.get_all_groups() if self.mesh is not None else ())}
        for group in groups:
            group.set_timeout(timedelta(seconds=seconds))  # every backend of the group: NCCL and gloo

    def _prepare_run_dir(self) -> None:
        import torch.distributed as dist

        if self.rank == 0:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                (self.run_dir / "config.toml").write_text(config_to_toml(self.config))
            except OSError as e:
                raise ConfigError(f"job.run_dir = {str(self.run_dir)!r} is not writable ({e.strerror}): "
                                  "choose another directory") from None
        dist.barrier()

    def _build_model(self):
        import torch

        from nsa_models.model import Transformer
        from nsa_models.nsa import BACKENDS
        from parallelisms import parallelize

        self._check_nsa_backend(BACKENDS)
        # On CUDA: build on meta, shard, then materialise only this rank's shard and initialise it (DTensor's
        # RNG tracker gives each shard its own numbers). DTensor has no such tracker on CPU, where every rank
        # would draw the same numbers for its shard: there the model is initialised whole, then sharded.
        on_meta = self.device.type == "cuda"
        with torch.device("meta" if on_meta else self.device):
            model = Transformer(self.config.model)
        if not on_meta:
            with torch.no_grad():
                model.init_weights(buffer_device=self.device)
        parallelize(model, self.config.parallelism, self.config.activation_checkpoint, self.config.compile,
                    self.config.float8, self.mesh, self.compute_dtype)
        if on_meta:
            model.to_empty(device=self.device)
            with torch.no_grad():
                model.init_weights(buffer_device=self.device)
        model.train()
        n_params = sum(p.numel() for p in model.parameters())
        self._print(f"model {self.config.model.flavor}: {n_params / 1e6:.2f}M parameters on {self.world_size} "
                    f"rank(s), {self.device.type}, compute {str(self.compute_dtype).removeprefix('torch.')}")
        return model

    def _check_nsa_backend(self, built: dict) -> None:
        """The chosen NSA backend must be able to run here: no silent fallback to another one."""
        import torch

        from nsa_models.args import BUILT_IN_BACKENDS, LIBRARY_PACKAGES, missing_package

        nsa = self.config.model.nsa
        if self.config.model.attention != "nsa" or nsa.backend == "reference":
            return
        if nsa.backend not in built:
            raise ConfigError(f"model.nsa.backend = {nsa.backend!r} is not available here (the triton package is "
                              "missing): install triton or set --model.nsa.backend reference")
        if self.device.type != "cuda":
            raise ConfigError(f"model.nsa.backend = {nsa.backend!r} needs a CUDA GPU (device is "
                              f"{self.device.type}): set --model.nsa.backend reference")
        for key in BUILT_IN_BACKENDS:  # the keys that may name a library
            choice = getattr(nsa, key)
            if choice in LIBRARY_PACKAGES and not _importable(LIBRARY_PACKAGES[choice][0]):
                raise ConfigError(missing_package(key, choice))
            if choice == "flash_attn_4" and self.compute_dtype != torch.bfloat16:
                raise ConfigError(f"model.nsa.{key} = 'flash_attn_4' runs bf16 only: set training.mixed_precision = "
                                  f"'bf16' (or 'auto'), or {key} = {BUILT_IN_BACKENDS[key][0]!r}")

    def _autocast(self):
        import torch

        # FSDP2 casts parameters itself (MixedPrecisionPolicy); DDP and one process use autocast.
        fsdp = self.mesh is not None and self.config.parallelism.data_parallel != "ddp"
        if self.compute_dtype == torch.float32 or fsdp:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _print(self, message: str) -> None:
        if self.rank == self.config.metrics.log_rank:
            print(message, flush=True)

    def _mean_over_ranks(self, value):
        import torch.distributed as dist

        if self.world_size > 1:
            dist.all_reduce(value, op=dist.ReduceOp.AVG)
        return value

    def _agree(self, finite) -> bool:
        """Whether this step's update is finite on every rank; also sets `stop_signum` to any rank's signal.

        Both decisions must be the same on every rank, or the ranks drift apart or deadlock in the next collective.
        `.item()` is one device sync per step; the all-reduce is of a CPU tensor (gloo), adding no device sync.
        """
        import torch
        import torch.distributed as dist

        flags = torch.tensor([int(not finite.item()), self.stop.received])
        if self.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.stop_signum = int(flags[1])
        return not flags[0]

    def train_step(self):
        """One optimizer step over `grad_accum` micro-batches; returns (mean loss, grad norm, data seconds,
        whether the update was applied)."""
        import torch

        debug = self.config.debug
        inject_nan = 0 < debug.nan_at_step <= self.step < debug.nan_at_step + debug.nan_steps
        data_time, total = 0.0, torch.zeros((), device=self.device)
        for _ in range(self.grad_accum):
            start = time.perf_counter()
            inputs, labels = (t.to(self.device, non_blocking=True) for t in next(self.train_loader))
            data_time += time.perf_counter() - start
            if self.cuda_graphs:  # each micro-batch is a new iteration: its graphs may reuse the last one's memory
                torch.compiler.cudagraph_mark_step_begin()
            with self._autocast():
                loss = self.loss_fn(self.model(inputs), labels) / self.grad_accum
            if inject_nan:
                loss = loss * float("nan")
            loss.backward()
            total += loss.detach()
        max_norm = self.config.training.max_grad_norm or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
            grad_norm = grad_norm.full_tensor()
        if debug.fault_rank in (-1, self.rank):
            if self.step == debug.sleep_at_step:
                time.sleep(debug.sleep_s)
            if self.step == debug.die_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
        applied = self._agree(torch.isfinite(total + grad_norm))
        # A non-finite loss or gradient would poison the weights and Adam's moments: drop the gradients instead.
        # The LR schedule does not advance either: it counts applied updates, as if this batch had not come.
        if applied:
            self.optimizer.step()
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=not self.cuda_graphs)
        return total, grad_norm, data_time, applied

    def evaluate(self) -> float:
        import torch

        state = self.eval_loader.state_dict()  # every evaluation reads the same held-out batches
        self.model.eval()
        total = torch.zeros((), device=self.device)
        with torch.no_grad(), self._autocast():
            for _ in range(self.config.training.eval_batches):
                inputs, labels = (t.to(self.device) for t in next(self.eval_loader))
                if self.cuda_graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                total += self.loss_fn(self.model(inputs), labels)
        self.model.train()
        self.eval_loader.load_state_dict(state)
        return self._mean_over_ranks(total / self.config.training.eval_batches).item()

    def train(self) -> int:
        """Train to `training.steps`; returns the exit status (0, or 128 + signal number when stopped by one)."""
        import torch

        from nsa_models.flops import flops_per_token
        from nsa_training.metrics import memory_gib, nsa_metrics, peak_tflops
        from parallelisms import compile_counters

        cfg = self.config.training
        tokens_per_step = cfg.global_batch_tokens
        self._print(f"training {cfg.steps} steps of {tokens_per_step:,} tokens "
                    f"({self.grad_accum} micro-batches of {cfg.micro_batch_size} x {self.config.data.seq_len} "
                    f"per rank), run_dir {self.run_dir}")
        # Model FLOPs per device per step, for perf/tflops; MFU divides by the bf16 peak (an fp32 run reads low).
        flops_per_step = (flops_per_token(self.config.model, self.config.data.seq_len).total * tokens_per_step
                          / self.world_size)
        peak = peak_tflops(self.device)
        if peak is None and self.rank == self.config.metrics.log_rank:
            name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else self.device.type
            print(f"warning: no peak TFLOP/s known for device {name!r} (nsa_training/metrics.py PEAK_BF16_TFLOPS): "
                  "perf/mfu is not logged", file=sys.stderr, flush=True)
        profiler = self._profiler()
        window_start, window_steps, data_time = time.perf_counter(), 0, 0.0
        debug, first_step = self.config.debug, self.step + 1
        with (self.stop, HangWatchdog(debug.hang_timeout_s, self.run_dir, self.rank) as watchdog,
              ReportFailures(self.rank, self.step, debug.init_timeout_s, debug.collective_timeout_s,
                             self.memory) as failures):
            while self.step < cfg.steps and not self.stop_signum:
                self.step += 1
                loss, grad_norm, step_data_time, applied = self.train_step()
                window_steps += 1
                data_time += step_data_time
                self.skipped_in_a_row = 0 if applied else self.skipped_in_a_row + 1
                self.skipped_steps += not applied
                if profiler is not None:
                    profiler.step()
                if self.step == 2 and self.config.compile.enable:
                    counts = compile_counters()
                    if not self.cuda_graphs:  # nothing to capture: a 0 would read as "all captured"
                        del counts["cudagraph_skips"]
                    self._print("compile: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
                    self.metrics.log(self.step, {f"compile/{k}": float(v) for k, v in counts.items()})
                if self.metrics.should_log(self.step) or not applied:  # a skipped step always gets its line
                    loss = self._mean_over_ranks(loss).item()  # .item() syncs: timings below cover the device work
                    elapsed = (time.perf_counter() - window_start) / window_steps
                    allocated, reserved = memory_gib(self.device)
                    tflops = flops_per_step / elapsed / 1e12
                    self.metrics.log(self.step, {
                        "train/loss": loss, "train/lr": self.lr_scheduler.get_last_lr()[0],
                        "train/grad_norm": grad_norm.item(), "train/skipped_steps": self.skipped_steps,
                        "perf/tokens_per_s": tokens_per_step / elapsed, "perf/step_time_s": elapsed,
                        "perf/data_time_s": data_time / window_steps, "perf/tflops": tflops,
                        **({"perf/mfu": tflops / peak} if peak else {}),
                        "memory/max_allocated_gib": allocated, "memory/max_reserved_gib": reserved})
                    window_start, window_steps, data_time = time.perf_counter(), 0, 0.0
                if self.skipped_in_a_row >= cfg.max_skipped_steps:
                    raise TrainingDiverged(
                        f"step {self.step}: loss or gradient norm not finite for {self.skipped_in_a_row} steps in a "
                        f"row (training.max_skipped_steps = {cfg.max_skipped_steps}); latest checkpoint "
                        f"{self._latest_checkpoint()}: rerun to resume from it, e.g. with a lower optimizer.lr")
                if self.config.model.attention == "nsa" and self.metrics.should_log_nsa(self.step):
                    # Computed in every forward inside the compiled graph; reading it is this step's one extra sync.
                    scalars, histograms = nsa_metrics(self.model.nsa_stats.tolist())
                    self.metrics.log(self.step, scalars)
                    self.metrics.log_histograms(self.step, histograms)
                if self.eval_loader is not None and self.step % cfg.eval_interval == 0:
                    self.metrics.log(self.step, {"eval/loss": self.evaluate()})
                if applied:  # never checkpoint right after a non-finite step: resume from the last good one
                    self.checkpointer.save(self.step, self.states,
                                           final=self.step == cfg.steps or bool(self.stop_signum))
                watchdog.beat(self.step)
                failures.beat(self.step)
                if self.memory is not None:
                    self.memory.after_step(self.step)
                if self.step == first_step:  # compilation and the first checkpoint load are over: fail fast now
                    self._set_collective_timeout(debug.collective_timeout_s)
        if profiler is not None:
            profiler.stop()
        self.metrics.close()
        if self.stop_signum:
            self._print(f"stopped by {signal.Signals(self.stop_signum).name} at step {self.step}; checkpoint "
                        f"{self._latest_checkpoint()}; resume with the same command")
        else:
            if self.config.checkpoint.export_weights:
                self.checkpointer.export_weights(self.model, self.run_dir / "model.pt")
            self._print(f"done: {self.step} steps; run_dir {self.run_dir}")
        torch.distributed.destroy_process_group()
        # Stopped: not 0, the run is unfinished; schedulers and torchrun read 128 + signal as "killed by it".
        return 128 + self.stop_signum if self.stop_signum else 0

    def _latest_checkpoint(self) -> str:
        complete = self.checkpointer.complete_checkpoints()
        return str(complete[-1]) if complete else "none"

    def _profiler(self):
        import torch

        p = self.config.profiling
        if not p.enable:
            return None
        wait = max(0, p.start_step - self.step - 1)
        profiler = torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=wait, warmup=0, active=p.num_steps, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.run_dir / "profile"),
                                                                    worker_name=f"rank{self.rank}"),
            record_shapes=True, profile_memory=True, with_stack=False)
        profiler.start()
        return profiler


def cross_entropy(logits, labels):
    """Mean next-token loss, computed in fp32 whatever the compute dtype."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
