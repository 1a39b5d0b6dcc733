#!/bin/bash
# The device session after chainA's (issue 32, items 5 and 3): quality_gpu.yaml as committed on a
# cold machine, timed, with the GPU alone; then the curve's x10 point (seeds 0-5 of both prompt
# files, 4 epochs). Seeds 3-5 come back from chainA as seeds345.tar.xz.part*, carried in .xfer8.
#   call 1 carry [".xfer1", ".whl"]; call 2 [".xfer2"]; call 3 [".xfer3", ".xfer8"]:
#   setsid nohup bash docs/data/quality_2026-12-04_session29/chainB.sh >/dev/null 2>&1 </dev/null &
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../.." || exit 1
W=/tmp/w
mkdir -p "$W/runs"
exec >>"$W/runs/chainB.log" 2>&1
echo "== start $(date +%T) $(git log --oneline -1 2>/dev/null)"
. "$HERE/setup.sh"
echo "== quality_gpu $(date +%T)"
SECONDS=0
python3 -m dflash_core.cli.main run --traceback pipelines/quality_gpu.yaml >runs/quality_gpu.log 2>&1; echo "rc $?"
echo "quality_gpu wall $SECONDS s"
tail -n 40 runs/quality_gpu.log
echo "== x10 $(date +%T)"
tar xJf docs/data/quality_2026-12-04_session28/quality_long_generate.tar.xz -C runs
cat .xfer8/seeds345.tar.xz.part* | tar xJf - -C .
ls runs/quality_long/cache/generate/*/
SECONDS=0
python3 benchmarks/quality_sweep.py --pipeline pipelines/quality_long.yaml \
    --records 'runs/quality_long/cache/generate/*/shard-*.jsonl' --out runs/data_curve \
    'x10:samples=6,stages.pack.params.epochs=4' >runs/sweep.log 2>&1; echo "rc $?"
echo "x10 wall $SECONDS s"
tail -n 4 runs/sweep.log
echo "== end $(date +%T)"
touch runs/chainB.done
