"""torch's own BLAS GEMM, called from numba kernels without the GIL (the CPU path, float32).

The fused CPU forward (gpu/kernels/cpu_layers.py) runs a whole part of a step as one
compiled call, so its linear layers must be callable from compiled code. They
call the very routine torch's ``bmm`` reaches on the CPU: the Fortran ``sgemm_``
that libtorch exports (MKL's, on x86 builds), found once by name. Called the way
``chunked_linear`` (gpu/layers/linear.py) calls it, one GEMM of ``ROWS_PER_CHUNK`` rows at
a time, it gives the same bits (tests/test_cpu_layers.py checks), so the compiled
forward keeps the torch forward's batch invariance: every GEMM has one shape,
whatever the batch.

The routine's address is an argument of the kernels, not a constant compiled into
them, so numba can keep them in its disk cache across processes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from trio_llm.gpu.layers.linear import INVARIANT_ROWS_PER_CHUNK

ROWS_PER_CHUNK = INVARIANT_ROWS_PER_CHUNK
_kernel = numba.njit(boundscheck=False, error_model="numpy", cache=True, nogil=True)


def sgemm_address() -> int:
    """The address of the ``sgemm_`` torch links (0 where it exports none: then the
    fused forward stays on torch's operations)."""
    for library in sorted((Path(torch.__file__).parent / "lib").glob("libtorch_cpu.*")):
        try:
            function = ctypes.CDLL(str(library)).sgemm_
        except (OSError, AttributeError):
            continue
        return int(ctypes.cast(function, ctypes.c_void_p).value or 0)
    return 0


def _gemm_typing(typingctx: Any, address: Any, num_out: Any, num_rows: Any, num_in: Any,
                 weight: Any, weight_offset: Any, x: Any, x_offset: Any, beta: Any,
                 out: Any, out_offset: Any) -> Any:  # pragma: no cover
    """``out[r, j] = sum_k x[r, k] weight[j, k] + beta out[r, j]`` for ``num_rows`` rows,
    row-major and contiguous from the given element offsets (``x`` [num_rows, num_in],
    ``weight`` [num_out, num_in], ``out`` [num_rows, num_out]): Fortran
    ``sgemm_('T', 'N', num_out, num_rows, num_in, 1, weight, num_in, x, num_in, beta, out,
    num_out)``, as ``torch.bmm`` calls it for a chunk of ``F.linear``."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        (_, _, _, _, weight_type, _, x_type, _, _, out_type, _) = signature.args
        (address_value, out_count, row_count, in_count, weight_array, weight_start, x_array,
         x_start, beta_value, out_array, out_start) = args
        int32, float32 = ir.IntType(32), ir.FloatType()
        char_pointer, int_pointer = ir.IntType(8).as_pointer(), int32.as_pointer()
        float_pointer = float32.as_pointer()

        def data_pointer(array_type: Any, array: Any, offset: Any) -> Any:
            data = context.make_array(array_type)(context, builder, array).data
            return builder.bitcast(builder.gep(data, [offset]), float_pointer)

        def scalar(value: Any, kind: Any) -> Any:
            slot = cgutils.alloca_once(builder, kind)
            builder.store(value, slot)
            return slot

        def count(value: Any) -> Any:
            return scalar(builder.trunc(value, int32) if value.type != int32 else value, int32)

        transpose, keep = scalar(ir.Constant(ir.IntType(8), ord("T")), ir.IntType(8)), scalar(
            ir.Constant(ir.IntType(8), ord("N")), ir.IntType(8))
        function_type = ir.FunctionType(ir.VoidType(), [
            char_pointer, char_pointer, int_pointer, int_pointer, int_pointer, float_pointer,
            float_pointer, int_pointer, float_pointer, int_pointer, float_pointer,
            float_pointer, int_pointer])
        function = builder.inttoptr(address_value, function_type.as_pointer())
        num_in_slot = count(in_count)
        builder.call(function, [
            transpose, keep, count(out_count), count(row_count), num_in_slot,
            scalar(ir.Constant(float32, 1.0), float32),
            data_pointer(weight_type, weight_array, weight_start), num_in_slot,
            data_pointer(x_type, x_array, x_start), num_in_slot, scalar(beta_value, float32),
            data_pointer(out_type, out_array, out_start), count(out_count)])
        return context.get_dummy_value()

    return types.void(types.int64, num_out, num_rows, num_in, weight, weight_offset, x,
                      x_offset, types.float32, out, out_offset), codegen


# ``_gemm(address, num_out, num_rows, num_in, weight, w_at, x, x_at, beta, out, out_at)``
_gemm: Any = intrinsic(_gemm_typing)


@_kernel
def _chunked_linear(address: int, x: np.ndarray, weight: np.ndarray,
                    out: np.ndarray) -> None:  # pragma: no cover
    """``out = x weight^T`` in GEMMs of ROWS_PER_CHUNK rows; ``x`` [num_rows, num_in] with
    ``num_rows`` a whole number of chunks, ``out`` [num_rows, num_out]; all contiguous."""
    num_in, num_out = x.shape[1], weight.shape[0]
    for first_row in range(0, x.shape[0], ROWS_PER_CHUNK):
        _gemm(address, num_out, ROWS_PER_CHUNK, num_in, weight, 0, x, first_row * num_in,
              np.float32(0.0), out, first_row * num_out)


def chunked_linear(x: np.ndarray, weight: np.ndarray, address: int) -> np.ndarray:
    """``x weight^T`` (float32, contiguous) as the compiled forward computes it: the rows
    zero-padded to whole chunks, one GEMM per chunk (for tests and benchmarks)."""
    num_rows = x.shape[0]
    padded = np.zeros((-(-num_rows // ROWS_PER_CHUNK) * ROWS_PER_CHUNK, x.shape[1]),
                      dtype=np.float32)
    padded[:num_rows] = x
    out = np.empty((padded.shape[0], weight.shape[0]), dtype=np.float32)
    _chunked_linear(address, padded, np.ascontiguousarray(weight), out)
    return out[:num_rows]


__all__ = ["ROWS_PER_CHUNK", "chunked_linear", "sgemm_address"]
