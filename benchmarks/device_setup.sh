# Source this on the device machine, from the repository root:
#   . benchmarks/device_setup.sh
# It installs the wheelhouse carried in .whl (trio, msgspec, quart-trio, ...:
# build it here with /work/shared/tools/offline-wheels.sh .whl) and trio-llm
# itself into /tmp/site, which the image's python3 then finds first. (A warm machine
# keeps /tmp/site between calls, and pip --target never replaces a package already
# there: trio-llm is removed first so each call runs the code it carried.)
rm -rf /tmp/site/trio_llm /tmp/site/trio_llm-*.dist-info
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
  && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . \
  && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
