#!/usr/bin/env bash
# The wheels the lent GPU machine lacks, into .whl/ at the project root (git-ignored; each device
# call carries it: run(carry=[".whl", ".gpucache"])). The machine has Python 3.12, torch, triton,
# numpy, pytest, hypothesis, jinja2, networkx and pyyaml, and no package index
# (../shared/gpu/README.md). About 27 MB, under the 64 MiB a call carries.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.whl
../shared/gpu/fetch-wheels.sh "$dest"  # flashinfer-python 0.6.1 and its light dependencies
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform any -d "$dest")
# what mstar imports beyond the machine's packages, with their own dependencies (pydantic's core
# must match pydantic exactly, so these are resolved, not taken one by one)
python3 -m pip download -q "${plat[@]}" "lark>=1.1,<2" "pydantic>=2.6,<3" "tqdm>=4.66,<5" "rich>=13,<16" \
  "safetensors>=0.4,<1"
# the gpu extra's: fla-core (Qwen3.5's chunked rule; einops came with FlashInfer) and cuda-bindings
# (engine/gpu/blas_edges.py), without their torch and triton requirements
python3 -m pip download -q --no-deps "${plat[@]}" "fla-core>=0.6.0,<0.7" "cuda-bindings>=13,<14" \
  "cuda-pathfinder>=1.4.2"
du -sh "$dest"
