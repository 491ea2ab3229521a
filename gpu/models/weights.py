"""Where each checkpoint tensor goes: checkpoint names -> this rank's rows of a parameter.

A family names its tensors through a TargetMap (``whole``, ``vocabulary``,
``column_parallel``, ``row_parallel``); gpu/loader.py reads each tensor's
shard into its Target, and fills dummy weights through the same map.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from trio_llm.gpu.models.config import ModelConfig, MoeConfig
from trio_llm.gpu.tensor_parallel import TensorParallel


@dataclass(frozen=True, slots=True)
class Target:
    """Where one checkpoint tensor goes: rows ``[row_start, row_start + num_rows)`` of a
    model parameter (a fused parameter holds several checkpoint tensors), or of its
    ``expert``-th entry where the parameter stacks every expert's weights.

    ``shape`` is the checkpoint tensor's, checked before its data is read. Under tensor
    parallelism a rank reads only its shard: ``shard_length`` entries from
    ``shard_start`` along ``shard_dim`` (None: the whole tensor). A vocabulary shard may
    reach past the tensor's end: the rows past it are padding and get zeros.
    ``is_zero``: the bias of a row-parallel layer on a rank other than 0, whose partial
    sums must not add it a second time.
    """

    parameter_name: str
    row_start: int
    num_rows: int
    shape: tuple[int, ...]
    shard_dim: int | None = None
    shard_start: int = 0
    shard_length: int = 0
    is_zero: bool = False
    expert: int | None = None
    # (start, length) ranges of rows this rank reads, stacked in this order (a tensor
    # that fuses several head-split parts, each split on its own); () : see shard_dim
    pieces: tuple[tuple[int, int], ...] = ()

    def take(self, tensor: Any) -> Any:
        """This rank's part of ``tensor`` (a torch tensor or a safetensors slice)."""
        if self.pieces:
            return torch.cat([tensor[start:start + length] for start, length in self.pieces])
        if self.shard_dim is None:
            return tensor[:]
        end = min(self.shard_start + self.shard_length, self.shape[self.shard_dim])
        if self.shard_dim == 0:
            return tensor[self.shard_start:end]
        return tensor[:, self.shard_start:end]


def copy_into(parameters: Mapping[str, torch.Tensor], target: Target,
              part: torch.Tensor) -> None:
    """Copy this rank's ``part`` of a checkpoint tensor into its rows of the parameter;
    padding rows past the part's end get zeros."""
    parameter = parameters[target.parameter_name]
    if target.expert is not None:
        parameter = parameter[target.expert]
    destination = parameter[target.row_start:target.row_start + target.num_rows]
    if target.is_zero:
        destination.zero_()
        return
    destination[:part.shape[0]].copy_(part)
    destination[part.shape[0]:].zero_()


# (name within the fused parameter, rows in the checkpoint, what a split divides)
FusedPart = tuple[str, int, str]


class TargetMap:
    """The checkpoint tensors a model needs, each with its Target, built by its family."""

    def __init__(self, parameters: Mapping[str, torch.Tensor], parallel: TensorParallel
                 ) -> None:
        self.parameters = parameters
        self.parallel = parallel
        self.targets: dict[str, Target] = {}

    def _shape(self, parameter_name: str, expert: int | None) -> tuple[int, ...]:
        shape = tuple(self.parameters[parameter_name].shape)
        return shape if expert is None else shape[1:]

    def whole(self, checkpoint_name: str, parameter_name: str) -> None:
        """A tensor every rank holds whole."""
        shape = tuple(self.parameters[parameter_name].shape)
        self.targets[checkpoint_name] = Target(parameter_name, 0, shape[0], shape)

    def rows(self, checkpoint_name: str, parameter_name: str, row_start: int,
             num_rows: int) -> None:
        """A tensor every rank holds whole, as ``num_rows`` rows from ``row_start`` of a
        parameter that stacks it with others (the router, a shared expert's gate)."""
        shape = (num_rows, *self.parameters[parameter_name].shape[1:])
        self.targets[checkpoint_name] = Target(parameter_name, row_start, num_rows, shape)

    def vocabulary(self, checkpoint_name: str, parameter_name: str, *, vocab_size: int,
                   vocab_start: int, num_vocab_rows: int) -> None:
        """The embedding or lm_head: this rank's slice of the vocabulary."""
        shape = (vocab_size, *self.parameters[parameter_name].shape[1:])
        self.targets[checkpoint_name] = Target(parameter_name, 0, num_vocab_rows, shape,
                                               shard_dim=0, shard_start=vocab_start,
                                               shard_length=num_vocab_rows)

    def column_parallel(self, prefix: str, parameter_name: str, parts: list[FusedPart],
                        suffix: str, *, expert: int | None = None) -> None:
        """Fused parts, each split by output rows: this rank's rows of each, stacked."""
        parameter_shape = self._shape(parameter_name, expert)
        row_start = 0
        for part_name, num_rows, what in parts:
            shard_start, shard_length = self.parallel.split(num_rows, what)
            shape = (num_rows, *parameter_shape[1:])
            self.targets[f"{prefix}{part_name}.{suffix}"] = Target(
                parameter_name, row_start, shard_length, shape, shard_dim=0,
                shard_start=shard_start, shard_length=shard_length, expert=expert)
            row_start += shard_length

    def row_parallel(self, checkpoint_name: str, parameter_name: str, num_inputs: int,
                     what: str, *, expert: int | None = None) -> None:
        """A weight split by input columns; its bias is added by rank 0 alone."""
        parameter_shape = self._shape(parameter_name, expert)
        if checkpoint_name.endswith(".bias"):
            self.targets[checkpoint_name] = Target(
                parameter_name, 0, parameter_shape[0], parameter_shape,
                is_zero=self.parallel.rank != 0, expert=expert)
            return
        shard_start, shard_length = self.parallel.split(num_inputs, what)
        self.targets[checkpoint_name] = Target(
            parameter_name, 0, parameter_shape[0], (parameter_shape[0], num_inputs),
            shard_dim=1, shard_start=shard_start, shard_length=shard_length, expert=expert)


def gathered(targets: TargetMap, checkpoint_name: str, parameter_name: str, row_start: int,
             num_checkpoint_rows: int, pieces: list[tuple[int, int]]) -> int:
    """Rows ``pieces`` ((start, length) each) of checkpoint tensor ``checkpoint_name``
    (``num_checkpoint_rows`` rows, the parameter's other dimensions), stacked in that
    order into the parameter from row ``row_start``; returns the rows taken."""
    parameter_shape = tuple(targets.parameters[parameter_name].shape)
    num_rows = sum(length for _, length in pieces)
    targets.targets[checkpoint_name] = Target(
        parameter_name, row_start, num_rows, (num_checkpoint_rows, *parameter_shape[1:]),
        shard_dim=0, shard_length=num_rows, pieces=tuple(pieces))
    return num_rows


def bias_suffixes(has_bias: bool) -> tuple[str, ...]:
    """The checkpoint tensors of a linear layer: its weight, and its bias if it has one."""
    return ("weight", "bias") if has_bias else ("weight",)


INTERMEDIATE = "the intermediate size"


def mlp_targets(targets: TargetMap, hidden_prefix: str, ours: str, intermediate_size: int,
                has_bias: bool) -> None:
    """A SwiGLU MLP's checkpoint tensors ``hidden_prefix`` + gate_proj, up_proj (fused into
    ``ours`` + gate_up_proj, each split by rows) and down_proj (split by columns)."""
    gate_up_parts = [("gate_proj", intermediate_size, INTERMEDIATE),
                     ("up_proj", intermediate_size, INTERMEDIATE)]
    for suffix in bias_suffixes(has_bias):
        targets.column_parallel(hidden_prefix, ours + f"gate_up_proj.{suffix}", gate_up_parts,
                                suffix)
        targets.row_parallel(hidden_prefix + f"down_proj.{suffix}", ours + f"down_proj.{suffix}",
                             intermediate_size, INTERMEDIATE)


def moe_block_targets(targets: TargetMap, ours: str, theirs: str, num_experts: int,
                      intermediate_size: int, names: tuple[str, str, str]) -> None:
    """An MoE block's checkpoint tensors: the router ``theirs`` + gate.weight into the
    first rows of ``ours`` + gate.weight, and every expert's ``theirs`` +
    ``experts.{expert}.{gate}``, ``{up}``, ``{down}`` (``names``) into the stacked
    ``ours`` + experts_gate_up (gate rows, then up rows, each this rank's slice of
    ``intermediate_size``) and experts_down (its columns)."""
    targets.rows(theirs + "gate.weight", ours + "gate.weight", 0, num_experts)
    what = "the experts' intermediate size"
    gate, up, down = names
    for expert in range(num_experts):
        prefix = f"{theirs}experts.{expert}."
        targets.column_parallel(prefix, ours + "experts_gate_up",
                                [(gate, intermediate_size, what), (up, intermediate_size, what)],
                                "weight", expert=expert)
        targets.row_parallel(f"{prefix}{down}.weight", ours + "experts_down", intermediate_size,
                             what, expert=expert)


def moe_or_mlp_targets(targets: TargetMap, config: ModelConfig, layer_index: int, ours: str,
                       theirs: str) -> None:
    """Layer ``layer_index``'s feed-forward tensors (``mlp.``) in the Qwen MoE families:
    the router and experts, or a dense MLP where the config says so (what
    gpu/layers/moe.py's ``moe_or_mlp`` builds)."""
    assert isinstance(config, MoeConfig)
    if not config.is_moe_layer(layer_index):
        mlp_targets(targets, theirs + "mlp.", ours + "mlp.", config.intermediate_size, False)
        return
    moe_block_targets(targets, ours + "mlp.", theirs + "mlp.", config.num_experts,
                      config.moe_intermediate_size, ("gate_proj", "up_proj", "down_proj"))
