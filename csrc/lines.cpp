#include "lines.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.hpp"

namespace fusekit {

// A NaN on either side is not dominated, so a run of dominating lines holds no NaN.
template <class T>
FUSEKIT_CLONES bool dominates(const T* __restrict a, const T* __restrict b, std::size_t n) {
    return !any_where<LaneFlag<T>>(n, [=](std::size_t j) { return !(b[j] >= a[j]); });
}

template bool dominates<float>(const float*, const float*, std::size_t);
template bool dominates<double>(const double*, const double*, std::size_t);

namespace {

#ifdef FUSEKIT_AVX512_KERNELS
// keep_rising on compare masks, 8 steps at a time, each mask spread to 8 flag bytes (pdep):
// the vector-type form packed 64-bit compare lanes into bytes with a dozen shuffles. Each
// entry is loaded once, its predecessors shifted in from the previous vector.
template <class T>
__attribute__((target("avx512f,bmi2"))) void keep_rising_avx512(const T* __restrict line,
                                                               unsigned char* __restrict rising,
                                                               std::size_t n) {
    std::size_t j = 0;
    __m512d previous = _mm512_setzero_pd();
    for (; j + 8 <= n; j += 8) {
        const __m512d entries = load8_avx512(line + j);
        const __m512d before = _mm512_castsi512_pd(_mm512_alignr_epi64(
            _mm512_castpd_si512(entries), _mm512_castpd_si512(previous), 7));
        const __mmask8 up = _mm512_cmp_pd_mask(entries, before, _CMP_GE_OQ);
        previous = entries;
        std::uint64_t flags;
        std::memcpy(&flags, rising + j, sizeof flags);
        flags &= _pdep_u64(up, 0x0101010101010101ULL) | (j == 0);  // rising[0]: no step
        std::memcpy(rising + j, &flags, sizeof flags);
    }
    for (j = std::max<std::size_t>(j, 1); j < n; ++j) rising[j] &= line[j] >= line[j - 1];
}
#endif

template <class T>
FUSEKIT_CLONES void keep_rising_portable(const T* __restrict line, unsigned char* __restrict rising,
                                         std::size_t n) {
#pragma omp simd
    for (std::size_t j = 1; j < n; ++j) rising[j] &= line[j] >= line[j - 1];
}

}  // namespace

template <class T>
void keep_rising(const T* line, unsigned char* rising, std::size_t n) {
#ifdef FUSEKIT_AVX512_KERNELS
    if (kHasAvx512) return keep_rising_avx512(line, rising, n);
#endif
    keep_rising_portable(line, rising, n);
}

template void keep_rising<float>(const float*, unsigned char*, std::size_t);
template void keep_rising<double>(const double*, unsigned char*, std::size_t);

template <class T>
FUSEKIT_CLONES void min_into(const T* __restrict line, double* __restrict acc, std::size_t n) {
#pragma omp simd
    for (std::size_t j = 0; j < n; ++j) {
        const double c = static_cast<double>(line[j]);
        acc[j] = c < acc[j] ? c : acc[j];
    }
}

template void min_into<float>(const float*, double*, std::size_t);
template void min_into<double>(const double*, double*, std::size_t);

template <class T>
FUSEKIT_CLONES bool valid_costs(const T* __restrict x, std::size_t n, bool& has_inf) {
    std::size_t bad = 0, infinite = 0;
    const T inf = std::numeric_limits<T>::infinity();
#pragma omp simd reduction(+ : bad, infinite)
    for (std::size_t k = 0; k < n; ++k) {
        bad += !(x[k] > -inf);
        infinite += x[k] == inf;
    }
    has_inf = infinite > 0;
    return bad == 0;
}

template bool valid_costs<float>(const float*, std::size_t, bool&);
template bool valid_costs<double>(const double*, std::size_t, bool&);

template <class T>
void block_minima(const T* first, std::size_t count, std::size_t step, std::size_t n,
                  std::size_t seen, double* block_min, std::size_t blocks) {
    std::size_t block = seen % blocks;
    for (std::size_t t = 0; t < count; ++t) {
        min_into(first + t * step * n, block_min + block * n, n);
        block = block + 1 == blocks ? 0 : block + 1;
    }
}

template void block_minima<float>(const float*, std::size_t, std::size_t, std::size_t,
                                  std::size_t, double*, std::size_t);
template void block_minima<double>(const double*, std::size_t, std::size_t, std::size_t,
                                   std::size_t, double*, std::size_t);

namespace {

// Row a becomes min(a, b) and row b max(a, b), column by column.
FUSEKIT_CLONES void order_rows(double* __restrict a, double* __restrict b, std::size_t n) {
#pragma omp simd
    for (std::size_t j = 0; j < n; ++j) {
        const double lo = a[j] < b[j] ? a[j] : b[j];
        b[j] = a[j] < b[j] ? b[j] : a[j];
        a[j] = lo;
    }
}

}  // namespace

void kth_smallest_columns(double* x, std::size_t rows, std::size_t n, std::size_t k,
                          double* out) {
    std::size_t size = 1;
    while (size < rows) size *= 2;
    // Batcher's odd-even merge sort network (the iterative form) over a power of two of
    // rows, the ones past `rows` +inf: a comparator that reaches one of them changes
    // nothing, so they are neither made nor compared.
    for (std::size_t p = 1; p < size; p *= 2) {
        for (std::size_t d = p; d >= 1; d /= 2) {
            for (std::size_t j = d % p; j + d < rows; j += 2 * d) {
                for (std::size_t i = 0; i < d && i + j + d < rows; ++i) {
                    if ((i + j) / (2 * p) == (i + j + d) / (2 * p)) {
                        order_rows(x + (i + j) * n, x + (i + j + d) * n, n);
                    }
                }
            }
        }
    }
    std::copy(x + (k - 1) * n, x + k * n, out);
}

template <class T>
FUSEKIT_CLONES bool shifted_line(const T* __restrict a, const T* __restrict b, std::size_t n) {
    const double shift = static_cast<double>(b[0]) - static_cast<double>(a[0]);
    LaneFlag<double> off = 0;
#pragma omp simd reduction(| : off)
    for (std::size_t j = 0; j < n; ++j) {
        off |= static_cast<double>(b[j]) - static_cast<double>(a[j]) != shift;
    }
    return off == 0;
}

template bool shifted_line<float>(const float*, const float*, std::size_t);
template bool shifted_line<double>(const double*, const double*, std::size_t);

template <class T>
FUSEKIT_CLONES double min_of(const T* __restrict line, std::size_t n) {
    double best = std::numeric_limits<double>::infinity();
#pragma omp simd reduction(min : best)
    for (std::size_t j = 0; j < n; ++j) {
        const double c = static_cast<double>(line[j]);
        best = c < best ? c : best;
    }
    return best;
}

template double min_of<float>(const float*, std::size_t);
template double min_of<double>(const double*, std::size_t);

template <class T>
FUSEKIT_CLONES void argmin_into(const T* __restrict line, std::int64_t index,
                                double* __restrict acc, std::int64_t* __restrict at,
                                std::size_t n) {
#pragma omp simd
    for (std::size_t j = 0; j < n; ++j) {
        const double c = static_cast<double>(line[j]);
        const bool smaller = c < acc[j];
        acc[j] = smaller ? c : acc[j];
        at[j] = smaller ? index : at[j];
    }
}

template void argmin_into<float>(const float*, std::int64_t, double*, std::int64_t*, std::size_t);
template void argmin_into<double>(const double*, std::int64_t, double*, std::int64_t*,
                                  std::size_t);

double kth_smallest(double* x, std::size_t n, std::size_t k) {
    std::nth_element(x, x + (k - 1), x + n);
    return x[k - 1];
}

double kth_smallest_bound(const double* line, std::size_t n, std::size_t k,
                          std::vector<double>& block_min) {
    if (n <= k) return std::numeric_limits<double>::infinity();
    const std::size_t blocks = std::min(n, 4 * k);
    block_min.assign(line, line + blocks);
    for (std::size_t j0 = blocks; j0 < n; j0 += blocks) {
        min_into(line + j0, block_min.data(), std::min(blocks, n - j0));
    }
    return kth_smallest(block_min.data(), blocks, k);
}

}  // namespace fusekit
