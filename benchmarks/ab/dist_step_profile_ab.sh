#!/usr/bin/env bash
# A/B of the sharded steps between two source trees on one multi-GPU machine, in one call:
# benchmarks/dist_step_profile.py (this tree's script) runs ROUNDS times per tree, alternating
# (base, new, base, new, ...), each run its own torchrun, with the package installed editable from
# the tree under test; the GPU times of one code agree within about 1% across runs, its host
# times do not (compare GPU columns; read wall and host over several rounds).
#
#   git archive <base commit> | tar -x -C /tmp/base
#   NCCL_NVLS_ENABLE=0 benchmarks/ab/dist_step_profile_ab.sh /tmp/base OUT 2 --configs fsdp2+muon,1gpu+muon
#
# Writes OUT/{base,new}<round>/ (the script's files) and prints each run's table; leaves this tree
# installed.
set -euo pipefail
base=$(cd "$1" && pwd)
out=$2
rounds=$3
shift 3
here=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
install() { (cd "$1" && python -m pip install -q --no-deps --no-build-isolation -e . > /dev/null); }
trap 'install "$here"' EXIT
for round in $(seq 1 "$rounds"); do
  for side in base new; do
    tree=$here
    [ "$side" = base ] && tree=$base
    install "$tree"
    if (cd "$here" && torchrun --nproc_per_node "$gpus" benchmarks/dist_step_profile.py --out "$out/$side$round" \
        "$@" > "$out/$side$round.log" 2>&1); then
      echo "== $side, round $round"
      grep "^| " "$out/$side$round/step_profile.md" | grep -v "^| config\|^|---\|^| 4 KiB\|^| all_reduce" || true
    else
      echo "== $side, round $round: failed ($out/$side$round.log)"
    fi
  done
done
