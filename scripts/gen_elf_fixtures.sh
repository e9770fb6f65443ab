#!/bin/sh
# Regenerate testdata/elf: four small real shared objects for the C++-runtime
# test (crates/tcg-core/src/artifact/package/cxx_runtime.rs), built once with
# the system compiler and committed, so that CI (which may have no g++) tests
# real linker output. Needs g++ with libstdc++.a (`g++ -print-file-name=libstdc++.a`).
#
#   cxx-shared.so         g++ -shared: imports the runtime, DT_NEEDED libstdc++.so.6
#   cxx-static.so         -static-libstdc++ -static-libgcc, stripped: defines it in .dynsym
#   cxx-static-hidden.so  the same with --exclude-libs,ALL, unstripped: defines it in .symtab only
#   c-nostdlib.so         gcc -nostdlib: no C++ at all, an empty DT_NEEDED
set -eu
out="$(cd "$(dirname "$0")/.." && pwd)/testdata/elf"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
cat >"$work/k.cpp" <<'CPP'
#include <stdexcept>
extern "C" int tcg_kernel(int x) {
  try { if (x < 0) throw std::runtime_error("negative"); return x * 2; }
  catch (const std::exception&) { return -1; }
}
CPP
printf 'int tcg_kernel(int x) { return x * 2; }\n' >"$work/c.c"
CXX="${CXX:-g++}"
CC="${CC:-gcc}"
common="-shared -fPIC -Os -Wl,--gc-sections"
$CXX $common -o "$work/cxx-shared.so" "$work/k.cpp"
$CXX $common -static-libstdc++ -static-libgcc -o "$work/static.so" "$work/k.cpp"
strip --strip-all -o "$work/cxx-static.so" "$work/static.so"
$CXX $common -static-libstdc++ -static-libgcc -Wl,--exclude-libs,ALL -o "$work/cxx-static-hidden.so" "$work/k.cpp"
$CC $common -nostdlib -o "$work/c-nostdlib.so" "$work/c.c"
for f in cxx-shared cxx-static cxx-static-hidden c-nostdlib; do
  gzip -n -9 -c "$work/$f.so" >"$out/$f.so.gz"
done
ls -l "$out"
