#!/usr/bin/env bash
# Store throughput against the tools people compare it with:
#   ingest (SHA-256 while chunking into fsynced objects)  vs  openssl dgst -sha256
#   materialize (copy to a new inode, fsync, link)        vs  cp (and cp + fsync)
# Every figure is the best of $REPS runs (default 3), with `sync` before each.
# The store runs twice: on the disk filesystem of /tmp, and on a tmpfs mounted
# under /tmp (needs root; skipped with a message otherwise), which isolates
# the CPU cost from the disk.
# Usage: scripts/bench_store.sh [size_mib]   (default 1024). Temp files live
# under /tmp and are removed on exit.
set -euo pipefail
size_mib="${1:-1024}"
reps="${REPS:-3}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target-cas}"

work="$(mktemp -d /tmp/tcg-bench-store.XXXXXX)"
cleanup() {
  if mountpoint -q "$work/mem" 2>/dev/null; then umount "$work/mem" || umount -l "$work/mem"; fi
  rm -rf "$work"
}
trap cleanup EXIT

(cd "$repo" && cargo build --release -q -p tcg-cas --example bench_store)
bench="$CARGO_TARGET_DIR/release/examples/bench_store"

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(free -g | awk '/Mem:/ {print $2}') GiB RAM"
if grep -qw sha_ni /proc/cpuinfo; then echo "cpu has SHA extensions (sha_ni)"; else echo "cpu lacks sha_ni"; fi
echo "filesystem of /tmp: $(stat -f -c %T /tmp) ($(findmnt -n -o SOURCE,OPTIONS --target /tmp))"

head -c "$((size_mib * 1024 * 1024))" /dev/urandom > "$work/input"
sync

now() { date +%s.%N; }
secs() { echo "$2 - $1" | bc -l; }
min() { echo "$@" | tr ' ' '\n' | sort -g | head -1; }

# The input was just written, so it is in the page cache for every reader.
openssl dgst -sha256 "$work/input" > /dev/null
ts=()
for _ in $(seq "$reps"); do
  t0=$(now); openssl_out=$(openssl dgst -sha256 "$work/input"); t1=$(now)
  ts+=("$(secs "$t0" "$t1")")
done
openssl_s=$(min "${ts[@]}")

ts=(); tss=()
for _ in $(seq "$reps"); do
  rm -f "$work/cp-out"; sync
  t0=$(now); cp "$work/input" "$work/cp-out"; t1=$(now)
  ts+=("$(secs "$t0" "$t1")")
  rm -f "$work/cp-out"; sync
  t0=$(now); cp "$work/input" "$work/cp-out"; sync "$work/cp-out"; t1=$(now)
  tss+=("$(secs "$t0" "$t1")")
done
rm -f "$work/cp-out"
cp_s=$(min "${ts[@]}"); cps_s=$(min "${tss[@]}")

mib() { echo "$size_mib / $1" | bc -l; }
report() { # label scratch
  local out
  out=$("$bench" "$work/input" "$2" "$reps")
  get() { echo "$out" | awk -v k="$1" '$1 == k { print $2 }'; }
  [ "${openssl_out##* }" = "$(get file_digest)" ] || { echo "digest differs from openssl" >&2; exit 1; }
  local ingest_s mat_s matv_s
  ingest_s=$(get ingest_seconds); mat_s=$(get materialize_seconds); matv_s=$(get materialize_verified_seconds)
  echo "-- store on $1"
  printf 'tcg-cas ingest             %6.3f s  %7.1f MiB/s  (%.2fx openssl throughput, goal >= 0.8)\n' \
    "$ingest_s" "$(mib "$ingest_s")" "$(echo "$openssl_s / $ingest_s" | bc -l)"
  printf 'tcg-cas materialize        %6.3f s  (%.2fx cp time, goal <= 1.5; %.2fx cp+fsync) method %s\n' \
    "$mat_s" "$(echo "$mat_s / $cp_s" | bc -l)" "$(echo "$mat_s / $cps_s" | bc -l)" "$(get materialize_method)"
  printf 'tcg-cas materialize verify %6.3f s  (%.2fx cp time)\n' "$matv_s" "$(echo "$matv_s / $cp_s" | bc -l)"
}

printf 'size                       %d MiB, best of %d\n' "$size_mib" "$reps"
printf 'openssl dgst -sha256       %6.3f s  %7.1f MiB/s\n' "$openssl_s" "$(mib "$openssl_s")"
printf 'cp (disk)                  %6.3f s\n' "$cp_s"
printf 'cp + fsync (disk)          %6.3f s\n' "$cps_s"
report "disk ($(stat -f -c %T /tmp))" "$work/scratch"
mkdir -p "$work/mem"
if mount -t tmpfs -o size=$((3 * size_mib + 64))m tmpfs "$work/mem" 2>/dev/null; then
  report "tmpfs (CPU cost only; cp figures above are for disk)" "$work/mem"
else
  echo "-- tmpfs run skipped: cannot mount a tmpfs (not root)"
fi
