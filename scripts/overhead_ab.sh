#!/bin/bash
# Alternating A/B of `attnres-pp bench overhead --quick`'s pipeline_added_overhead between two trees.
# Usage: scripts/overhead_ab.sh BASE_TREE HEAD_TREE ROUNDS [OUT_MD]
#   BASE_TREE, HEAD_TREE: checkouts or `git archive` exports (each run uses its own code: PYTHONPATH=TREE)
#   ROUNDS: rounds; odd rounds run base then head, even rounds head then base (drift falls on both)
#   OUT_MD: the markdown table (default: ./overhead_ab_<UTC time>.md); raw logs beside it in OUT_MD.d/
# Each run is one thread (OMP_NUM_THREADS=1) and at most 1500 s (a run that ends after its timed part, in
# the profile, still counts: its figures are read from the log's progress line); the 1-minute load average is taken
# at each run's start.
set -u
if [ $# -lt 3 ] || [ ! -d "$1/attnres_pp" ] || [ ! -d "$2/attnres_pp" ] || ! [[ "$3" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: usage: scripts/overhead_ab.sh BASE_TREE HEAD_TREE ROUNDS [OUT_MD] (two trees holding attnres_pp/, ROUNDS >= 1)" >&2
  exit 2
fi
BASE=$(cd "$1" && pwd); HEAD=$(cd "$2" && pwd); ROUNDS=$3
OUT=${4:-$PWD/overhead_ab_$(date -u +%Y%m%dT%H%M%SZ).md}
LOGS="$OUT.d"; mkdir -p "$LOGS"; : > "$LOGS/results.tsv"

run_one() {  # $1 label, $2 tree, $3 round: appends "round label load wall overhead compute single" to results.tsv
  local label=$1 tree=$2 round=$3 load start out value
  load=$(cut -d' ' -f1 /proc/loadavg); start=$(date +%s)
  out="$LOGS/$label-$round"; rm -rf "$out"
  (cd "$tree" && OMP_NUM_THREADS=1 PYTHONPATH="$tree" timeout 1500 python -m attnres_pp.cli bench overhead --quick \
     --out "$out" > "$LOGS/$label-$round.log" 2>&1)
  value=$(python3 - "$out" "$LOGS/$label-$round.log" <<'EOF'
import json, pathlib, re, sys
found = sorted(pathlib.Path(sys.argv[1]).glob("*.json"))
line = re.search(r"compute ([0-9.]+)\); one process, one microbatch: ([0-9.]+)", pathlib.Path(sys.argv[2]).read_text())
if found:
    d = json.loads(found[0].read_text())
    print(f"{d['pipeline_added_overhead']:.3f} {d['ratio_compute']:.3f} {d['single_process']['ratio']:.3f}")
elif line:  # the timed part finished; the profile after it did not
    compute, single = float(line[1]), float(line[2])
    print(f"{compute / single:.3f} {compute:.3f} {single:.3f}")
else:
    print("nan nan nan")
EOF
)
  echo "$round $label $load $(( $(date +%s) - start )) $value" | tee -a "$LOGS/results.tsv"
}

echo "base=$BASE head=$HEAD rounds=$ROUNDS out=$OUT"
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then run_one base "$BASE" "$r"; run_one head "$HEAD" "$r"
  else run_one head "$HEAD" "$r"; run_one base "$BASE" "$r"; fi
done

python3 - "$LOGS/results.tsv" "$OUT" "$BASE" "$HEAD" <<'EOF'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1]) if line.strip()]
by = {}
for rnd, label, load, wall, over, comp, single in rows:
    by.setdefault(int(rnd), {})[label] = (float(over), float(comp), float(single), float(load), int(wall))
lines = [f"base = `{sys.argv[3]}`, head = `{sys.argv[4]}`; `attnres-pp bench overhead --quick`, alternated "
         "(odd rounds base first); pipeline_added_overhead = compute ratio / single-process ratio; load = the "
         "1-minute load average at the run's start.", "",
         "| round | base | head | base compute / single | head compute / single | load (base, head) | wall s |",
         "|---|---|---|---|---|---|---|"]
for rnd in sorted(by):
    b, h = by[rnd].get("base"), by[rnd].get("head")
    if b is None or h is None:
        continue
    lines.append(f"| {rnd} | {b[0]:.3f} | {h[0]:.3f} | {b[1]:.3f} / {b[2]:.3f} | {h[1]:.3f} / {h[2]:.3f} | "
                 f"{b[3]:.1f}, {h[3]:.1f} | {b[4]}, {h[4]} |")
for label, i in (("base", 0), ("head", 1)):
    vals = [by[r][label][0] for r in by if label in by[r] and by[r][label][0] == by[r][label][0]]
    if vals:
        lines.append(f"\n**{label}**: median {statistics.median(vals):.3f}, range {min(vals):.3f}-{max(vals):.3f}, "
                     f"{len(vals)} runs")
pairs = [by[r]["head"][0] - by[r]["base"][0] for r in by if {"base", "head"} <= set(by[r])]
if pairs:
    lines.append(f"\nhead - base, paired by round: median {statistics.median(pairs):+.3f}")
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
