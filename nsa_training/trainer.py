"""The trainer: everything one rank does for a run, from the resolved config to the exit status.

`Trainer(config)` builds the run in named steps, in the order TorchTitan uses: devices and process group, data,
model (on meta -> parallelisms -> materialise + init), optimizer, resume, run directory and metrics. Nothing in the
run directory changes until every step that can refuse the start has passed. `train()` runs the loop:
`_gradients`, `_settle` (the previous step: `nsa_training.outcome`), `_update`, `evaluate`, checkpoint, and
`_finish`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nsa_models.args import ModelArgs, resumable_keys
from nsa_models.flops import flops_per_token
from nsa_models.model import Transformer, document_alignment
from nsa_models.nsa import check_backend
from nsa_models.telemetry import nsa_metrics
from nsa_training.checkpoint import CheckpointManager, ModelState, OptimizerState, RankLocalState, RNGState
from nsa_training.config import Config, ConfigError, TrainingConfig, config_to_dict, config_to_toml, load_config
from nsa_training.data import build_data_loader
from nsa_training.exit_codes import DIVERGED_EXIT_CODE, OOM_EXIT_CODE
from nsa_training.loaders import IGNORE_INDEX
from nsa_training.metrics import MetricLogger, available_memory, estimate_memory, memory_scalars, peak_tflops
from nsa_training.optim import apply_optimizer_config, build_lr_scheduler, build_optimizer
from nsa_training.outcome import PendingOutcome, StepOutcome
from nsa_training.passkey import (
    HEAT_MAP_TAG,
    depths,
    evaluate_passkey,
    filler_tokens,
    heat_map,
    passkey_lengths,
    passkey_sample,
    passkey_scalars,
)
from nsa_training.watchdog import (
    HangWatchdog,
    MemorySnapshots,
    ReportFailures,
    RunFailed,
    StopOnSignal,
    enable_flight_recorder,
    out_of_memory_advice,
)
from parallelisms import (
    CUDA_GRAPH_MODES,
    PlanError,
    build_mesh,
    check_plan,
    compile_counters,
    compile_loss,
    parallelize,
    prepare_micro_batch,
    resolve_compile_mode,
    shard_sequence,
)

VOCAB_MULTIPLE = 64  # model.vocab_size = 0 rounds the tokenizer's vocabulary up to this: tensor-core friendly GEMMs


def check_log_rank(config: Config, world_size: int) -> None:
    """A log rank that no process has would print nothing at all: refuse it."""
    if config.metrics.log_rank >= world_size:
        raise ConfigError(f"metrics.log_rank = {config.metrics.log_rank} names no rank of this run's {world_size} "
                          f"(0 to {world_size - 1}): set metrics.log_rank below {world_size}")


def grad_accum_steps(config: Config, dp_size: int) -> int:
    """Micro-batches per optimizer step on each of `dp_size` data-parallel ranks (the launcher checks it too)."""
    cfg = config.training
    per_step = cfg.micro_batch_size * config.data.seq_len * dp_size
    if cfg.global_batch_tokens % per_step:
        raise ConfigError(f"training.global_batch_tokens = {cfg.global_batch_tokens} is not a multiple of "
                          f"micro_batch_size x seq_len x data-parallel ranks = {per_step}: pick a multiple")
    return cfg.global_batch_tokens // per_step


def attention_line(model: ModelArgs) -> str:
    """The start-up line that names the attention kernels the run uses, e.g. `attention: nsa, backend triton
    (window flex, compressed triton)`: what ran is in the log, not only in the config."""
    if model.attention != "nsa":
        return f"attention: {model.attention}"
    nsa = model.nsa
    if nsa.backend == "reference":  # one vectorised PyTorch implementation of every branch
        return "attention: nsa, backend reference"
    return (f"attention: nsa, backend {nsa.backend} (window {nsa.window_backend}, compressed {nsa.cmp_backend}"
            + (f", selected {nsa.selected_kernels}" if nsa.selected_kernels != "triton" else "")
            + (", float atomics" if nsa.float_atomics else "") + ")")


def evaluates_at(step: int, cfg: TrainingConfig) -> bool:
    """Whether step `step` evaluates: every `eval_interval` steps and, so that every run with evaluation on ends
    with an eval loss (a run shorter than the interval included), its last step; never with `eval_interval` 0."""
    return cfg.eval_interval > 0 and (step % cfg.eval_interval == 0 or step == cfg.steps)


class TrainingDiverged(RunFailed):
    """`training.max_skipped_steps` steps in a row had a non-finite loss or gradient norm."""

    def __init__(self, message: str) -> None:
        super().__init__(message, DIVERGED_EXIT_CODE)


def build_model(model_args: ModelArgs, device: torch.device, apply_plan: Callable[[Transformer], object]
                ) -> Transformer:
    """The model as `apply_plan` (parallelize) wraps and shards it, with only this rank's shards allocated on
    `device`: built on meta, planned, materialised, then initialised. `Transformer.init_weights` draws every
    parameter whole, so each plan and process count starts from the weights one process draws from the seed."""
    with torch.device("meta"):
        model = Transformer(model_args)
    apply_plan(model)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    return model


class Trainer:
    """Everything one rank needs for a run; see the module docstring for the order of the steps."""

    def __init__(self, config: Config):
        self.config = config
        self.run_dir = Path(config.job.run_dir)
        self.device = self._pick_device(config.training.device)
        self.rank, self.world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        check_log_rank(config, self.world_size)  # the launcher checks it too; a plain `python train.py` has no launcher
        if config.debug.deterministic:
            # cuBLAS is deterministic only with a fixed workspace: without this variable, use_deterministic_algorithms
            # makes the first CUDA matmul raise. Set before anything creates a cuBLAS handle.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)  # also inductor's deterministic mode: no autotuning by timing
            torch.backends.cudnn.benchmark = False
        self._build_process_group()
        torch.manual_seed(config.training.seed)
        # Recording starts before the model is built: the snapshot shows parameters, gradients and optimizer state.
        self.memory = (MemorySnapshots(self.run_dir, self.rank, self.device, config.debug.memory_snapshot_step)
                       if config.debug.memory_snapshot else None)
        mixed = config.training.mixed_precision
        self.compute_dtype = (torch.bfloat16 if mixed == "bf16" or (mixed == "auto" and self.device.type == "cuda")
                              else torch.float32)
        self._build_data()
        self._check_nsa_backend()
        self._check_memory()
        self.model = self._build_model()
        self._build_optimizer()
        self._resume()
        self._write_run_dir()
        self.stop = StopOnSignal()
        self.stop_signum = 0  # a signal received by any rank, as agreed by all ranks (see _agree_on_stop)
        self.metrics = MetricLogger(config.metrics, self.run_dir, rank=self.rank, total_steps=config.training.steps,
                                    config_text=config_to_toml(config), start_step=self.step)

    # -- devices and process group ------------------------------------------------------------------------------

    def _pick_device(self, choice: str) -> torch.device:
        if choice == "cuda" and not torch.cuda.is_available():
            raise ConfigError("training.device = 'cuda' but no CUDA GPU is visible: run on a GPU machine or set "
                              "--training.device cpu")
        if choice == "cpu" or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))

    def _build_process_group(self) -> None:
        config = self.config
        capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        config.compile = resolve_compile_mode(config.compile, device_type=self.device.type,
                                              data_parallel=config.parallelism.data_parallel,
                                              world_size=self.world_size)
        try:
            check_plan(config.parallelism, config.activation_checkpoint, config.compile, config.float8,
                       world_size=self.world_size, device_type=self.device.type, gpu_capability=capability)
        except PlanError as e:
            raise ConfigError(str(e)) from None
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
        # The ranks and sizes of every part of the run (data, gradient accumulation, FSDP / DDP, CP) come from here.
        self.parallel_dims = build_mesh(config.parallelism, self.world_size, self.device.type)
        self._set_collective_timeout(config.debug.init_timeout_s)  # the mesh's own groups got torch's default

    def _set_collective_timeout(self, seconds: float) -> None:
        """Timeout of every later collective, in the default group and the mesh's groups (FSDP's, HSDP's, CP's)."""
        groups = {dist.group.WORLD, *self.parallel_dims.groups()}
        for group in groups:
            group.set_timeout(timedelta(seconds=seconds))  # every backend of the group: NCCL and gloo

    # -- data ---------------------------------------------------------------------------------------------------

    def _build_data(self) -> None:
        """Train and eval loaders, the gradient accumulation, and the model's vocabulary from the tokenizer's."""
        cfg, config = self.config.training, self.config
        # The ranks of one CP group read the same batch (each then keeps its part of the sequence: _next_batch).
        dp_rank, dp_size = self.parallel_dims.dp_rank, self.parallel_dims.dp_size
        self.grad_accum = grad_accum_steps(config, dp_size)
        loader_args = dict(batch_size=cfg.micro_batch_size, dp_rank=dp_rank, dp_world_size=dp_size, seed=cfg.seed,
                           doc_align=document_alignment(config.model))
        self.train_loader = build_data_loader(config.data, split="train", **loader_args)
        self.eval_loader = build_data_loader(config.data, split="eval", **loader_args) if cfg.eval_interval else None
        self._resolve_vocab_size(self.train_loader.tokenizer.vocab_size)
        # Held-out text for the passkey haystacks, read once: every evaluation scores the same samples.
        self.passkey_filler = None
        if config.passkey.enable:
            self.passkey_filler = filler_tokens(self.eval_loader, config.data.seq_len + 1)
            key = "0" * config.passkey.key_digits  # the shortest sample must hold needle and question: fail now
            passkey_sample(self.train_loader.tokenizer, self.passkey_filler, config.passkey.min_length, 0.0, key)

    def _resolve_vocab_size(self, tokenizer_vocab: int) -> None:
        """model.vocab_size = 0 becomes the tokenizer's vocabulary rounded up to VOCAB_MULTIPLE (the saved config
        records the number); a set value must hold every token id."""
        model = self.config.model
        if model.vocab_size == 0:
            model.vocab_size = -(-tokenizer_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        elif model.vocab_size < tokenizer_vocab:
            raise ConfigError(f"model.vocab_size = {model.vocab_size} is smaller than the tokenizer's vocabulary "
                              f"({tokenizer_vocab}, data.tokenizer = {self.config.data.tokenizer!r}): raise it, or "
                              "set 0 to follow the tokenizer")

    def _check_memory(self) -> None:
        """Refuse, in one line, a run whose estimated memory per rank exceeds what this device has free: on CPU the
        kernel's out-of-memory killer would end it later without a word."""
        c = self.config
        try:  # sizes without allocating: a one-block model on meta, its block counted n_layers times
            with torch.device("meta"):
                one_block = Transformer(dataclasses.replace(c.model, n_layers=1))
        except RuntimeError as e:  # sizes whose tensors no storage can hold ("Storage size calculation overflowed")
            raise ConfigError(f"the model (flavor {c.model.flavor!r}) cannot be built with these sizes ({e}): lower "
                              "model.dim, model.vocab_size or model.max_seq_len") from None
        block, more_blocks = one_block.layers["0"], c.model.n_layers - 1
        n_params = (sum(p.numel() for p in one_block.parameters())
                    + more_blocks * sum(p.numel() for p in block.parameters()))
        buffer_bytes = (sum(b.numel() * b.element_size() for b in one_block.buffers())
                        + more_blocks * sum(b.numel() * b.element_size() for b in block.buffers()))
        dims = self.parallel_dims
        # FSDP shards over the data-parallel and CP ranks of a replica; each rank holds 1 / cp of every sequence.
        shards = 1 if dims.world_mesh is None or c.parallelism.data_parallel == "ddp" else dims.dp_shard * dims.cp
        tokens = c.training.micro_batch_size * c.data.seq_len // dims.cp
        need = estimate_memory(c.model, n_params, tokens, shards=shards, compute_bytes=self.compute_dtype.itemsize,
                               ac=c.activation_checkpoint, buffer_bytes=buffer_bytes)
        free, where = available_memory(self.device)
        if free is not None and need.total > free:
            raise RunFailed(f"out of memory before the start: {c.model.flavor} at {c.training.micro_batch_size} x "
                            f"{c.data.seq_len} tokens per micro-batch needs about {need} per rank, but {where} has "
                            f"{free / 2**30:.1f} GiB free; "
                            f"{out_of_memory_advice(c, self.device.type, self.world_size)}", OOM_EXIT_CODE)

    # -- model --------------------------------------------------------------------------------------------------

    def _check_nsa_backend(self) -> None:
        """The chosen NSA backend must be able to run here: no silent fallback to another one."""
        if self.config.model.attention != "nsa":
            return
        try:
            check_backend(self.config.model.nsa, self.device, self.compute_dtype)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _build_model(self) -> torch.nn.Module:
        try:
            model = build_model(self.config.model, self.device, lambda m: parallelize(
                m, self.config.parallelism, self.config.activation_checkpoint, self.config.compile,
                self.config.float8, self.parallel_dims, self.compute_dtype))
        except PlanError as e:  # float8 with nothing to convert
            raise ConfigError(str(e)) from None
        model.train()
        n_params = sum(p.numel() for p in model.parameters())
        dims = self.parallel_dims
        layout = f" ({dims.dp_size} data-parallel x {dims.cp} context-parallel)" if dims.cp > 1 else ""
        self._print(f"model {self.config.model.flavor}: {n_params / 1e6:.2f}M parameters on {self.world_size} "
                    f"rank(s){layout}, {self.device.type}, compute {str(self.compute_dtype).removeprefix('torch.')}"
                    + (f", compile mode {self.config.compile.mode}" if self.config.compile.enable else ""))
        self._print(attention_line(self.config.model))
        return model

    # -- optimizer ----------------------------------------------------------------------------------------------

    def _build_optimizer(self) -> None:
        """The loss function, AdamW and its LR schedule."""
        config = self.config
        self.loss_fn = compile_loss(cross_entropy, config.compile) if config.compile.enable else cross_entropy
        self.cuda_graphs = config.compile.enable and config.compile.mode in CUDA_GRAPH_MODES
        if self.cuda_graphs:
            # A first backward would adopt its CUDA graph's output buffers as the .grad tensors, and the next
            # micro-batch's replay would overwrite them: accumulate into gradients of our own, zeroed in place.
            for p in self.model.parameters():
                p.grad = torch.zeros_like(p)
        self.optimizer = build_optimizer(self.model, config.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.lr_scheduler, config.training.steps)

    # -- resume -------------------------------------------------------------------------------------------------

    def _resume(self) -> None:
        """Load the latest checkpoint (or checkpoint.load_path), if any, and reconcile the settings that changed
        since it was written: model keys are refused, everything else runs as the current config says and is
        named in the one `resumed from` line."""
        self.checkpointer = CheckpointManager(self.config.checkpoint, self.run_dir)
        self.states = {"model": ModelState(self.model), "optimizer": OptimizerState(self.model, self.optimizer),
                       "lr_scheduler": self.lr_scheduler, "data": RankLocalState(self.train_loader),
                       "rng": RankLocalState(RNGState())}
        self.step = 0
        self.skipped_steps = self.skipped_in_a_row = 0
        path = self.checkpointer.resume_path()
        if path is None:
            return
        changed = self._changed_settings(path)
        self.step = self.checkpointer.load(path, self.states)
        next_lr = self.optimizer.param_groups[0]["lr"]  # what the checkpoint's own settings would use next
        apply_optimizer_config(self.optimizer, self.lr_scheduler, self.config.optimizer)
        line = f"resumed from {path} at step {self.step}"
        if changed:
            line += "; changed since, applied: " + ", ".join(changed)
        new_lr = self.optimizer.param_groups[0]["lr"]
        if f"{new_lr:.2e}" != f"{next_lr:.2e}":
            line += f"; the LR of step {self.step + 1} is {new_lr:.2e} (the checkpoint's settings: {next_lr:.2e})"
        if self.step >= self.config.training.steps:
            line += (f"; nothing left to train (training.steps = {self.config.training.steps}): raise it to train "
                     "on, the LR schedule is then recomputed for the new length")
        self._print(line)

    def _changed_settings(self, checkpoint: Path) -> list[str]:
        """`key old -> new` for every setting that differs from the config of the run that wrote `checkpoint`
        (`config.toml` beside its `checkpoints/`); ConfigError for a changed model key when resuming this run."""
        saved = checkpoint.parent.parent / "config.toml"
        try:
            previous = config_to_dict(load_config([str(saved)])[0])
        except ConfigError:  # a run_dir written before config.toml existed, or by another version: nothing to say
            return []
        current = config_to_dict(self.config)
        changed = [key for key, value in current.items() if key in previous and previous[key] != value
                   and not key.startswith(("job.", "checkpoint."))]
        key = "parallelism.context_parallel_degree"
        if key in changed:  # as many ranks, other data-parallel ranks: no rank's saved data position fits
            raise ConfigError(f"{key} = {current[key]} differs from the {previous[key]} that {checkpoint} was saved "
                              "with, so each rank's data position has no counterpart: set it back, or start a new "
                              "job.run_dir")
        if not self.config.checkpoint.load_path:  # the same run: its model is the checkpoint's
            # A model key marked RESUMABLE (nsa_models.args) chooses how the model computes, not what: it may change.
            # Any other changed model key names another model than the checkpoint's, and the start is refused.
            resumable = {f"model.{key}" for key in resumable_keys()}
            for key in changed:
                if key.startswith("model.") and key not in resumable:
                    raise ConfigError(f"{key} = {current[key]!r} differs from the {previous[key]!r} this run was "
                                      f"trained with ({saved}): set it back to resume, or start a new job.run_dir")
        return [f"{key} {previous[key]!r} -> {current[key]!r}" for key in changed]

    # -- run directory ------------------------------------------------------------------------------------------

    def _write_run_dir(self) -> None:
        """The resolved config into `<run_dir>/config.toml`, once every check that can refuse the start passed: a
        start that fails leaves an existing run as it was."""
        if self.rank == 0:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                (self.run_dir / "config.toml").write_text(config_to_toml(self.config))
            except OSError as e:
                raise ConfigError(f"job.run_dir = {str(self.run_dir)!r} is not writable ({e.strerror}): "
                                  "choose another directory") from None
        dist.barrier()

    # -- the step -----------------------------------------------------------------------------------------------

    def _autocast(self):
        # FSDP2 casts parameters itself (MixedPrecisionPolicy); DDP and one process use autocast.
        fsdp = self.parallel_dims.world_mesh is not None and self.config.parallelism.data_parallel != "ddp"
        if self.compute_dtype == torch.float32 or fsdp:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _print(self, message: str) -> None:
        if self.rank == self.config.metrics.log_rank:
            print(message, flush=True)

    def _mean_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(value, op=dist.ReduceOp.AVG)
        return value

    def _agree_on_stop(self) -> int:
        """The number of a signal received by any rank, 0 for none: the same on every rank, or the ranks would drift
        apart or deadlock in the next collective. A CPU tensor's all-reduce (gloo): no device sync."""
        received = torch.tensor([self.stop.received])
        if self.world_size > 1:
            dist.all_reduce(received, op=dist.ReduceOp.MAX)
        return int(received[0])

    def _next_batch(self, loader) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The loader's next (inputs, labels, doc_start) on this device; doc_start None without data.document_mask.
        With CP, this rank's part of the sequence of inputs and labels (the model adds their positions)."""
        inputs, labels, *doc_start = (t.to(self.device, non_blocking=True) for t in next(loader))
        if self.parallel_dims.cp > 1:  # no doc_start: check_context_parallel refuses data.document_mask
            cp_mesh = self.parallel_dims.mesh("cp")
            inputs, labels = shard_sequence(inputs, cp_mesh), shard_sequence(labels, cp_mesh)
        return inputs, labels, doc_start[0] if doc_start else None

    def _gradients(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Queue the forward and backward of this step's `grad_accum` micro-batches and the clipping; returns the
        summed loss and the gradient norm (device tensors) and the seconds spent waiting for batches."""
        debug = self.config.debug
        inject_nan = 0 < debug.nan_at_step <= self.step < debug.nan_at_step + debug.nan_steps
        data_time, total = 0.0, torch.zeros((), device=self.device)
        for micro_batch in range(self.grad_accum):
            start = time.perf_counter()
            inputs, labels, doc_start = self._next_batch(self.train_loader)
            data_time += time.perf_counter() - start
            prepare_micro_batch(self.model, self.config.parallelism, micro_batch, self.grad_accum)
            if self.cuda_graphs:  # each micro-batch is a new iteration: its graphs may reuse the last one's memory
                torch.compiler.cudagraph_mark_step_begin()
            with self._autocast():
                loss = self.loss_fn(self.model(inputs, doc_start), labels) / self.grad_accum
            if inject_nan:
                loss = loss * float("nan")
            loss.backward()
            total += loss.detach()
        max_norm = self.config.training.max_grad_norm or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
            grad_norm = grad_norm.full_tensor()
        return total, grad_norm, data_time

    def _update(self, total: torch.Tensor, grad_norm: torch.Tensor, data_time: float) -> PendingOutcome:
        """Queue this step's update and return its outcome, still on its way to the host (`nsa_training.outcome`).

        A non-finite loss or gradient norm on any rank would poison the weights and Adam's moments: then the fused
        AdamW skips the update on the device (`found_inf`, its step counts unchanged), decided from one all-reduce of
        [loss, non-finite] that every rank shares. Call `_settle` for the previous step first: its outcome decides
        the LR this update reads."""
        debug = self.config.debug
        if debug.fault_rank in (-1, self.rank):  # after the previous step's line: the stall or death is this step's
            if self.step == debug.sleep_at_step:
                time.sleep(debug.sleep_s)
            if self.step == debug.die_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
        # [loss, non-finite] averaged over the ranks: any rank's non-finite step makes the flag positive everywhere.
        stats = self._mean_over_ranks(torch.stack([total, (~torch.isfinite(total + grad_norm)).float()]))
        skipped = (stats[1] > 0).float()
        self.stop_signum = self._agree_on_stop()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.found_inf = skipped
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=not self.cuda_graphs)
        # Computed here, only at the steps that log it, from the inputs the step's last forward left: before the next
        # forward replaces (replayed as a CUDA graph, overwrites) them. The rows are a tensor of their own.
        nsa_stats = (self.model.nsa_stats
                     if self.config.model.attention == "nsa" and self.metrics.should_log_nsa(self.step) else None)
        return PendingOutcome(self.step, stats[0], grad_norm, skipped, lr, data_time, nsa_stats)

    def _settle(self) -> StepOutcome | None:
        """Read the pending step's outcome, if any, and do what the host owes it: the LR schedule advances only for
        an applied update (it counts applied updates, as if a skipped batch had not come), the skip counters, its
        log line, and the stop after `training.max_skipped_steps` skipped steps in a row. Returns the latest
        settled step's outcome (None before the first)."""
        if self.pending is None:
            return self.last_outcome
        outcome, self.pending = self.pending.settle(), None
        self.last_outcome = outcome
        if outcome.applied:
            self.lr_scheduler.step()
        self.skipped_in_a_row = 0 if outcome.applied else self.skipped_in_a_row + 1
        self.skipped_steps += not outcome.applied
        self._log_step(outcome)
        max_skipped = self.config.training.max_skipped_steps
        if self.skipped_in_a_row >= max_skipped:
            raise TrainingDiverged(
                f"step {outcome.step}: loss or gradient norm not finite for {self.skipped_in_a_row} steps in a "
                f"row (training.max_skipped_steps = {max_skipped}); latest checkpoint "
                f"{self._latest_checkpoint()}: rerun to resume from it, e.g. with a lower optimizer.lr")
        return outcome

    # -- eval ---------------------------------------------------------------------------------------------------

    def evaluate(self) -> float:
        state = self.eval_loader.state_dict()  # every evaluation reads the same held-out batches
        self.model.eval()
        total = torch.zeros((), device=self.device)
        with torch.no_grad(), self._autocast():
            for _ in range(self.config.training.eval_batches):
                inputs, labels, doc_start = self._next_batch(self.eval_loader)
                if self.cuda_graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                total += self.loss_fn(self.model(inputs, doc_start), labels)
        self.model.train()
        self.eval_loader.load_state_dict(state)
        return self._mean_over_ranks(total / self.config.training.eval_batches).item()

    def _evaluate_passkey(self) -> None:
        """Passkey retrieval at every length and depth of `[passkey]`: scalars and one length x depth image."""
        cfg = self.config.passkey

        def forward(tokens: torch.Tensor) -> torch.Tensor:
            if self.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with self._autocast():
                return self.model(tokens)

        self.model.eval()
        scores = evaluate_passkey(forward, self.train_loader.tokenizer, self.passkey_filler,
                                  passkey_lengths(cfg.min_length, self.config.data.seq_len), depths(cfg.depths),
                                  samples=cfg.samples, key_digits=cfg.key_digits, seed=self.config.training.seed,
                                  device=self.device)
        self.model.train()
        self.metrics.log(self.step, passkey_scalars(scores))
        self.metrics.log_image(self.step, HEAT_MAP_TAG, heat_map(scores, f"passkey accuracy, step {self.step}"))

    # -- the loop -----------------------------------------------------------------------------------------------

    def train(self) -> int:
        """Train to `training.steps`; returns the exit status (0, or 128 + signal number when stopped by one)."""
        cfg = self.config.training
        self._print(f"training {cfg.steps} steps of {cfg.global_batch_tokens:,} tokens "
                    f"({self.grad_accum} micro-batches of {cfg.micro_batch_size} x {self.config.data.seq_len} "
                    f"per rank), run_dir {self.run_dir}")
        self._start_perf_window()
        profiler = self._profiler()
        debug, first_step = self.config.debug, self.step + 1
        self.train_start, self.first_step = time.perf_counter(), first_step
        self.last_train_loss: float | None = None  # the summary's: the last logged step's, and the last evaluation's
        self.last_eval: tuple[int, float] | None = None
        self.compiled: dict[str, int] | None = None  # compile_counters() at the last reading (from the 2nd step)
        self.recorded_again = False  # warned of a CUDA graph recorded again after warm-up
        self.pending: PendingOutcome | None = None  # the step whose outcome the host has not read yet (`_settle`)
        self.last_outcome: StepOutcome | None = None
        with (self.stop, HangWatchdog(debug.init_timeout_s, debug.hang_timeout_s, self.run_dir, self.rank) as watchdog,
              ReportFailures(self.rank, self.step, debug.init_timeout_s, debug.collective_timeout_s, self.memory,
                             out_of_memory_advice(self.config, self.device.type, self.world_size)) as failures):
            while self.step < cfg.steps and not self.stop_signum:
                self.step += 1
                total, grad_norm, data_time = self._gradients()
                self._settle()  # the previous step, now that this one's work is queued behind it
                self.pending = self._update(total, grad_norm, data_time)
                if profiler is not None:
                    profiler.step()
                if self.eval_loader is not None and evaluates_at(self.step, cfg):
                    self._settle()  # its line before the evaluation's (which waits for the device anyway)
                    self.last_eval = self.step, self.evaluate()
                    self.metrics.log(self.step, {"eval/loss": self.last_eval[1]})
                    if self.passkey_filler is not None:
                        self._evaluate_passkey()
                    if self.compiled is not None:
                        self._check_recompiles(expected=True)
                final = self.step == cfg.steps or bool(self.stop_signum)
                if self.checkpointer.due(self.step, final=final):
                    # Never checkpoint right after a non-finite step: resume from the last good one.
                    if self._settle().applied:
                        self.checkpointer.save(self.step, self.states, final=final)
                watchdog.beat(self.step)
                failures.beat(self.step)
                if self.memory is not None:
                    self.memory.after_step(self.step)
                if self.step == first_step:  # compilation and the first checkpoint load are over: fail fast now
                    self._set_collective_timeout(debug.collective_timeout_s)
            self._settle()
        if profiler is not None:
            profiler.stop()
        return self._finish()

    # -- logging ------------------------------------------------------------------------------------------------

    def _start_perf_window(self) -> None:
        """Model FLOPs per device per step (perf/tflops; MFU divides by the bf16 peak, so an fp32 run reads low) and
        the first window of steps that perf/* averages over. MFU is a GPU's measure: a CPU run logs none, quietly;
        a GPU missing from the peak table says so once."""
        # Every sequence counted once (global_batch_tokens), its work shared by all ranks: CP ranks split a
        # sequence as data-parallel ranks split the batch.
        self.flops_per_step = (flops_per_token(self.config.model, self.config.data.seq_len).total
                               * self.config.training.global_batch_tokens / self.world_size)
        self.peak_tflops = peak_tflops(self.device)
        if self.peak_tflops is None and self.device.type == "cuda" and self.rank == self.config.metrics.log_rank:
            print(f"warning: no peak TFLOP/s known for GPU {torch.cuda.get_device_name(self.device)!r} "
                  "(nsa_training/metrics.py PEAK_BF16_TFLOPS): perf/mfu is not logged", file=sys.stderr, flush=True)
        self.window_start, self.window_steps, self.window_data_time = time.perf_counter(), 0, 0.0

    def _log_step(self, outcome: StepOutcome) -> None:
        """Compile counters at this start's second step (then any later rise: `_check_recompiles`), the step's
        scalars every `metrics.log_freq` steps (and every skipped step), NSA telemetry every `metrics.nsa_stats_freq`
        steps. Called when the step settles: perf/* time the steps up to the end of its device work."""
        step = outcome.step
        self.window_steps += 1
        self.window_data_time += outcome.data_time
        # Compiles happen as the host queues a step: by now, this start's second step (self.step) has been queued.
        if self.compiled is None and self.step == self.first_step + 1 and self.config.compile.enable:
            counts = compile_counters()
            if not self.cuda_graphs:  # nothing to capture: a 0 would read as "all captured"
                del counts["cudagraph_skips"], counts["cudagraph_recorded_inputs"]
            self._print("compile: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
            self.metrics.log(self.step, {f"compile/{k}": float(v) for k, v in counts.items()})
            self.compiled = counts
        elif self.compiled is not None:
            self._check_recompiles()
        if self.metrics.should_log(step) or not outcome.applied:  # a skipped step always gets its line
            self.last_train_loss = outcome.loss
            elapsed = (time.perf_counter() - self.window_start) / self.window_steps
            tflops = self.flops_per_step / elapsed / 1e12
            self.metrics.log(step, {
                "train/loss": outcome.loss, "train/lr": outcome.lr,
                "train/grad_norm": outcome.grad_norm, "train/skipped_steps": self.skipped_steps,
                "perf/tokens_per_s": self.config.training.global_batch_tokens / elapsed, "perf/step_time_s": elapsed,
                "perf/data_time_s": self.window_data_time / self.window_steps, "perf/tflops": tflops,
                **({"perf/mfu": tflops / self.peak_tflops} if self.peak_tflops else {}),
                **memory_scalars(self.device)})
            self.window_start, self.window_steps, self.window_data_time = time.perf_counter(), 0, 0.0
        if outcome.nsa_stats is not None:
            scalars, histograms = nsa_metrics(outcome.nsa_stats)
            self.metrics.log(step, scalars)
            self.metrics.log_histograms(step, histograms)

    # -- finish -------------------------------------------------------------------------------------------------

    def _finish(self) -> int:
        """Close the metrics, export the weights of a finished run, leave the process group; the exit status."""
        self.metrics.close()
        if self.stop_signum:
            self._print(f"stopped by {signal.Signals(self.stop_signum).name} at step {self.step}; checkpoint "
                        f"{self._latest_checkpoint()}; resume with the same command")
        else:
            if self.config.checkpoint.export_weights:
                self.checkpointer.export_weights(self.model, self.run_dir / "model.pt")
            self._print(self._summary(time.perf_counter() - self.train_start))
        if self.cuda_graphs:
            # Free the blocks' CUDA graphs first: NCCL communicators whose collectives a live graph captured
            # (context parallelism's all-gathers inside the compiled blocks) hang in ncclCommDestroy
            # (pytorch/pytorch#115388): a 2-GPU DDP + CP run at 131k trained, then never exited.
            torch._dynamo.reset()
        dist.destroy_process_group()
        # Stopped: not 0, the run is unfinished; schedulers and torchrun read 128 + signal as "killed by it".
        return 128 + self.stop_signum if self.stop_signum else 0

    def _check_recompiles(self, expected: bool = False) -> None:
        """After warm-up every compiled graph is a recompile (a failed guard: a new shape, a changed attribute), which
        costs a compile and under CUDA graphs a new recording, every time it happens; a CUDA graph recorded again
        without a recompile means that an input it takes as static moved, and costs a recording at every step where
        it does. One warning line (the first recording only) and the compile/* scalars when the counters rose since
        the last reading. `expected`: an evaluation's own graphs (no_grad, other lengths), counted silently."""
        counts = {k: v for k, v in compile_counters().items() if k in self.compiled}
        rose = [k for k, v in counts.items() if v != self.compiled[k]]
        if rose and not expected:
            rises = ", ".join(f"{k} {self.compiled[k]} -> {counts[k]}" for k in rose)
            if rose != ["cudagraph_recorded_inputs"]:
                self._print(f"warning: step {self.step} compiled again after warm-up ({rises}): run with "
                            "TORCH_LOGS=recompiles to see which guard failed")
            elif not self.recorded_again:
                self.recorded_again = True
                self._print(f"warning: step {self.step} recorded CUDA graphs again after warm-up ({rises}): an input "
                            "they take as static moved; run with TORCH_LOGS=cudagraphs to see which (further "
                            "recordings: compile/cudagraph_recorded_inputs)")
            self.metrics.log(self.step, {f"compile/{k}": float(v) for k, v in counts.items()})
        self.compiled = counts

    def _summary(self, wall_s: float) -> str:
        """The end of a finished run: its last losses, the tokens this process trained and how fast, and where
        its checkpoint, weights and tensorboard events are."""
        c = self.config
        trained = (self.step - self.first_step + 1) * c.training.global_batch_tokens  # this start's steps only
        losses = f"final train loss {self.last_train_loss:.4f}" if self.last_train_loss is not None else ""
        if self.last_eval is not None:
            losses += f", eval loss {self.last_eval[1]:.4f} (step {self.last_eval[0]})"
        weights = self.run_dir / "model.pt"
        lines = [f"done: {self.step} steps; run_dir {self.run_dir}",
                 *([f"  {losses}"] if losses else []),
                 f"  {trained:,} tokens in {wall_s:.1f} s ({trained / max(wall_s, 1e-9):,.0f} tokens/s)",
                 f"  checkpoint {self._latest_checkpoint() if c.checkpoint.enable else 'off (checkpoint.enable)'}",
                 *([f"  weights {weights}"] if c.checkpoint.export_weights else []),
                 f"  tensorboard {self.run_dir / 'tb' if c.metrics.tensorboard else 'off (metrics.tensorboard)'}"]
        return "\n".join(lines)

    def _latest_checkpoint(self) -> str:
        complete = self.checkpointer.complete_checkpoints()
        return str(complete[-1]) if complete else "none"

    def _profiler(self) -> torch.profiler.profile | None:
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


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over the labelled tokens (padding, IGNORE_INDEX, skipped), in fp32 whatever the compute
    dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
