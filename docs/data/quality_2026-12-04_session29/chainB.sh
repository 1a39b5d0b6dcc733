#!/bin/bash
# A device session's chain (issues 32, items 5 and 2): quality_gpu.yaml as committed on a cold
# machine, timed, with the GPU alone (extract and train warm up while generate runs in its own
# process); its drafter served on the held-out prompts no run has served yet (65-147 of 147, as the
# issue's rerun on unseen prompts will); the drafter's step at that job's shape in bf16 and with FP8
# products (more steps in its minutes?); then three points on x1's records (train.jsonl, seed 0,
# from the kept generate files), each read against chainA's x1: 6 draft layers, an MLP twice as
# wide, and loss_target target_argmax (what a greedy decode accepts, on sampled records).
#   call 1 carry [".xfer1", ".whl"]; call 2 [".xfer2"]; call 3 [".xfer3"]:
#   setsid nohup bash docs/data/quality_2026-12-04_session29/chainB.sh >/dev/null 2>&1 </dev/null &
HERE=$(cd "$(dirname "$0")" && pwd)
CHAIN=B
. "$HERE/setup.sh"
echo "== quality_gpu $(date +%T)"
SECONDS=0
python3 -m dflash_core.cli.main run --traceback pipelines/quality_gpu.yaml >runs/quality_gpu.log 2>&1; rc=$?
echo "rc $rc"
echo "quality_gpu wall $SECONDS s"
tr '\r' '\n' <runs/quality_gpu.log | grep -a "warmed up\|first row came\|first step done\|done in"
tail -n 40 runs/quality_gpu.log
if [ $rc != 0 ]; then  # generate's process is new on a GPU: the job again as before, to time it all the same
  echo "== again, generate in a thread (not cold: the compile caches are warm now) $(date +%T)"
  SECONDS=0
  python3 -m dflash_core.cli.main run --traceback pipelines/quality_gpu.yaml --set stages.generate.executor=thread \
      --set run_dir=runs/quality_gpu_thread >runs/quality_gpu_thread.log 2>&1; echo "rc $? wall $SECONDS s"
  tr '\r' '\n' <runs/quality_gpu_thread.log | grep -a "warmed up\|first row came\|first step done\|done in"
fi
echo "== its drafter on the 83 held-out prompts no run has served yet (65-147) $(date +%T)"
tail -n +65 pipelines/data/sharegpt/heldout.jsonl >runs/heldout_65_147.jsonl
last=$(ls -d runs/quality_gpu/checkpoints/step-* runs/quality_gpu_thread/checkpoints/step-* 2>/dev/null | tail -n 1)
timeout 240 python3 -m dflash_core.cli.main evaluate "$last/export" --prompts runs/heldout_65_147.jsonl \
    --num-prompts 83 --max-new-tokens 256 --batch-size 83 --out runs/quality_gpu_unseen >runs/quality_gpu_unseen.log 2>&1
echo "rc $?"
python3 -c "import json; r = json.load(open('runs/quality_gpu_unseen/report.json'))
print('tau', r['tau'], 'n-gram', r['tau_ngram'], 'vs n-gram', r['vs_ngram'], 'lossless', r['lossless'])"
echo "== the 10-minute job's step, bf16 and with both FP8 products $(date +%T)"
for p in "model model" "fp8 fp8"; do
  set -- $p
  timeout 150 python3 benchmarks/train_step.py --shape smollm2-135m --layers 4 --features 5 --anchors 2048 --docs 22 \
      --lm-head $1 --mlp $2 >runs/step_$1.log 2>&1; echo "step lm_head $1 mlp $2 rc $?"; tail -n 4 runs/step_$1.log
done
echo "== x1 points $(date +%T)"
tar xJf docs/data/quality_2026-12-04_session28/quality_long_generate.tar.xz -C runs
X1="prompts=*train.jsonl,samples=1"
SECONDS=0
python3 benchmarks/quality_sweep.py --pipeline pipelines/quality_long.yaml \
    --records 'runs/quality_long/cache/generate/*/shard-*.jsonl' --out runs/data_curve --parallel 3 \
    "x1-L6:$X1,stages.train.params.num_layers=6" "x1-mlp2:$X1,stages.train.params.intermediate_size=3072" \
    "x1-tam:$X1,stages.extract.params.last_hidden=true,stages.train.params.loss_target=target_argmax" \
    >runs/sweep.log 2>&1; echo "sweep rc $? at $SECONDS s"
tail -n 5 runs/sweep.log
echo "== end $(date +%T)"
touch runs/chainB.done
