#!/usr/bin/env bash
# The main job: a small real training run on 2 ranks that saves, resumes on 1 rank
# (resharding 2 -> 1 on load), verifies and consolidates into one safetensors file.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ZEROSTATE_EXTRAS="${ZEROSTATE_EXTRAS-}" source "$ROOT/scripts/env.sh" 2> >(grep -v "is ignored: it is neither" >&2)
cd "$ROOT"
RUN="${RUN_DIR:-runs/demo}"
rm -rf "$RUN" && mkdir -p "$RUN"
export OMP_NUM_THREADS=1
echo "== train 40 steps on 2 ranks, saving every 20 (stage 2) =="
torchrun --nproc_per_node=2 --master_port="${MASTER_PORT:-29533}" examples/train_gpt.py \
    --ckpt "$RUN/ckpt" --steps 40 --save-every 20 --stage 2
echo "== resume on 1 rank from the 2-rank checkpoint (resharded on load), train to step 60 =="
torchrun --nproc_per_node=1 --master_port="${MASTER_PORT:-29533}" examples/train_gpt.py \
    --ckpt "$RUN/ckpt" --steps 60 --save-every 20 --stage 2 --resume
echo "== inspect, verify, consolidate =="
zerostate inspect "$RUN/ckpt" > "$RUN/inspect.txt"
head -4 "$RUN/inspect.txt"
zerostate verify "$RUN/ckpt"
mkdir -p "$RUN/hf"
zerostate consolidate "$RUN/ckpt" "$RUN/hf/model.safetensors"
cp "$RUN/ckpt/config.json" "$RUN/hf/config.json"
python - "$RUN/hf/model.safetensors" <<'PY'
import sys
from safetensors.torch import load_file
sd = load_file(sys.argv[1])
total = sum(t.numel() for t in sd.values())
print(f"consolidated {len(sd)} tensors, {total:,} parameters -> {sys.argv[1]}")
PY
