"""The attention kernels' sm_90 instructions, counted on this machine (no GPU needed).

    python3 benchmarks/sass_count.py [--attention OLD/triton_attention.py]
        [--decode-tiles 32,1,3 64,4,3,128]

Compiles the decode and varlen kernels for a capability-90 target (the triton wheel
ships ptxas and cuobjdump) at qwen3-8b's heads, over a bf16 and an e4m3 cache, exactly
as ``paged_attention`` would launch them, and prints each kernel's instruction count
and its shared-memory loads, stores, conversions and matrix instructions by opcode,
with ptxas's registers and stack bytes a thread (``--decode-tiles``: the decode kernel
also at those tiles).
``--attention`` compiles an earlier copy of gpu/kernels/triton_attention.py instead
(e.g. from ``git show REV:gpu/kernels/triton_attention.py``). A static count: what a
tile costs in instructions, not in time.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# the compile needs the real code generator, not the interpreter
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
TARGET = GPUTarget("cuda", 90, 32)
META = torch.device("meta")
# opcodes (their first word) worth showing beside the total
SHOWN = re.compile(r"^(LDS|STS|LDSM|STSM|LDGSTS|LDG|F2FP|PRMT|HMMA|HGMMA|IMAD\.MOV)")


def opcodes(cubin: bytes) -> collections.Counter[str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        sass = subprocess.run([str(CUOBJDUMP), "-sass", file.name], capture_output=True,
                              text=True, check=True).stdout
    counts: collections.Counter[str] = collections.Counter()
    for line in sass.splitlines():
        found = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z0-9_.]+)", line)
        if found:
            counts[found.group(1)] += 1
    return counts


def resource_usage(cubin: bytes) -> str:
    """ptxas's registers a thread and stack bytes (spills) of the kernel in ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([str(CUOBJDUMP), "-res-usage", file.name], capture_output=True,
                               text=True, check=True).stdout
    return ", ".join(re.findall(r"(?:REG|STACK):\d+", usage))


def compile_instead_of_launching(label: str):
    backend = make_backend(TARGET)

    def run(kernel: JITFunction, *args, grid, warmup, **kwargs) -> None:
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(
            backend, kwargs, bound, specialization, options)
        binary = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                target=TARGET, options=options.__dict__)
        counts = opcodes(binary.asm["cubin"])
        shown = ", ".join(f"{name} {count}" for name, count in sorted(counts.items())
                          if SHOWN.match(name))
        print(f"{label} {kernel.fn.__name__}: {sum(counts.values())} instructions, "
              f"{binary.metadata.shared} bytes shared, {resource_usage(binary.asm['cubin'])}; "
              f"{shown}", flush=True)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--attention", help="another copy of gpu/kernels/triton_attention.py")
    parser.add_argument("--decode-tiles", nargs="+", default=[],
                        help="also the decode kernel at these tiles, each as "
                             "positions,warps,stages[,registers]")
    args = parser.parse_args()
    if args.attention:
        spec = importlib.util.spec_from_file_location("other_triton_attention", args.attention)
        assert spec is not None and spec.loader is not None
        attention = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = attention  # its dataclasses look their module up
        spec.loader.exec_module(attention)
    else:
        from trio_llm.gpu.kernels import triton_attention as attention
    num_seqs, num_tokens = 256, 512
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        label = "bf16 cache" if cache_dtype == torch.bfloat16 else "e4m3 cache"
        JITFunction.run = compile_instead_of_launching(label)  # type: ignore[method-assign]
        cache = torch.empty(4096, 16, 8, 128, dtype=cache_dtype, device=META)
        for tokens in (num_seqs, num_tokens):  # decode, then varlen (4 prompts of 128)
            seqs = num_seqs if tokens == num_seqs else 4
            attention.paged_attention(
                torch.empty(tokens, 32, 128, dtype=torch.bfloat16, device=META), cache, cache,
                torch.empty(seqs, 128, dtype=torch.int32, device=META),
                torch.empty(seqs, dtype=torch.int32, device=META),
                torch.empty(seqs + 1, dtype=torch.int32, device=META), 128**-0.5,
                num_splits=1)
        for text in args.decode_tiles:
            tile = tuple(int(part) for part in text.split(","))
            JITFunction.run = compile_instead_of_launching(  # type: ignore[method-assign]
                f"{label} decode tile {tile}")
            attention.paged_attention(
                torch.empty(num_seqs, 32, 128, dtype=torch.bfloat16, device=META), cache,
                cache, torch.empty(num_seqs, 128, dtype=torch.int32, device=META),
                torch.empty(num_seqs, dtype=torch.int32, device=META),
                torch.empty(num_seqs + 1, dtype=torch.int32, device=META), 128**-0.5,
                num_splits=1, decode=attention.DecodeConfig(*tile))


if __name__ == "__main__":
    main()
