// Function multi-versioning: hot loops are compiled for AVX-512, AVX2 and the baseline
// and the loader picks the widest one the CPU supports, so a portable build still runs
// at full width. Disabled where the toolchain lacks ifunc support.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && \
    !defined(FUSEKIT_NO_CLONES)
#define FUSEKIT_CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define FUSEKIT_CLONES
#endif
