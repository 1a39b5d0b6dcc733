#!/bin/bash
# chainA and chainB at once on a two-GPU machine (nvidia-h200-x2): one device session instead of two.
# B on GPU 0, from a copy of its own (/tmp/wB) and with compile caches of its own, so that its
# quality_gpu.yaml run starts as cold as on a machine of its own; A on GPU 1, from /tmp/w (the path
# in the kept generate files' cache key, which its seeds 3-5 extend).
#   the same three calls and carries as chainA, the third starting
#   setsid nohup bash docs/data/quality_2026-12-04_session29/chainAB.sh >/dev/null 2>&1 </dev/null &
#   peek:  W=/tmp/wB bash docs/data/quality_2026-12-04_session29/peek.sh B; bash .../peek.sh A
#   final: W=/tmp/wB bash docs/data/quality_2026-12-04_session29/final.sh B; bash .../final.sh A
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/wB/home
W=/tmp/wB HOME=/tmp/wB/home TORCHINDUCTOR_CACHE_DIR=/tmp/wB/inductor TRITON_CACHE_DIR=/tmp/wB/triton \
    CUDA_VISIBLE_DEVICES=0 bash "$HERE/chainB.sh" &
W=/tmp/w CUDA_VISIBLE_DEVICES=1 bash "$HERE/chainA.sh" &
wait
