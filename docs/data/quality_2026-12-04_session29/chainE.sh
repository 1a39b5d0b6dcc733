#!/bin/bash
# A device session's chain for a GPU of 80 GB (issue 32, item 2): the curve's x1 point (4 layers, MLP
# 1,536) and x1-mlp2 (MLP 3,072, lost in session 31) side by side, from the records of sessions 27-28.
# x3 and seeds 3-5 stay with chainA: their decode's cache beside two trainings needs an H200.
#   call 1 carry [".xfer1", ".whl"]; call 2 [".xfer2"]; call 3 [".xfer3"]:
#   setsid nohup bash docs/data/quality_2026-12-04_session29/chainE.sh >/dev/null 2>&1 </dev/null &
HERE=$(cd "$(dirname "$0")" && pwd)
CHAIN=E
. "$HERE/setup.sh"
PIPE=pipelines/quality_long.yaml
tar xJf docs/data/quality_2026-12-04_session28/quality_long_generate.tar.xz -C runs
SECONDS=0
python3 -m dflash_core.cli.main run "$PIPE" --only download >runs/download.log 2>&1; echo "download rc $?"
echo "== sweep $(date +%T)"
python3 benchmarks/quality_sweep.py --pipeline "$PIPE" --records "runs/quality_long/cache/generate/*/shard-*.jsonl" \
    --out runs/data_curve --parallel 2 "x1:prompts=*train.jsonl,samples=1" \
    "x1-mlp2:prompts=*train.jsonl,samples=1,stages.train.params.intermediate_size=3072" >runs/sweep.log 2>&1
echo "sweep rc $? at $SECONDS s"
tail -n 4 runs/sweep.log
echo "== end $(date +%T)"
touch runs/chainE.done
