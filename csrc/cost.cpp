#include "cost.hpp"

#include <algorithm>
#include <vector>

#ifdef FUSEKIT_OPENMP
#include <omp.h>
#endif

namespace fusekit {

namespace {

// Rows of a and b are processed in tiles so both stay in cache while the inner loop runs
// over contiguous coordinates; the explicit difference (not |a|^2 - 2ab + |b|^2) keeps
// the result exact to rounding and never negative.
constexpr std::size_t kTileRows = 32;

}  // namespace

Status sqeuclidean_cost(const double* a, std::size_t n, const double* b, std::size_t m,
                        std::size_t p, double* out, int n_threads) {
    const std::size_t row_tiles = (n + kTileRows - 1) / kTileRows;
#ifdef FUSEKIT_OPENMP
#pragma omp parallel for schedule(dynamic) num_threads(n_threads > 0 ? n_threads : omp_get_max_threads())
#endif
    for (std::ptrdiff_t t = 0; t < static_cast<std::ptrdiff_t>(row_tiles); ++t) {
        const std::size_t i0 = static_cast<std::size_t>(t) * kTileRows;
        const std::size_t i1 = std::min(n, i0 + kTileRows);
        for (std::size_t j0 = 0; j0 < m; j0 += kTileRows) {
            const std::size_t j1 = std::min(m, j0 + kTileRows);
            for (std::size_t i = i0; i < i1; ++i) {
                const double* ai = a + i * p;
                for (std::size_t j = j0; j < j1; ++j) {
                    const double* bj = b + j * p;
                    double s = 0.0;
#pragma omp simd reduction(+ : s)
                    for (std::size_t q = 0; q < p; ++q) {
                        const double d = ai[q] - bj[q];
                        s += d * d;
                    }
                    out[i * m + j] = s;
                }
            }
        }
    }
    (void)n_threads;
    return Status::ok;
}

}  // namespace fusekit
