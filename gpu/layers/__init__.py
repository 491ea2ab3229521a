"""The layers model families compose: linear, norm, rotary, attention, MLP, MoE.

Each layer has its reference ``forward`` (torch operations: what the model
computes) and, where kernels fuse its small operations, ``fused(..., ops)``:
the same math through a FusedOps (layers/fused_ops.py), Triton's on CUDA,
numba's on the CPU.
"""
