#!/bin/bash
# What comes back: logs, the run's small results, and the generate files (for the curve) in 15 MB parts.
cd /tmp/w || exit 1
mkdir -p "$OUT"
if [ ! -f runs/chain28.done ]; then pkill -INT -f "quality_long.yaml"; sleep 20; pkill -f chain28.sh; pkill -f "dflash_core.cli.main"; sleep 3; fi
find runs -maxdepth 1 -type f \( -name '*.log' -o -name '*.done' \) >/tmp/list
find runs/quality_long -type f -size -4M \( -name '*.json' -o -name '*.jsonl' -o -name '*.yaml' -o -name '*.log' -o -name '*.txt' -o -name '*.png' \) \
    -not -path '*/cache/*' -not -path '*/checkpoints/*' 2>/dev/null >>/tmp/list
tar czf "$OUT/results28.tgz" -T /tmp/list && ls -la "$OUT/results28.tgz"
tar czf - -C runs quality_long/cache/generate quality_long/state.json quality_long/artifacts/download \
    | split -b 15000000 -d - "$OUT/quality_long_generate.tgz.part" && ls -la "$OUT"/quality_long_generate.tgz.part*
bash .xfer5/peek28.sh 30 2>/dev/null || true
