#!/usr/bin/env bash
# Prints the LD_PRELOAD vLLM-CPU recommends "for best performance", from what this machine has:
# Intel OpenMP (libiomp5, installed into the venv by the intel-openmp package of the vLLM lock)
# and tcmalloc (Debian's libtcmalloc-minimal4, when installed). Empty on CUDA machines' venvs
# without libiomp5. BENCHMARKS.md section 9 has the measurement behind it.
venv="${1:-.venv}"
preload=()
[ -f "$venv/lib/libiomp5.so" ] && preload+=("$(cd "$venv/lib" && pwd)/libiomp5.so")
for tcmalloc in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib/x86_64-linux-gnu/libtcmalloc.so.4 \
                /usr/lib64/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc.so.4; do
    if [ -f "$tcmalloc" ]; then preload+=("$tcmalloc"); break; fi
done
(IFS=:; echo "${preload[*]}")
