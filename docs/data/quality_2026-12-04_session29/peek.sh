#!/bin/bash
# How chain $1 (A to E) is going: its log's tail, the sweep's points, each run's last line, the GPU.
cd "${W:-/tmp/w}" 2>/dev/null || exit 0
date +%T
tail -n ${2:-6} runs/chain$1.log 2>/dev/null
grep -h "done \|start " runs/sweep.log runs/sweep_mlp2.log 2>/dev/null | cut -c1-160
for f in runs/step_profile.log runs/seeds_generate.log runs/quality_gpu.log runs/quality_gpu_thread.log \
    runs/quality_gpu_unseen.log runs/quality_gpu_plain.log runs/step_model.log runs/step_fp8.log runs/data_curve/*/log.txt; do
  [ -f $f ] && { echo "-- $f"; tail -c 300 $f | tr '\r' '\n' | tail -n 1 | cut -c1-200; }
done
nvidia-smi --query-gpu=utilization.gpu,memory.used,power.draw --format=csv,noheader 2>/dev/null
