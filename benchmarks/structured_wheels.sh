#!/usr/bin/env bash
# Add structured outputs' dependencies to the device wheelhouse (after
# /work/shared/tools/offline-wheels.sh .whl, which covers the pure-Python serving
# stack): xgrammar and what it imports that a CUDA image may lack. Versions: those
# of the active virtual environment where present, else the pins below.
#   bash benchmarks/structured_wheels.sh .whl
set -euo pipefail
TARGET="${1:?usage: $0 TARGET_DIR}"
PY="${PYTHON:-python3}"
PKGS=()
for spec in xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 \
            pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5; do
  name=${spec%%==*}
  have=""
  if [ -n "${VIRTUAL_ENV:-}" ]; then
    have=$("$VIRTUAL_ENV/bin/python" -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}' || true)
  fi
  PKGS+=("$name==${have:-${spec##*==}}")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$TARGET" "${PKGS[@]}"
ls "$TARGET"
