"""Run a benchmark script with one of the package's modules read from another file.

    python3 benchmarks/with_module.py trio_llm.gpu.kernels.triton_attention \
        OLD/triton_attention.py benchmarks/gpu_bench.py decode --model qwen3-30b-a3b

An A/B of a kernel file end to end where the device has no git history: the copy
(e.g. ``git show REV:gpu/kernels/triton_attention.py``, carried beside the tree) is
imported under the module's own name before anything imports the original, then the
script runs as ``__main__`` with the arguments after it. Run the same script without
this wrapper for the other side, in the same device call.
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    module_name, path, script, *arguments = sys.argv[1:]
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    parent_name, _, attribute = module_name.rpartition(".")
    setattr(importlib.import_module(parent_name), attribute, module)
    sys.argv = [script, *arguments]
    sys.path.insert(0, str(Path(script).resolve().parent))
    print(f"with {module_name} from {path}", flush=True)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
