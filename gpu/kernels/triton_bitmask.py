"""Grammar token bitmasks applied in place, in one Triton kernel.

The torch version (gpu/sampler.apply_token_bitmasks) expands each row's bits into
int32 tensors 32 times the masks' size and copies the whole batch's logits (at 256
rows of a 152k vocabulary, 64 of them constrained: about 350 MB of device memory
traffic a step). This kernel reads the masks once and writes -inf only where a
token is forbidden, in place; the logits it leaves are the torch version's. What it
saves on the H200 is not separated yet (docs/performance.md, "Structured outputs").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _mask_kernel(logits_ptr, row_stride, rows_ptr, words_ptr, num_words, vocab_size,
                 BLOCK: tl.constexpr):
    index = tl.program_id(0)
    token_ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = token_ids < vocab_size
    words = tl.load(words_ptr + index.to(tl.int64) * num_words + token_ids // 32,
                    mask=in_vocab, other=-1)
    forbidden = ((words >> (token_ids % 32)) & 1) == 0
    row = tl.load(rows_ptr + index).to(tl.int64)
    tl.store(logits_ptr + row * row_stride + token_ids,
             tl.full([BLOCK], float("-inf"), tl.float32), mask=in_vocab & forbidden)


def apply_token_bitmasks_inplace(logits: torch.Tensor, row_indices: torch.Tensor,
                                 words: torch.Tensor) -> None:
    """Set every token a row's bitmask forbids to -inf in ``logits`` [rows, vocab]
    float32 itself. ``words`` [len(row_indices), num_words] int32: bit j of word w
    allows token 32 * w + j (gpu/sampler.apply_token_bitmasks)."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    num_rows, vocab_size = row_indices.shape[0], logits.shape[1]
    if num_rows == 0:
        return
    words = words.contiguous()
    grid = (num_rows, triton.cdiv(vocab_size, BLOCK))
    _mask_kernel[grid](logits, logits.stride(0), row_indices, words, words.shape[1], vocab_size,
                       BLOCK=BLOCK)
