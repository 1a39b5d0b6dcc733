#!/bin/bash
# A device session's chain (issue 32, item 5): why session 31's cold quality_gpu.yaml stepped 41%
# slower than session 27's. Twice from cold caches, the GPU sampled every 2 s: as committed (train's
# row_wait_share now in metrics.jsonl; since session 32 without the early baseline), then as session
# 27 ran it (generate in the CLI's thread, no warm-up) on today's code. Steps back at session 27's
# ~55 ms in the second run only put the cause in those two; steps as slow in both put it in the code
# since session 27 or the machine. The second run also makes evaluate's greedy reference and n-gram
# run at the first checkpoint in a process of its own (since session 33 its logs come back): beside
# training without sharing its interpreter lock, which in session 31's thread slowed the steps
# 67 -> 95 ms for the ~45 s they ran. Its steps in that window against its others, and its final
# evaluation's seconds against the first run's, say whether the job should do so.
#   call 1 carry [".xfer1", ".whl"]; call 2 [".xfer2"]; call 3 [".xfer3"]:
#   setsid nohup bash docs/data/quality_2026-12-04_session29/chainD.sh >/dev/null 2>&1 </dev/null &
# A CPU rehearsal sets W (another folder) and PIPE (a cut-down pipeline file of the same stages).
# RUNS=1 runs the first only (the job as committed: after another chain, in what device time is left).
HERE=$(cd "$(dirname "$0")" && pwd)
CHAIN=D
. "$HERE/setup.sh"
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw --format=csv,noheader -l 2 \
    >runs/gpu.csv 2>/dev/null &
SMI=$!
sample() {  # $1: output path without its extension; the rest: more py-spy flags. 10 s of the CLI's
  # process and the stage processes it spawned (py-spy, a wheel in .whl, if it can attach here)
  local out=$1 pid; shift
  pid=$(pgrep -o -f "dflash_core.cli.main run") || return 1
  timeout 30 .site/bin/py-spy record --nonblocking --threads --subprocesses "$@" -r 50 -d 10 \
      -p "$pid" -f raw -o "$out.txt" >"$out.log" 2>&1
}
spy() {  # $1: run folder, then seconds into the run. Where the job's threads spend the wall clock:
  # at each time, the thread holding the interpreter lock (.gil), then every thread on a CPU (.cpu);
  # spy_summary.py reads them
  local run=$1 start t; shift
  start=$(date +%s)
  for t in "$@"; do
    sleep $((start + t - $(date +%s)))
    sample runs/$run.spy$t.gil --gil || return
    sample runs/$run.spy$t.cpu || return
  done
}
spy_phases() {  # $1: run folder. The final evaluation (its phases are logged as they start; the
  # greedy reference comes at the first checkpoint, beside training, where the baseline is early):
  # every busy thread at the start of the greedy reference, the DFlash decode and τ_sim (.cpu, as
  # above), so spy_summary.py says where the host spends those phases
  local run=$1 phase
  for phase in "greedy reference" DFlash "τ_sim"; do
    until grep -aq "evaluate: step [0-9]*: $phase: 0/" runs/$run.log 2>/dev/null; do sleep 1; done
    sample runs/$run.spy-${phase// /_}.cpu || return
  done
}
cold() {  # $1: run folder; $2: when py-spy samples it (seconds, comma-separated); the rest: --set words.
  # Fresh Inductor, Triton and dflash-pipe compile caches.
  local run=$1 when=$2; shift 2
  echo "== $run $(date +%T)"
  export TORCHINDUCTOR_CACHE_DIR=$PWD/runs/$run.inductor TRITON_CACHE_DIR=$PWD/runs/$run.triton
  SECONDS=0
  spy $run ${when//,/ } &
  local spying=$!
  spy_phases $run &
  local phases=$!
  python3 -m dflash_core.cli.main run --traceback "${PIPE:-pipelines/quality_gpu.yaml}" --set run_dir=runs/$run \
      --set stages.train.params.compile_cache=runs/$run.compile "$@" >runs/$run.log 2>&1
  echo "rc $? wall $SECONDS s"
  kill $spying $phases 2>/dev/null; pkill -f py-spy
  tr '\r' '\n' <runs/$run.log | grep -a "warmed up\|first row came\|first step done\|done in\|a row's forward\|evaluate: step"
  tail -n 12 runs/$run.log
  python3 - runs/$run/metrics.jsonl <<'PY'
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "elapsed_s" in r]
at = {r["step"]: r for r in rows}
last = rows[-1]["step"]
for a, b in ((40, 400), (400, 1000), (1000, 2000), (2000, last)):
    if a in at and b in at and b > a:
        span = [r for r in rows if a < r["step"] <= b]
        wait = sum(r.get("row_wait_share", float("nan")) for r in span) / len(span)
        print(f"steps {a}-{b}: {(at[b]['elapsed_s'] - at[a]['elapsed_s']) / (b - a) * 1e3:.1f} ms a step, "
              f"row_wait_share {wait:.2f}")
PY
  find runs/$run -name report.json -path '*step-*' | sort | tail -n 1 | xargs -r python3 -c \
      'import json, sys; print("final evaluation:", json.load(open(sys.argv[1]))["timing"])'
}
# steps from ~157 s, as in session 31 (its early baseline beside steps 400-2,000 is off now)
cold quality_gpu 200,370
if [ "${RUNS:-2}" -ge 2 ]; then
# steps from ~200 s (57 s of compiling at the first row), at ~55 ms as in session 27; the baseline
# from step 380 (~230 s) in evaluate's own process
cold quality_gpu_plain 260,350 --set stages.extract.params.warm_up=off --set stages.train.params.warm_up=off \
    --set stages.generate.executor=thread --set stages.evaluate.executor=process \
    --set stages.evaluate.params.early_baseline=true
fi
kill $SMI
echo "== end $(date +%T)"
touch runs/chainD.done
