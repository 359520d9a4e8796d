#!/usr/bin/env bash
# make demo: build a real dataset (the Python standard library's source), train a
# tiny GPT-2 on 2 MPI ranks, evaluate, checkpoint, resume, export and sample.
# Its dataset and run have folders of their own: the README's tour writes data/stdlib
# and runs/gpt2-tiny, and must find them free after the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=runs/demo
DATA=data/demo
STDLIB=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')

if [ ! -f "$DATA/train/manifest.json" ]; then
  echo "== building $DATA from $STDLIB (byte-level BPE, 1024 tokens)"
  trainrun-data tokens --input "$STDLIB" --output "$DATA" --train-bpe 1024 --eval-fraction 0.01
fi
trainrun-data inspect "$DATA/train"

if [ -d "$RUN" ]; then
  echo "== removing the previous demo run $RUN"
  rm -rf "$RUN"
fi

echo "== training on 2 ranks, stopping at step 300 of 500 (checkpoint every 100)"
mpirun -np 2 trainrun --config configs/gpt2-tiny.yaml \
  --set run.output_dir="$PWD/$RUN" --set checkpoint.every=100 \
  --set train.eval_every=100 --set train.log_every=20 --set run.name=demo \
  --set data.train="$PWD/$DATA/train" --set data.eval="$PWD/$DATA/eval" \
  --set train.stop_at=300

echo "== resuming on 1 rank with 2 micro-batches per step (same global batch): continues exactly"
mpirun -np 1 trainrun resume "$RUN" --set train.stop_at=0 --set train.gradient_accumulation_steps=2

echo "== exporting the last checkpoint offline and sampling from it with plain onnxruntime"
trainrun export "$RUN/checkpoints/500" --output "$RUN/exported.onnx"
trainrun generate "$RUN/exported.onnx" --prompt "def " --max-new-tokens 80 --top-k 8 --seed 0

echo "== done. The README's commands are in .venv/bin: run 'source .venv/bin/activate' in your shell"
echo "   (or call them as .venv/bin/trainrun-data, .venv/bin/trainrun, .venv/bin/mpirun)"
