#!/usr/bin/env bash
# One prepared run for a session lent a GPU (often for minutes only): the CUDA tests, the graph-captured
# example beside the eager one, and benchmarks/gpu_feed.py's GPU table (issue 27), each capped in time,
# each one's output in $OUT (a folder that comes back). Run it once from the repository root:
#
#   OUT=/some/folder bash benchmarks/gpu_session.sh            # on the GPU machine: each step capped, 9 minutes at most
#   DEVICE=cpu STEPS=60 REPEATS=1 bash benchmarks/gpu_session.sh   # a dry run of the same steps here
#
# Where torchdata, webdataset, zstandard or xxhash are missing there, install them first from carried wheels
# (the device machine's README says how) and export PYTHONPATH. Nothing here needs the network.
set -u
OUT=${OUT:-bench_data/gpu_session}
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-200}
REPEATS=${REPEATS:-3}
PY=${PY:-python3}
mkdir -p "$OUT"
say() { echo "== $* ($(date +%T))" | tee -a "$OUT/summary.txt"; }

say "device"
$PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')" \
    2>&1 | tee -a "$OUT/summary.txt"

say "corpora (bench_data/quick and full, written if missing)"
timeout 30 $PY benchmarks/data.py bench_data/quick --quick > "$OUT/data.txt" 2>&1
timeout 120 $PY benchmarks/data.py bench_data/full >> "$OUT/data.txt" 2>&1
tail -2 "$OUT/data.txt" | tee -a "$OUT/summary.txt"
data=bench_data/full
if [ ! -e bench_data/full/index.json ]; then  # not written within its time: the table on the quick corpus, said
    data=bench_data/quick; echo "the full corpus was not written in time: gpu_feed on bench_data/quick" | tee -a "$OUT/summary.txt"
fi

say "CUDA tests"
timeout 90 $PY -m pytest -q -p no:cacheprovider tests/test_device_feed.py tests/test_transport.py \
    tests/test_fields.py -k cuda > "$OUT/cuda_tests.txt" 2>&1
tail -3 "$OUT/cuda_tests.txt" | tee -a "$OUT/summary.txt"

say "graph-captured step (examples/train_cuda_graph.py) and the eager one"
for mode in graph eager; do
    extra=""; [ "$mode" = eager ] && extra="--eager"
    timeout 45 $PY examples/train_cuda_graph.py --data bench_data/quick --steps 2000 --device "$DEVICE" $extra \
        > "$OUT/example_$mode.txt" 2>&1
    echo "$mode: $(tail -1 "$OUT/example_$mode.txt")" | tee -a "$OUT/summary.txt"
done

say "gpu_feed: the GPU table"
if [ "$DEVICE" = cuda ]; then models="mlp small"; else models="simulated-mlp idle"; fi
# 2 models x 4 cases x 3 repeats = 24 runs (13 took ~2 minutes on an H100; 32 did not fit in 4)
timeout 210 $PY benchmarks/gpu_feed.py --device "$DEVICE" --data "$data" --models $models \
    --cases floor streamwin:1 streamwin-device:0 streamwin-static:1 \
    --loader-only --steps "$STEPS" --repeats "$REPEATS" --out "$OUT/gpu_feed" > "$OUT/gpu_feed.txt" 2>&1
grep "^|" "$OUT/gpu_feed.txt" | tee -a "$OUT/summary.txt"
say "done"
