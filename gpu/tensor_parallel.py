"""Tensor parallelism: which shard of each layer a rank holds, and the collectives.

A model split over ``world_size`` ranks (one process and one device each, see
gpu/tp_worker.py) holds on every rank:

- column-parallel ``qkv_proj`` and ``gate_up_proj``: this rank's query, key and
  value heads and its slice of the intermediate size (no communication);
- row-parallel ``o_proj`` and ``down_proj``: the matching slice of their inputs,
  so each rank's output is a partial sum, added up over the ranks (``reduce``);
- the vocabulary-parallel embedding and lm_head: a slice of the vocabulary
  (padded so that every rank's slice has one size); the embedding looks up the
  ids in its slice and the ranks' lookups are summed, the logits of the slices
  are gathered (``gather_columns``) so that every rank samples from the whole
  vocabulary and gets the same token;
- the KV cache of its own KV heads only.

``TensorParallel.single()`` (one rank) is what every model outside tensor
parallelism holds: its collectives are the identity and cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trio_llm.gpu.errors import ModelLoadError

if TYPE_CHECKING:
    from trio_llm.gpu.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """One rank's place in a tensor-parallel group.

    ``group`` is the torch.distributed process group (None with one rank).
    ``fixed_order_reduce``: sum the partial results by gathering them and adding
    them in rank order, so that every element is summed in the same order whatever
    the tensor's size (a ring all-reduce assigns elements to chunks by their place
    in the tensor, so with more than two ranks a row's sum order would depend on
    the batch, and the CPU path's batch invariance with it). Chosen on the CPU,
    where it costs little; on CUDA the all-reduce is NCCL's.
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None
    fixed_order_reduce: bool = True

    @classmethod
    def single(cls) -> TensorParallel:
        return cls()

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    # -- shards ----------------------------------------------------------------------

    def split(self, size: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of ``size`` units of ``what``."""
        if size % self.world_size:
            raise ModelLoadError(f"tensor parallelism {self.world_size} needs {what} "
                                 f"({size}) to be a multiple of {self.world_size}")
        length = size // self.world_size
        return self.rank * length, length

    def padded_split(self, size: int) -> tuple[int, int]:
        """(start, length) of this rank's share of ``size`` rounded up to a multiple of
        the world size; the last shard may reach past ``size`` (padding rows)."""
        length = -(-size // self.world_size)
        return self.rank * length, length

    # -- collectives -----------------------------------------------------------------

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of each rank's ``partial``, on every rank."""
        if not self.is_parallel:
            return partial
        if not self.fixed_order_reduce:
            dist.all_reduce(partial, group=self.group)
            return partial
        parts = self._all_gather(partial)
        total = parts[0]  # a view of the gathered buffer, which is ours to overwrite
        for part in parts[1:]:
            total += part
        return total

    def sum_exact(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks where at most one rank holds a non-zero in each
        element (the embedding's lookups): exact in any order, so one all-reduce."""
        if self.is_parallel:
            dist.all_reduce(partial, group=self.group)
        return partial

    def gather_columns(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's ``shard`` [rows, n] side by side: [rows, world_size * n]."""
        if not self.is_parallel:
            return shard
        return self._all_gather(shard).permute(1, 0, 2).reshape(shard.shape[0], -1)

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's ``value`` (the KV blocks every rank can hold)."""
        if not self.is_parallel:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` [rows, n], stacked: [world_size, rows, n] (one
        collective into one buffer, on gloo and NCCL alike)."""
        gathered = tensor.new_empty((self.world_size * tensor.shape[0], *tensor.shape[1:]))
        _all_gather_single(gathered, tensor.contiguous(), group=self.group)
        return gathered.view(self.world_size, *tensor.shape)


# torch 2.13 renamed all_gather_into_tensor (and deprecated the old name); the CUDA
# image's torch may predate the new one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def check_divisible(config: ModelConfig, world_size: int) -> None:
    """Refuse, naming the size at fault, a model that ``world_size`` ranks cannot split."""
    parallel = TensorParallel(rank=0, world_size=world_size)
    for size, what in config.tensor_parallel_sizes():
        parallel.split(size, what)
