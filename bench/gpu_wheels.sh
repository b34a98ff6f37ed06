#!/usr/bin/env bash
# The wheels bench/gpu_session.sh (issue 58's GPU benchmark) installs on a lent GPU machine, which has no package registry: the pinned versions
# (requirements/constraints.txt) of what its image lacks or holds at another version (its torch 2.11 stays: a CUDA
# torch is too large to carry). For its Python 3.12, x86-64. Writes .whl/ (ignored: add `/.whl/` to
# .git/info/exclude) and carry it: the device tool's `run` with carry [".whl"].
set -eu
NAMES="transformers peft huggingface_hub datasets omegaconf dill multiprocess torchao tokenizers accelerate typer rich
click shellingham annotated-doc httpx2 httpcore2 pydantic pydantic_core annotated-types typing-inspection truststore
typing_extensions idna h11 anyio"
pins=()
for n in $NAMES; do
  pin=$(grep -iE "^${n//[-_]/[-_]}==" requirements/constraints.txt | head -1)
  [ -n "$pin" ] && pins+=("$pin") || echo "not pinned, skipped: $n"
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pins[@]}"
ls .whl
# a call carries at most 64 MiB, the working tree included: check the total
du -sh .whl
