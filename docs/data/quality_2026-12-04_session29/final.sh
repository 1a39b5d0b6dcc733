#!/bin/bash
# What comes back from chain $1 (A to E), in $OUT: logs, each run's small results (tokenize
# manifest, training log, evaluate report), the step profile's tables, from A seeds 3-5 once all
# were written, and from B quality_gpu.yaml's final export, to serve again on other prompts (xz, in
# 15 MB parts).
# Stops what is still running first.
cd "${W:-/tmp/w}" || exit 1
mkdir -p "$OUT"
if [ ! -f runs/chain$1.done ]; then
  pkill -INT -f "dflash_core.cli.main"; sleep 20; pkill -f "chain$1.sh"; pkill -f quality_sweep.py; pkill -f "dflash_core.cli.main"; sleep 3
fi
find runs -maxdepth 1 -type f \( -name '*.log' -o -name '*.done' -o -name '*.csv' -o -name '*.spy*.txt' \) >/tmp/list
find runs -name 'failures*.log' -size -4M >>/tmp/list  # a failed run's tracebacks
find runs/step_profile -type f -name '*.txt' 2>/dev/null >>/tmp/list
find runs/data_curve runs/quality_gpu runs/quality_gpu_thread runs/quality_gpu_unseen runs/x10_unseen runs/quality_gpu_plain -type f -size -4M \( -name '*.json' -o -name '*.jsonl' -o -name '*.yaml' -o -name '*.txt' -o -name '*.png' \) \
    -not -path '*/checkpoints/*' -not -path '*/cache/*' -not -name records.jsonl -not -path '*/artifacts/tokenize/*/items.jsonl' 2>/dev/null >>/tmp/list
tar czf "$OUT/results$1.tgz" -T /tmp/list && ls -la "$OUT/results$1.tgz"
if [ "$1" = A ] && [ -f runs/seeds.done ] && ls ${RUN:-runs/quality_long}/cache/generate/*/shard-*.s[345].jsonl >/tmp/seeds; then
  tar cf - -T /tmp/seeds | xz -6 -T16 | split -b 15000000 -d - "$OUT/seeds345.tar.xz.part" && ls -la "$OUT"/seeds345*
fi
if [ "$1" = B ] && last=$(ls -d runs/quality_gpu/checkpoints/step-* 2>/dev/null | tail -n 1) && [ -n "$last" ]; then
  tar cf - "$last/export" | xz -6 -T16 | split -b 15000000 -d - "$OUT/quality_gpu_export.tar.xz.part" && ls -la "$OUT"/quality_gpu_export*
fi
bash "$(dirname "$0")/peek.sh" "$1" 30 2>/dev/null || true
