#!/bin/bash
# The next device session's chain (issue 32, item 3): the curve's x3 point, and seeds 3-5 of
# quality_long.yaml's prompts generated beside it (x10's records, for chainC). x1 and x1-mlp2 were
# served in session 33 (chainE.sh).
#   call 1 carry [".xfer1", ".whl"]; call 2 [".xfer2"]; call 3 [".xfer3"]:
#   setsid nohup bash docs/data/quality_2026-12-04_session29/chainA.sh >/dev/null 2>&1 </dev/null &
# A CPU rehearsal sets W (another folder), PIPE (a cut-down pipeline file) and RUN (its run folder,
# under W), GEN_SETS (more --set words for generate) and PT (more KEY=VALUE for every point).
# SEEDS=0 leaves seeds 3-5 out (a GPU of 80 GB: their decode's cache, 66 GB, beside the training).
HERE=$(cd "$(dirname "$0")" && pwd)
CHAIN=A
. "$HERE/setup.sh"
PIPE=${PIPE:-pipelines/quality_long.yaml}; RUN=${RUN:-runs/quality_long}
tar xJf docs/data/quality_2026-12-04_session28/quality_long_generate.tar.xz -C runs
SECONDS=0
python3 -m dflash_core.cli.main run "$PIPE" --only download $GEN_SETS >runs/download.log 2>&1; echo "download rc $?"
echo "== sweep $(date +%T)"
python3 benchmarks/quality_sweep.py --pipeline "$PIPE" --records "$RUN/cache/generate/*/shard-*.jsonl" \
    --out runs/data_curve "x3:prompts=*train.jsonl,samples=3${PT:+,$PT}" >runs/sweep.log 2>&1 &
SWEEP=$!
# every point's records are written before the first starts: generate's new files come after
until grep -q "start x3" runs/sweep.log 2>/dev/null || ! kill -0 $SWEEP 2>/dev/null; do sleep 1; done
echo "== seeds 3-5 $(date +%T) ($SECONDS s)"
# in the CLI's own thread, as sessions 27-28 generated: x10 needs these files, and generate's
# process of its own (quality_long.yaml since session 30) is first tried on a GPU by chainB
if [ "${SEEDS:-1}" = 1 ]; then
  python3 -m dflash_core.cli.main run --traceback "$PIPE" --set stages.generate.params.samples=6 $GEN_SETS \
      --set stages.generate.executor=thread --only generate >runs/seeds_generate.log 2>&1
  rc=$?; echo "seeds rc $rc at $SECONDS s"
  ls "$RUN"/cache/generate/*/
  [ $rc = 0 ] && touch runs/seeds.done  # final.sh brings seeds 3-5 back only when all were written
fi
wait $SWEEP; echo "sweep rc $? at $SECONDS s"
tail -n 4 runs/sweep.log
echo "== end $(date +%T)"
touch runs/chainA.done
