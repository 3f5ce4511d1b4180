#!/bin/sh
# Roofline against measured per block kind on the device's GPU: bench/costs.py with the device's own torch,
# tailor's compressor imported from this working tree (no install). Prints the tables; JSON under $OUT.
#
#   bench/device/block_costs.sh [MODEL ...]      (default: small-nemotron-h nemotron-3-nano-30b-a3b)
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
farm=$(mktemp -d)
mkdir "$farm/tailor"
ln -s "$root/compressor" "$farm/tailor/compressor"
out=${OUT:-$root/build/device}
mkdir -p "$out"
for name in ${*:-small-nemotron-h nemotron-3-nano-30b-a3b}; do
    PYTHONPATH="$farm${PYTHONPATH:+:$PYTHONPATH}" python3 "$root/bench/costs.py" --model "$name" --out "$out/costs-$name.json"
done
