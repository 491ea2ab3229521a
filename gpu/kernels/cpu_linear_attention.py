"""The gated delta rule's recurrence on the CPU: one numba kernel for a sequence's tokens.

gpu/layers/linear_attention.py prepares the inputs in torch (l2-normed and scaled
queries and keys, repeated to the value heads; the decay's exponential and beta)
and hands this kernel the token loop, which in torch operations costs a dozen
calls a token and layer. Each head's state [key dim, value dim] is updated token
by token: decayed, the delta (value minus what the state recalls for the key,
times beta) written at the key, and read by the query.

Every sum runs over the key dimension in index order, compiled without fast-math
flags: a token's result depends on its sequence's earlier tokens only, never on
which sequences share the step or where its prompt was cut into chunks (the
layer's batch and chunk invariance).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

_kernel = numba.njit(boundscheck=False, error_model="numpy", cache=True, nogil=True)


@_kernel
def _recurrence(query: np.ndarray, key: np.ndarray, value: np.ndarray, decay: np.ndarray,
                beta: np.ndarray, state: np.ndarray, out: np.ndarray) -> None:
    """query/key [tokens, heads, key dim], value/out [tokens, heads, value dim],
    decay (already exponentiated)/beta [tokens, heads], state [heads, key dim, value dim];
    all float32, state updated in place."""
    num_tokens, num_heads, key_dim = query.shape
    value_dim = value.shape[2]
    delta = np.empty(value_dim, dtype=np.float32)
    for token in range(num_tokens):
        for head in range(num_heads):
            factor = decay[token, head]
            for row in range(key_dim):
                for column in range(value_dim):
                    state[head, row, column] *= factor
            for column in range(value_dim):
                delta[column] = 0.0
            for row in range(key_dim):
                weight = key[token, head, row]
                for column in range(value_dim):
                    delta[column] += state[head, row, column] * weight
            strength = beta[token, head]
            for column in range(value_dim):
                delta[column] = (value[token, head, column] - delta[column]) * strength
            for row in range(key_dim):
                weight = key[token, head, row]
                for column in range(value_dim):
                    state[head, row, column] += weight * delta[column]
            for column in range(value_dim):
                out[token, head, column] = 0.0
            for row in range(key_dim):
                weight = query[token, head, row]
                for column in range(value_dim):
                    out[token, head, column] += state[head, row, column] * weight


def gated_delta_recurrence(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           decay: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor) -> torch.Tensor:
    """The outputs [tokens, heads, value dim] of the recurrence over float32 CPU tensors
    (see ``_recurrence``); ``state`` (a contiguous slot of a layer's StateCache) is
    updated in place: ``numpy()`` shares its memory, never copies it."""
    # contiguous, as warm_up's: one compiled signature
    out = torch.empty(value.shape, dtype=torch.float32)
    inputs = [tensor.contiguous().numpy() for tensor in (query, key, value, decay, beta)]
    _recurrence(*inputs + [state.numpy(), out.numpy()])
    return out


def warm_up() -> None:
    """Compile the kernel (or load it from numba's disk cache) before the first step."""
    shape = (1, 1, 1)
    gated_delta_recurrence(torch.zeros(shape), torch.zeros(shape), torch.zeros(shape),
                           torch.ones(1, 1), torch.zeros(1, 1), torch.zeros(shape))
