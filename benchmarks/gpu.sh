#!/usr/bin/env bash
# The CUDA/NCCL paths on one GPU, in under 8 minutes: parity of every stage (one process,
# then several processes sharing the device if NCCL allows it), bf16 step time vs FSDP2 and
# DeepSpeed, blocking and async save (pinned host buffers, side stream) vs DCP; then, each
# with its own limit, offload, the DCP plug-in, the memory tier and (8 GPUs) the mesh.
#   bash benchmarks/gpu.sh [RESULT.json]     (default: $OUT/gpu-results.json, else the repo root)
# Every part is guarded: a failure is recorded in the JSON and the next part runs.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# $OUT, when set, names a folder for the results; else they go to the repo root.
RESULT="${1:-${OUT:-$ROOT}/gpu-results.json}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# NCCL warnings (a refused shared device, say) land in the log.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
"$PY" -c "import torch, zerostate; assert torch.cuda.is_available(), 'no CUDA device'" || {
    echo "{\"error\": \"torch with CUDA and zerostate must be importable by $PY\"}" > "$RESULT"
    exit 1
}
# Hard stop under 8 minutes; the JSON is rewritten after every part.
timeout --signal=INT --kill-after=20 460 "$PY" -m benchmarks.gpu --out "$RESULT" --nproc 2
rc=$?
echo "gpu.sh: exit $rc, results in $RESULT"
# Offload (ZeRO-Offload, docs/engine.md "Offload"): the largest GPT-2 width that trains at
# stage 2 with and without offload="optimizer", step time against DeepSpeed ZeRO-2 with
# offload_optimizer to cpu, and the host AdamW step vs DeepSpeedCPUAdam at the host's
# threads. Its own JSON and time limit; ZEROSTATE_GPU_OFFLOAD=0 skips it.
if [ "${ZEROSTATE_GPU_OFFLOAD:-1}" != 0 ]; then
    OFFLOAD_RESULT="${RESULT%.json}-offload.json"
    timeout --signal=INT --kill-after=20 300 "$PY" -m benchmarks.offload gpu \
        --out "$OFFLOAD_RESULT" || rc=$((rc ? rc : 2))
    timeout --signal=INT --kill-after=20 120 "$PY" -m benchmarks.offload host \
        --threads "$OMP_NUM_THREADS" --out "${RESULT%.json}-offload-host.json" || rc=$((rc ? rc : 2))
    echo "gpu.sh: offload results in $OFFLOAD_RESULT"
fi
# DCP plug-in (benchmarks/dcp_plugin.py, docs/dcp.md): FSDP2 state on the GPU saved with
# dcp.save / dcp.async_save through zerostate.dcp's writer vs FileSystemWriter (and DCP's
# caching stager, which pins host memory), and a layout-changing load with our reader vs
# FileSystemReader. Its own JSON (the last line of its output) and time limit;
# ZEROSTATE_GPU_DCP=0 skips it.
if [ "${ZEROSTATE_GPU_DCP:-1}" != 0 ]; then
    DCP_RESULT="${RESULT%.json}-dcp.json"
    DCP_DIR="$(mktemp -d)"
    timeout --signal=INT --kill-after=20 240 "$PY" -m torch.distributed.run --standalone \
        --nproc-per-node 1 -m benchmarks.dcp_plugin --device cuda --dir "$DCP_DIR/run" \
        --rounds 3 > "$DCP_RESULT.log" 2>&1 || rc=$((rc ? rc : 2))
    "$PY" - "$DCP_RESULT.log" "$DCP_RESULT" <<'PYEOF' || rc=$((rc ? rc : 2))
import json, sys
text = open(sys.argv[1]).read()
start = text.rfind("\n{")
json.dump(json.loads(text[start:text.rindex("}") + 1]), open(sys.argv[2], "w"), indent=1)
PYEOF
    rm -rf "$DCP_DIR"
    echo "gpu.sh: DCP plug-in results in $DCP_RESULT"
fi
# Memory tier (benchmarks/memory_tier.py, docs/reliability.md): on a host whose disk is a
# real one, the row this project's 2-core VM cannot give (there the "disk" is read from the
# same memory): blocked time of a memory-tier save vs an async disk save, and a load from
# memory vs local disk (warm and, as root, with the page cache dropped) and vs SeaweedFS on
# 127.0.0.1 when its binary is installed. The engine runs on the host (gloo), 2 ranks as 2
# nodes. Its text output is kept; ZEROSTATE_GPU_MEMTIER=0 skips it.
if [ "${ZEROSTATE_GPU_MEMTIER:-1}" != 0 ]; then
    MEMTIER_RESULT="${RESULT%.json}-memory-tier.txt"
    MEMTIER_DIR="$(mktemp -d)"
    S3_FLAG=""
    if command -v weed > /dev/null || [ -x "$(dirname "$PY")/weed" ]; then S3_FLAG="--s3"; fi
    timeout --signal=INT --kill-after=20 240 "$PY" -m benchmarks.memory_tier --params 64e6 \
        --rounds 3 --dir "$MEMTIER_DIR" $S3_FLAG > "$MEMTIER_RESULT" 2>&1 || rc=$((rc ? rc : 2))
    rm -rf "$MEMTIER_DIR"
    echo "gpu.sh: memory tier results in $MEMTIER_RESULT"
fi
# Mesh (ZeRO inside a device mesh, benchmarks/mesh.py): tp 2 x dp_shard 4 on one node of 8
# GPUs over NCCL, a 1B-parameter Llama parallelized with torch's parallelize_module, bf16:
# step time and peak memory of zerostate (stage 2, with activation_checkpointing=
# "partitioned", stage 3) next to FSDP2 + TP built the torchtitan way (with and without activation
# checkpointing). Runs when the node has ZEROSTATE_GPU_MESH_NPROC (default 8) GPUs;
# ZEROSTATE_GPU_MESH=0 skips it. Its own JSON and time limit.
MESH_NPROC="${ZEROSTATE_GPU_MESH_NPROC:-8}"
NUM_GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
if [ "${ZEROSTATE_GPU_MESH:-1}" != 0 ] && [ "$NUM_GPUS" -ge "$MESH_NPROC" ]; then
    MESH_RESULT="${RESULT%.json}-mesh.json"
    timeout --signal=INT --kill-after=20 600 "$PY" -m torch.distributed.run \
        --standalone --nproc-per-node "$MESH_NPROC" -m benchmarks.mesh --tp 2 --stage 2 \
        --out "$MESH_RESULT" || rc=$((rc ? rc : 2))
    echo "gpu.sh: mesh results in $MESH_RESULT"
else
    echo "gpu.sh: mesh section skipped ($NUM_GPUS GPU(s), it needs $MESH_NPROC)"
fi
exit $rc
