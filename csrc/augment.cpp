#include "augment.hpp"

#include <limits>

#include "simd.hpp"

namespace fusekit {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

FUSEKIT_CLONES double start_nodes(double* __restrict d, const double* __restrict pot,
                                  std::int64_t* __restrict done,
                                  const double* __restrict penalty, double offset,
                                  std::size_t n, double& best_free) {
    double best = kInf, best_end = kInf;
#pragma omp simd reduction(min : best, best_end)
    for (std::size_t k = 0; k < n; ++k) {
        const double dk = d[k] - offset - pot[k];
        d[k] = dk;
        done[k] = 0;
        best = dk < best ? dk : best;
        const double end = dk + penalty[k];
        best_end = end < best_end ? end : best_end;
    }
    best_free = best_end;
    return best;
}

template <class T>
FUSEKIT_CLONES double relax_line(const T* __restrict line, double shift, std::int64_t from,
                                 const double* __restrict pot, double* __restrict d,
                                 std::int64_t* __restrict pred,
                                 const std::int64_t* __restrict done,
                                 const double* __restrict penalty, std::size_t n,
                                 double& best_free) {
    double best = kInf, best_end = kInf;
#pragma omp simd reduction(min : best, best_end)
    for (std::size_t k = 0; k < n; ++k) {
        const double nd = static_cast<double>(line[k]) - shift - pot[k];
        const bool update = (done[k] == 0) & (nd < d[k]);
        const double dk = update ? nd : d[k];
        d[k] = dk;
        pred[k] = update ? from : pred[k];
        const double open = done[k] != 0 ? kInf : dk;
        best = open < best ? open : best;
        const double end = open + penalty[k];
        best_end = end < best_end ? end : best_end;
    }
    best_free = best_end;
    return best;
}

// First open node k with d[k] (+ penalty[k] when kFree) == dmin; one exists. Tested eight
// at a time so that the scan is mostly vector compares.
template <bool kFree>
FUSEKIT_CLONES std::size_t find_tied(const double* __restrict d,
                                     const std::int64_t* __restrict done,
                                     const double* __restrict penalty, double dmin,
                                     std::size_t n) {
    constexpr std::size_t kChunk = 8;
    std::size_t k0 = 0;
    for (; k0 + kChunk <= n; k0 += kChunk) {
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (std::size_t l = 0; l < kChunk; ++l) {
            const double key = kFree ? d[k0 + l] + penalty[k0 + l] : d[k0 + l];
            hit |= (key == dmin) & (done[k0 + l] == 0);
        }
        if (hit) break;
    }
    for (std::size_t k = k0;; ++k) {
        const double key = kFree ? d[k] + penalty[k] : d[k];
        if (key == dmin && done[k] == 0) return k;
    }
}

}  // namespace

double AugmentSearch::start(double offset, const double* pot, std::size_t n,
                            double& best_free) {
    finished.clear();
    return start_nodes(d.data(), pot, done.data(), penalty.data(), offset, n, best_free);
}

std::size_t AugmentSearch::pick(double dmin, bool free_tied, std::size_t n) {
    const std::size_t k = free_tied
                              ? find_tied<true>(d.data(), done.data(), penalty.data(), dmin, n)
                              : find_tied<false>(d.data(), done.data(), penalty.data(), dmin, n);
    done[k] = 1;
    finished.push_back(k);
    return k;
}

template <class T>
double AugmentSearch::relax(const T* line, double shift, std::int64_t from, const double* pot,
                            std::size_t n, double& best_free) {
    return relax_line(line, shift, from, pot, d.data(), pred.data(), done.data(),
                      penalty.data(), n, best_free);
}

template double AugmentSearch::relax<float>(const float*, double, std::int64_t, const double*,
                                            std::size_t, double&);
template double AugmentSearch::relax<double>(const double*, double, std::int64_t,
                                             const double*, std::size_t, double&);

}  // namespace fusekit
