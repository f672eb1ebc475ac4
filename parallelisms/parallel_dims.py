"""The run's process layout (`ParallelDims`): how many ranks replicate, shard and split the sequence, and the one
DeviceMesh with those named dimensions that every part of the run asks for its ranks, sizes and groups."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallelisms.config import ParallelismConfig, PlanError

# Flattened views of the mesh: the data-parallel ranks (each reads its own batch), the ranks FSDP shards over (CP
# ranks hold the same parameters and each computes gradients from part of the sequence, so they shard and reduce
# with the data-parallel ranks, as TorchTitan does), and all of them (DDP's replicas).
_FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
              "dp_cp": ("dp_replicate", "dp_shard", "cp")}


@dataclass
class ParallelDims:
    """world_size = dp_replicate x dp_shard x cp, validated at construction (`from_config` says which key is wrong).

    Ranks are laid out row-major in that order, cp innermost: the ranks of one CP group, which all-gather every
    layer's keys and values, are neighbours (one node). DDP is dp_replicate = data-parallel ranks, FSDP
    dp_shard = them, HSDP both. `build_mesh` makes `world_mesh`; with one process there is none and every rank
    below is 0.
    """

    dp_replicate: int
    dp_shard: int
    cp: int
    world_size: int
    world_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _views: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = (self.dp_replicate, self.dp_shard, self.cp)
        if min(sizes) < 1 or self.dp_replicate * self.dp_shard * self.cp != self.world_size:
            raise PlanError(f"dp_replicate x dp_shard x cp = {' x '.join(map(str, sizes))} must be the world size "
                            f"({self.world_size})")

    @classmethod
    def from_config(cls, cfg: ParallelismConfig, world_size: int) -> ParallelDims:
        """The layout `cfg` asks for on `world_size` ranks; PlanError naming the key that does not fit. With one
        process the data-parallel keys are ignored (nothing to shard)."""
        cp = cfg.context_parallel_degree
        if world_size % cp:
            raise PlanError(f"parallelism.context_parallel_degree = {cp} must divide the world size ({world_size}): "
                            f"set it to a divisor of {world_size}")
        dp = world_size // cp
        if world_size == 1:
            return cls(dp_replicate=1, dp_shard=1, cp=1, world_size=1)
        if cfg.data_parallel == "hsdp":
            if dp % cfg.dp_replicate:
                ranks = (f"the world size ({world_size})" if cp == 1 else f"the data-parallel ranks (the world size "
                         f"{world_size} / context_parallel_degree {cp} = {dp})")
                raise PlanError(f"parallelism.dp_replicate = {cfg.dp_replicate} must divide {ranks}: set it to the "
                                "node count")
            return cls(dp_replicate=cfg.dp_replicate, dp_shard=dp // cfg.dp_replicate, cp=cp, world_size=world_size)
        ddp = cfg.data_parallel == "ddp"
        return cls(dp_replicate=dp if ddp else 1, dp_shard=1 if ddp else dp, cp=cp, world_size=world_size)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each reads its own batch (a CP group reads one)."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Build the mesh ("dp_replicate", "dp_shard", "cp") with its flattened views "dp", "dp_shard_cp" and
        "dp_cp" (needs the default process group); None with one process. Every rank calls it once."""
        if self.world_size > 1:
            mesh = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard, self.cp),
                                    mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
            # Kept: torch deprecates slicing flattened views out of the root mesh.
            self._views = {name: mesh[dims]._flatten(name) for name, dims in _FLATTENED.items()}
            self.world_mesh = mesh
        return self.world_mesh

    def _local_rank(self, dim: str) -> int:
        return 0 if self.world_mesh is None else self.mesh(dim).get_local_rank()

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index (which batch it reads): the same on the ranks of one CP group."""
        return self._local_rank("dp")

    @property
    def cp_rank(self) -> int:
        """This rank's index in its CP group (which chunks of the sequence it holds)."""
        return self._local_rank("cp")

    def mesh(self, *dims: str) -> DeviceMesh:
        """The (sub)mesh of `dims`, e.g. ("cp",) or ("dp_replicate", "dp_shard_cp"); needs several processes."""
        assert self.world_mesh is not None, "no mesh: one process, or build_mesh not called"
        meshes = [self._views[dim] if dim in self._views else self.world_mesh[dim] for dim in dims]
        return meshes[0] if len(meshes) == 1 else DeviceMesh._concatenate(meshes)

    def groups(self) -> list[dist.ProcessGroup]:
        """Every process group of the mesh, flattened views included (each gets the run's collective timeout)."""
        if self.world_mesh is None:
            return []
        return [self.mesh(name).get_group() for name in ("dp_replicate", "dp_shard", "cp", *_FLATTENED)]


def build_mesh(cfg: ParallelismConfig, world_size: int, device_type: str) -> ParallelDims:
    """The layout `cfg` asks for on `world_size` ranks with its mesh built (every rank calls it once, after
    init_process_group; `check_plan` has validated the degrees)."""
    dims = ParallelDims.from_config(cfg, world_size)
    dims.build_mesh(device_type)
    return dims
