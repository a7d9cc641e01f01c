#!/usr/bin/env bash
# Device check of issue 14 (branch shard): on one GPU, `--devices 0` and
# `--devices 0,0` (two workers, two model copies, one device) must write the
# same report, and so must two `--shard K/2` runs joined by `merge`; every
# number but wall times. The model is a seeded synthetic SmolLM2-135M geometry
# (Q4_0) built here by the carried ninfer-convert from a tokenizer-only GGUF.
# BACKEND=cpu and PLAN="..." override the defaults (a local dry check).
set -u
D="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
O="${OUT:-$(mktemp -d)}"
W="$(mktemp -d)"
BACKEND="${BACKEND:-cuda}"
read -r -a PLAN <<< "${PLAN:---quick --context 1024 --stride 512 --chunks 8}"
BIN="$D/infernix-perplexity"
fail=0
date -u +"start %F %T UTC" | tee "$O/summary.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$O/summary.txt" 2>&1
"$D/ninfer-convert" "$D/smollm2-tok.gguf" --synthetic smollm2-135m --format Q4_0 --out "$W/synth.ninfer" > "$W/convert.log" 2>&1 \
  || { cat "$W/convert.log" >> "$O/summary.txt"; echo "FAIL convert" | tee -a "$O/summary.txt"; exit 1; }
score() { # name, extra flags...
  local name=$1; shift
  local t0=$SECONDS
  "$BIN" "$W/synth.ninfer" "${PLAN[@]}" --backend "$BACKEND" --output "$W/$name" "$@" > "$W/$name.table" 2> "$W/$name.log"
  local rc=$?
  echo "run $name ($*): exit $rc, $((SECONDS - t0)) s" | tee -a "$O/summary.txt"
  [ $rc -eq 0 ] || fail=1
}
score one --devices 0
score two --devices 0,0
score shard0 --shard 0/2
score shard1 --shard 1/2
"$BIN" merge "$W/merged" "$W/shard0" "$W/shard1" > "$W/merged.table" 2> "$W/merge.log" || { echo "FAIL merge (logs.txt)" | tee -a "$O/summary.txt"; fail=1; }
for r in one two merged; do cp "$W/$r/report.json" "$O/$r.json" 2>/dev/null; done
same() { # a b: equal but for timing and per-window seconds
  python3 - "$1" "$2" <<'PY'
import json, sys
def load(p):
    r = json.load(open(p))
    r.pop("timing", None)
    for s in r["results"]["streams"]:
        for w in s["windows"]:
            w.pop("seconds", None)
    return r
a, b = load(sys.argv[1]), load(sys.argv[2])
def diff(x, y, at="report"):
    if isinstance(x, dict) and isinstance(y, dict):
        for k in sorted(set(x) | set(y)):
            d = diff(x.get(k), y.get(k), f"{at}.{k}")
            if d: return d
    elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        for i, (u, v) in enumerate(zip(x, y)):
            d = diff(u, v, f"{at}[{i}]")
            if d: return d
    elif x != y:
        return f"{at}: {x!r} vs {y!r}"
d = diff(a, b)
print(d or f"identical ({sum(len(s['windows']) for s in a['results']['streams'])} windows, overall PPL {a['results']['overall']['perplexity']})")
sys.exit(1 if d else 0)
PY
}
for pair in "one two" "one merged"; do
  set -- $pair
  if line=$(same "$W/$1/report.json" "$W/$2/report.json" 2>&1); then
    echo "SAME $1 vs $2: $line" | tee -a "$O/summary.txt"
  else
    echo "DIFFER $1 vs $2: $line" | tee -a "$O/summary.txt"; fail=1
  fi
done
"$BIN" compare "$W/one" "$W/two" > "$O/compare.txt" 2>&1; echo "compare one two: exit $? ($(grep -o 'all [0-9]* windows bit-identical' "$O/compare.txt"))" | tee -a "$O/summary.txt"
for f in "$W"/*.log; do echo "== $(basename "$f")"; cat "$f"; done > "$O/logs.txt"
grep -h "plan:\|backend .* ready" "$W/one.log" "$W/two.log" | head -4
cat "$W/one.table"
date -u +"end %F %T UTC" | tee -a "$O/summary.txt"
[ $fail -eq 0 ] && echo "DEVICES CHECK PASS" | tee -a "$O/summary.txt" || echo "DEVICES CHECK FAIL" | tee -a "$O/summary.txt"
rm -rf "$W"
exit $fail
