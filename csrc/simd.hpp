// The CPU's vector width, at run time. Function multi-versioning: hot loops are compiled
// for AVX-512, AVX2 and the baseline and the loader picks the widest one the CPU supports,
// so a portable build still runs at full width (disabled where the toolchain lacks ifunc
// support); kVectorBytes sizes the kernels written with vector types, once for the process.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <utility>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
// Hand-written AVX-512 kernels (mask registers, which vector types do not reach), taken
// where kHasAvx512 says the CPU runs them.
#define FUSEKIT_AVX512_KERNELS 1
#endif

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && \
    !defined(FUSEKIT_NO_CLONES)
#define FUSEKIT_CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#define FUSEKIT_HAS_CLONES 1
#else
#define FUSEKIT_CLONES
#define FUSEKIT_HAS_CLONES 0
#endif

namespace fusekit {

// Whether the CPU runs AVX-512 code. FUSEKIT_NO_AVX512 (any value) says no to the explicit
// AVX-512 paths and 64-byte kernels (not to the clones, which the loader picks), so that
// tests cover the other paths here too; read once, at load (__builtin_cpu_init first: this may
// run before the constructor that fills in the CPU's features).
#if defined(__GNUC__) && defined(__x86_64__)
inline const bool kHasAvx512 = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f")) &&
                               !std::getenv("FUSEKIT_NO_AVX512");
#else
inline const bool kHasAvx512 = false;
#endif

// The bytes of a GCC/Clang vector type that the CPU runs as such: 64 where the AVX-512
// clones run; elsewhere 32, since 64-byte vectors compiled for AVX2 turn into scalar code (measured
// 4-12x slower). Kernels written with vector types are instantiated for both.
inline const std::size_t kVectorBytes = FUSEKIT_HAS_CLONES && kHasAvx512 ? 64 : 32;

// GCC/Clang vector types of kBytes (a template parameter does not reach the attribute).
template <std::size_t kBytes>
struct Vectors;
template <>
struct Vectors<64> {
    typedef double Doubles __attribute__((vector_size(64)));
};
template <>
struct Vectors<32> {
    typedef double Doubles __attribute__((vector_size(32)));
};

// x with lane l taken from lane l ^ kStep (a butterfly step across the lanes; kLane: 0, 1, ...
// for each lane).
template <std::size_t kStep, class Lanes, std::size_t... kLane>
__attribute__((always_inline)) inline Lanes exchanged(const Lanes& x,
                                                      std::index_sequence<kLane...>) {
    return __builtin_shufflevector(x, x, (kLane ^ kStep)...);
}

// A flag as wide as T, for "any" reductions over compares of T: GCC packs int flags from
// 64-bit compares with a dozen shuffles per chunk, and ORs flags of the compares' own width
// as they are.
template <class T>
using LaneFlag = std::conditional_t<sizeof(T) == 8, std::int64_t, std::int32_t>;

constexpr std::size_t kScanChunk = 8;

// Scans for k where hit(k) holds, kScanChunk k at a time with one branch (Flag: LaneFlag of
// the values hit compares; inlined into the caller's clones): the start of the first chunk
// from `from` that holds one, else of the last, shorter one below n.
template <class Flag, class Hit>
inline std::size_t first_chunk_where(std::size_t from, std::size_t n, Hit hit) {
    std::size_t k = from;
    for (; k + kScanChunk <= n; k += kScanChunk) {
        Flag any = 0;
#pragma omp simd reduction(| : any)
        for (std::size_t l = 0; l < kScanChunk; ++l) any |= hit(k + l);
        if (any) break;
    }
    return k;
}

// The first k in [from, n) where hit(k) holds, n if none.
template <class Flag, class Hit>
inline std::size_t first_where(std::size_t from, std::size_t n, Hit hit) {
    std::size_t k = first_chunk_where<Flag>(from, n, hit);
    while (k < n && !hit(k)) ++k;
    return k;
}

// Whether hit(k) holds for some k < n (without finding where, which costs a scalar pass).
template <class Flag, class Hit>
inline bool any_where(std::size_t n, Hit hit) {
    std::size_t k = first_chunk_where<Flag>(0, n, hit);
    if (k + kScanChunk <= n) return true;
    for (; k < n; ++k) {
        if (hit(k)) return true;
    }
    return false;
}

// How many entries from p to the next multiple of kEntries entries' bytes (0 on one): loads of
// kEntries entries from there on stay within cache lines, where the rows of a numpy matrix
// start anywhere (loads straddling two lines made 2000-column rows 8-10% slower).
template <std::size_t kEntries, class T>
inline std::size_t entries_to_boundary(const T* p) {
    constexpr std::size_t kBytes = kEntries * sizeof(T);
    return (kBytes - reinterpret_cast<std::uintptr_t>(p) % kBytes) % kBytes / sizeof(T);
}

#ifdef FUSEKIT_AVX512_KERNELS
// The first `count` of eight lanes (all eight from 8 on).
inline __mmask8 first_lanes(std::size_t count) {
    return static_cast<__mmask8>(count >= 8 ? 0xFF : (1u << count) - 1);
}

// Eight costs as doubles; the masked form reads only the lanes in `lanes` (a row's tail).
__attribute__((target("avx512f"))) inline __m512d load8_avx512(const double* p) {
    return _mm512_loadu_pd(p);
}
__attribute__((target("avx512f"))) inline __m512d load8_avx512(const float* p) {
    return _mm512_cvtps_pd(_mm256_loadu_ps(p));
}
__attribute__((target("avx512f"))) inline __m512d load8_avx512(const double* p, __mmask8 lanes) {
    return _mm512_maskz_loadu_pd(lanes, p);
}
__attribute__((target("avx512f"))) inline __m512d load8_avx512(const float* p, __mmask8 lanes) {
    return _mm512_cvtps_pd(_mm512_castps512_ps256(_mm512_maskz_loadu_ps(lanes, p)));
}
// The costs at p[index[l]] as doubles, for the lanes in `lanes` (others 0).
__attribute__((target("avx512f"))) inline __m512d gather8_avx512(const double* p, __m512i index,
                                                                __mmask8 lanes) {
    return _mm512_mask_i64gather_pd(_mm512_setzero_pd(), lanes, index, p, 8);
}
__attribute__((target("avx512f"))) inline __m512d gather8_avx512(const float* p, __m512i index,
                                                                __mmask8 lanes) {
    return _mm512_cvtps_pd(_mm512_mask_i64gather_ps(_mm256_setzero_ps(), lanes, index, p, 4));
}
#endif

}  // namespace fusekit
