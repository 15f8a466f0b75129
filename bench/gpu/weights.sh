#!/usr/bin/env bash
# The embedded SmolLM2 weights for a GPU machine reached through a tool that carries at most
# 64 MiB a call (the tree included): the 98 MB Q4_1 GGUF split into three parts (20 MB, then
# two of ~39 MB), one per git-ignored folder, each carried by its own call while the machine
# stays warm, gathered outside the tree there, joined and checked.
#
#   bash bench/gpu/weights.sh split            # here (`make gpu-weights`): .weights0/ .weights1/ .weights2/
#   bash bench/gpu/weights.sh stash N DIR      # there, in the call that carries .weightsN
#   bash bench/gpu/weights.sh join DIR         # there, after the three: DIR/SmolLM2-135M-Instruct.Q4_1.gguf
#
# A folder carried by one call is gone in the next (only the carried paths travel), hence the
# stash outside the tree. The joined file is checked against the sha256 of the original.
set -euo pipefail
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PARTS=3
case ${1:-} in
split)
    VENV_PY=${VENV_PY:-.venv/bin/python}
    src=$("$VENV_PY" -c 'from shared.model.source import embedded_gguf_path; print(embedded_gguf_path())')
    for i in $(seq 0 $((PARTS - 1))); do
        rm -rf ".weights$i"
        mkdir -p ".weights$i"
    done
    # Part 0 is the small one, to travel with the ~30 MB GPU bundle (make gpu-bundle) in one
    # call; parts 1 and 2 share the rest (~39 MB each, with the ~4 MB tree).
    size=$(stat -c %s "$src")
    first=20000000
    second=$(((size - first + 1) / 2))
    cut_part() {  # cut_part OFFSET COUNT FILE: bytes [OFFSET, OFFSET + COUNT) of the GGUF
        dd if="$src" of="$3" bs=1M iflag=skip_bytes,count_bytes skip="$1" count="$2" status=none
    }
    cut_part 0 "$first" .weights0/part
    cut_part "$first" "$second" .weights1/part
    cut_part $((first + second)) $((size - first - second)) .weights2/part
    sha256sum "$src" | cut -c1-64 > .weights0/sha256
    cp .weights0/sha256 .weights1/sha256
    cp .weights0/sha256 .weights2/sha256
    du -b .weights*/part
    ;;
stash)
    n=$2 dir=$3
    mkdir -p "$dir"
    cp ".weights$n/part" "$dir/part.$n"
    cp ".weights$n/sha256" "$dir/sha256"
    ;;
join)
    dir=$2
    for i in $(seq 0 $((PARTS - 1))); do
        [ -f "$dir/part.$i" ] || { echo "$dir/part.$i missing: stash every part first" >&2; exit 2; }
    done
    cat $(seq -f "$dir/part.%g" 0 $((PARTS - 1))) > "$dir/$NAME"
    echo "$(cat "$dir/sha256")  $dir/$NAME" | sha256sum -c
    ;;
*)
    echo "usage: $0 split | stash N DIR | join DIR" >&2
    exit 2
    ;;
esac
