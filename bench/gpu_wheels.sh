#!/usr/bin/env bash
# The wheels the GPU machine lacks (it has torch, triton, transformers, tokenizers, numpy, huggingface_hub,
# httpx and no package index), downloaded here into .whl/ for Python 3.12 on x86-64 Linux, so that
# `bench/gpu_session.sh` (carry=[".whl"]) can install them there: the server's stack (fastapi, uvicorn,
# pyzmq, msgspec, pydantic, opentelemetry-api, which fastapi 0.165 imports), the `openai` client the
# server tests drive it with (and sniffio, which it imports) and httpx2 (which openai 3.54 and starlette's
# test client import), gguf and prometheus-client, uvloop and httptools, xgrammar (structured output) and
# jsonschema (the structured output and tool tests check outputs with it), peft (the LoRA tests' reference,
# with accelerate and psutil), Pillow (images) and gemlite (int4 GEMMs, built from its source archive), each
# with what it needs that the machine lacks. The pins
# are the versions the CPU suite runs with. Under the device tool's 64 MiB carry limit (the script prints
# the size); .whl/ is kept out of git (.git/info/exclude).
#
#   bash bench/gpu_wheels.sh [EXTRA==VERSION ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 \
  typing-inspection==0.4.5 uvicorn==0.54.0 pyzmq==27.3.0 msgspec==0.22.0 opentelemetry-api==1.45.2 \
  importlib-metadata==10.2.0 zipp==4.1.2 openai==3.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 gguf==0.19.0 \
  prometheus-client==0.26.0 uvloop==0.23.0 httptools==0.9.0 \
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 \
  peft==0.21.2 accelerate==1.15.0 psutil==7.2.2 pillow==13.0.0 \
  "$@"
# gemlite (an int4 kernel GAPLESS_INT4_KERNEL can name) is published as a source archive only: pure
# Python and Triton, built here into a wheel for any platform
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl gemlite==0.6.0.post2
ls .whl
du -sh .whl
