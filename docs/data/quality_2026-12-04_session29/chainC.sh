#!/bin/bash
# A device session's chain after chainA's (issue 32, item 3): the 10-minute job's drafter step
# profiled with the GPU alone (its phases, kernels, and what a CUDA graph of it saves), then the
# curve's x10 point (seeds 0-5 of both prompt files, 4 epochs). Seeds 3-5 come back from chainA as
# one xz stream in parts; cut it in two to fit beside the wheel parts of calls 2 and 3 (64 MiB a call):
#   cat seeds345.tar.xz.part* >s.xz && split -n 2 -d s.xz seeds345.tar.xz.
#   mkdir -p .xfer8 .xfer9 && mv seeds345.tar.xz.00 .xfer8/ && mv seeds345.tar.xz.01 .xfer9/
#   call 1 carry [".xfer1", ".whl"]; call 2 [".xfer2", ".xfer8"]; call 3 [".xfer3", ".xfer9"]:
#   setsid nohup bash docs/data/quality_2026-12-04_session29/chainC.sh >/dev/null 2>&1 </dev/null &
HERE=$(cd "$(dirname "$0")" && pwd)
CHAIN=C
. "$HERE/setup.sh"
SECONDS=0
timeout 180 python3 benchmarks/train_step.py --shape smollm2-135m --layers 4 --features 5 --anchors 2048 --docs 22 \
    --breakdown --profile runs/step_profile --cuda-graph >runs/step_profile.log 2>&1; echo "step profile rc $? at $SECONDS s"
echo "== x10 $(date +%T)"
tar xJf docs/data/quality_2026-12-04_session28/quality_long_generate.tar.xz -C runs
cat .xfer8/seeds345.tar.xz.* .xfer9/seeds345.tar.xz.* | tar xJf - -C .
n=$(ls runs/quality_long/cache/generate/*/shard-*.s[0-5].jsonl | wc -l)
echo "generate files: $n of 12"
if [ "$n" = 12 ]; then
  SECONDS=0
  python3 benchmarks/quality_sweep.py --pipeline pipelines/quality_long.yaml \
      --records 'runs/quality_long/cache/generate/*/shard-*.jsonl' --out runs/data_curve \
      'x10:samples=6,stages.pack.params.epochs=4' >runs/sweep.log 2>&1; echo "x10 rc $? at $SECONDS s"
  tail -n 4 runs/sweep.log
  echo "== x10's drafter on the 83 held-out prompts the points are not served on (65-147) $(date +%T)"
  tail -n +65 pipelines/data/sharegpt/heldout.jsonl >runs/heldout_65_147.jsonl
  last=$(ls -d runs/data_curve/x10/run/checkpoints/step-* | tail -n 1)
  timeout 240 python3 -m dflash_core.cli.main evaluate "$last/export" --prompts runs/heldout_65_147.jsonl \
      --num-prompts 83 --max-new-tokens 256 --batch-size 83 --out runs/x10_unseen >runs/x10_unseen.log 2>&1
  echo "rc $?"; tail -n 8 runs/x10_unseen.log
else
  echo "NOT RUN: x10 needs all six samples of both shards"
fi
echo "== end $(date +%T)"
touch runs/chainC.done
