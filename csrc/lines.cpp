#include "lines.hpp"

#include <algorithm>
#include <limits>

#include "simd.hpp"

namespace fusekit {

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
FUSEKIT_CLONES bool min_into_valid(const T* __restrict line, double* __restrict acc,
                                   std::size_t n) {
    std::size_t bad = 0;
    const T inf = std::numeric_limits<T>::infinity();
#pragma omp simd reduction(+ : bad)
    for (std::size_t j = 0; j < n; ++j) {
        const double c = static_cast<double>(line[j]);
        acc[j] = c < acc[j] ? c : acc[j];
        bad += !(line[j] > -inf);
    }
    return bad == 0;
}

template bool min_into_valid<float>(const float*, double*, std::size_t);
template bool min_into_valid<double>(const double*, double*, std::size_t);

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
