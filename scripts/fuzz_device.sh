#!/usr/bin/env bash
# Run the ten cargo-fuzz targets in parallel for SECONDS each (libFuzzer fork
# mode, 2 workers a target), resuming from and returning their corpora.
# Binaries are built here with `RUSTC_BOOTSTRAP=1 cargo fuzz build -O` in fuzz/,
# stripped into fuzz-bin/, and carried to the device machine (16 cores).
# Usage: scripts/fuzz_device.sh SECONDS OUTDIR
set -u
secs=${1:?seconds}
out=${2:?outdir}
cd "$(dirname "$0")/.."
targets="envelope_reader metadata wrapper elf wrapper_scan input_checks allowed_signers remote_records native_calls safetensors_header"
mkdir -p "$out" fuzz-bin/corpus
if [ -f fuzz-bin/corpus.tar.gz ]; then tar xzf fuzz-bin/corpus.tar.gz -C fuzz-bin/corpus; fi
# Package seeds: the model.pt2 of the small corpus envelopes (the reference
# package is 1.6 MB, far past libFuzzer's default input length).
mkdir -p fuzz-bin/seeds-package fuzz-bin/seeds-elf
# The small ELF keeps the elf target past libFuzzer's default input length
# (the reference .so is 1.6 MB; its section table lies beyond 4 KiB).
cp fuzz/seeds/elf/small.so fuzz-bin/seeds-elf/
for e in testdata/adversarial/base.tar.gz testdata/adversarial/base-literals.tar.gz \
  testdata/adversarial/elf-phdr-*.tar.gz testdata/adversarial/pkg-*.tar.gz; do
  tar xzf "$e" -O model.pt2 >"fuzz-bin/seeds-package/$(basename "$e" .tar.gz).pt2" 2>/dev/null || true
done
seed() {
  case $1 in
    envelope_reader) echo testdata/adversarial ;;
    metadata) echo fuzz-bin/seeds-metadata ;;
    wrapper) echo fuzz-bin/seeds-wrapper ;;
    elf) echo fuzz-bin/seeds-elf ;;
    wrapper_scan) echo fuzz-bin/seeds-package ;;
    input_checks) echo fuzz/seeds/input_checks ;;
    allowed_signers) echo fuzz/seeds/allowed_signers ;;
    remote_records) echo fuzz/seeds/remote_records ;;
    native_calls) echo fuzz/seeds/native_calls ;;
    safetensors_header) echo fuzz/seeds/safetensors_header ;;
  esac
}
for t in $targets; do
  mkdir -p "fuzz-bin/corpus/$t" "$out/crashes"
  ./fuzz-bin/$t "fuzz-bin/corpus/$t" "$(seed $t)" -fork=2 -max_total_time="$secs" \
    -rss_limit_mb=4096 -artifact_prefix="$out/crashes/$t-" >"$out/$t.log" 2>&1 &
done
wait
{
  for t in $targets; do
    echo "== $t: $(ls fuzz-bin/corpus/$t | wc -l) corpus inputs"
    grep -E "^#[0-9]+: cov|DONE|ERROR|deadly|crash" "$out/$t.log" | tail -3
  done
  echo "== crashes: $(ls "$out/crashes" | wc -l)"
} >"$out/summary.txt"
tar czf "$out/corpus.tar.gz" -C fuzz-bin/corpus .
tar czf "$out/logs.tar.gz" -C "$out" $(for t in $targets; do echo "$t.log"; done) crashes
rm -rf "$out"/*.log "$out/crashes"
cat "$out/summary.txt"
