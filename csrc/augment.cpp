#include "augment.hpp"

#include <limits>

#include "simd.hpp"

namespace fusekit {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kClosed = std::numeric_limits<double>::quiet_NaN();  // penalty of a closed node

FUSEKIT_CLONES double start_nodes(double* __restrict d, const double* __restrict pot,
                                  const double* __restrict penalty, double offset,
                                  std::size_t n, double& best_free) {
    double best = kInf, best_end = kInf;
#pragma omp simd reduction(min : best, best_end)
    for (std::size_t k = 0; k < n; ++k) {
        const double dk = d[k] - offset - pot[k];
        d[k] = dk;
        best = dk < best ? dk : best;
        const double end = dk + penalty[k];
        best_end = end < best_end ? end : best_end;
    }
    best_free = best_end;
    return best;
}

// Without a branch per node: which nodes are free follows no pattern (a branch per node
// mispredicted on about every assigned one, 2% of a wide solve).
FUSEKIT_CLONES void end_penalties(const std::int64_t* __restrict match, double* __restrict penalty,
                                  std::size_t n) {
#pragma omp simd
    for (std::size_t k = 0; k < n; ++k) penalty[k] = match[k] < 0 ? 0.0 : kInf;
}

FUSEKIT_CLONES double open_minima(const double* __restrict d, const double* __restrict penalty,
                                  std::size_t n, double& best_free) {
    double best = kInf, best_end = kInf;
#pragma omp simd reduction(min : best, best_end)
    for (std::size_t k = 0; k < n; ++k) {
        const double reach = penalty[k] == penalty[k] ? d[k] : kInf;  // closed: NaN
        best = reach < best ? reach : best;
        const double end = reach + penalty[k];
        best_end = end < best_end ? end : best_end;
    }
    best_free = best_end;
    return best;
}

template <class T>
FUSEKIT_CLONES double relax_line(const T* __restrict line, double shift, std::int64_t from,
                                 const double* __restrict pot, double* __restrict d,
                                 std::int64_t* __restrict pred,
                                 const double* __restrict penalty, std::size_t n,
                                 double& best_free) {
    double best = kInf, best_end = kInf;
#pragma omp simd reduction(min : best, best_end)
    for (std::size_t k = 0; k < n; ++k) {
        const double nd = static_cast<double>(line[k]) - shift - pot[k];
        const bool open = penalty[k] == penalty[k];  // closed: NaN
        const bool update = open & (nd < d[k]);
        const double dk = update ? nd : d[k];
        d[k] = dk;
        pred[k] = update ? from : pred[k];
        const double reach = open ? dk : kInf;
        best = reach < best ? reach : best;
        const double end = reach + penalty[k];  // NaN when closed: never below best_end
        best_end = end < best_end ? end : best_end;
    }
    best_free = best_end;
    return best;
}

#ifdef FUSEKIT_AVX512_KERNELS
// relax_line in AVX-512 with mask registers: the running minima stay in registers and only
// the improved lanes are stored. The portable loop above keeps its reductions in memory
// (a store and reload every eight nodes); this is the searches' hottest loop.
template <class T>
__attribute__((target("avx512f"))) double relax_line_avx512(
    const T* __restrict line, double shift, std::int64_t from, const double* __restrict pot,
    double* __restrict d, std::int64_t* __restrict pred, const double* __restrict penalty,
    std::size_t n, double& best_free) {
    const __m512d inf = _mm512_set1_pd(kInf), offset = _mm512_set1_pd(shift);
    const __m512i source = _mm512_set1_epi64(from);
    __m512d best = inf, best_end = inf;
    std::size_t k = 0;
    for (; k + 8 <= n; k += 8) {
        const __m512d nd =
            _mm512_sub_pd(_mm512_sub_pd(load8_avx512(line + k), offset), _mm512_loadu_pd(pot + k));
        const __m512d end_cost = _mm512_loadu_pd(penalty + k);
        const __mmask8 open = _mm512_cmp_pd_mask(end_cost, end_cost, _CMP_ORD_Q);
        __m512d dk = _mm512_loadu_pd(d + k);
        const __mmask8 update = _mm512_mask_cmp_pd_mask(open, nd, dk, _CMP_LT_OQ);
        _mm512_mask_storeu_pd(d + k, update, nd);
        _mm512_mask_storeu_epi64(pred + k, update, source);
        dk = _mm512_mask_mov_pd(dk, update, nd);
        const __m512d reach = _mm512_mask_mov_pd(inf, open, dk);
        best = _mm512_min_pd(reach, best);
        best_end = _mm512_min_pd(_mm512_add_pd(reach, end_cost), best_end);  // NaN: skipped
    }
    double tail = _mm512_reduce_min_pd(best), tail_end = _mm512_reduce_min_pd(best_end);
    for (; k < n; ++k) {
        if (penalty[k] != penalty[k]) continue;
        const double nd = static_cast<double>(line[k]) - shift - pot[k];
        if (nd < d[k]) {
            d[k] = nd;
            pred[k] = from;
        }
        tail = d[k] < tail ? d[k] : tail;
        const double end = d[k] + penalty[k];
        tail_end = end < tail_end ? end : tail_end;
    }
    best_free = tail_end;
    return tail;
}

// find_tied in AVX-512: one masked compare per eight nodes and the first hit from its mask.
template <bool kFree>
__attribute__((target("avx512f"))) std::size_t find_tied_avx512(const double* __restrict d,
                                                                const double* __restrict penalty,
                                                                double dmin, std::size_t n) {
    const __m512d target = _mm512_set1_pd(dmin);
    std::size_t k = 0;
    for (; k + 8 <= n; k += 8) {
        const __m512d end_cost = _mm512_loadu_pd(penalty + k);
        __m512d key = _mm512_loadu_pd(d + k);
        if (kFree) key = _mm512_add_pd(key, end_cost);  // closed: NaN, never equal
        const __mmask8 open = kFree ? 0xff : _mm512_cmp_pd_mask(end_cost, end_cost, _CMP_ORD_Q);
        const unsigned hit = _mm512_mask_cmp_pd_mask(open, key, target, _CMP_EQ_OQ);
        if (hit != 0) return k + static_cast<std::size_t>(__builtin_ctz(hit));
    }
    for (;; ++k) {
        const double key = kFree ? d[k] + penalty[k] : d[k];
        if (key == dmin && penalty[k] == penalty[k]) return k;
    }
}

#endif

// First open node k >= from with d[k] (+ penalty[k] when kFree) == dmin, n if none.
template <bool kFree>
FUSEKIT_CLONES std::size_t find_tied(const double* __restrict d,
                                     const double* __restrict penalty, double dmin,
                                     std::size_t from, std::size_t n) {
    return first_where<LaneFlag<double>>(from, n, [=](std::size_t k) {
        const double key = kFree ? d[k] + penalty[k] : d[k];
        return (key == dmin) & (penalty[k] == penalty[k]);
    });
}

}  // namespace

void AugmentSearch::set_ends(const std::int64_t* match, std::size_t n) {
    end_penalties(match, penalty.data(), n);
}

double AugmentSearch::start(double offset, const double* pot, std::size_t n,
                            double& best_free) {
    for (std::size_t k : finished) penalty[k] = kInf;  // the last search's, assigned now
    finished.clear();
    return start_nodes(d.data(), pot, penalty.data(), offset, n, best_free);
}

std::size_t AugmentSearch::pick(double dmin, bool free_tied, std::size_t n) {
#ifdef FUSEKIT_AVX512_KERNELS
    if (kHasAvx512) {
        const std::size_t k =
            free_tied
                ? find_tied_avx512<true>(d.data(), penalty.data(), dmin, n)
                : find_tied_avx512<false>(d.data(), penalty.data(), dmin, n);
        penalty[k] = kClosed;
        finished.push_back(k);
        return k;
    }
#endif
    const std::size_t k = free_tied
                              ? find_tied<true>(d.data(), penalty.data(), dmin, 0, n)
                              : find_tied<false>(d.data(), penalty.data(), dmin, 0, n);
    penalty[k] = kClosed;
    finished.push_back(k);
    return k;
}

std::size_t AugmentSearch::pick_tied_after(double dmin, std::size_t from, std::size_t n) {
    const std::size_t k = find_tied<false>(d.data(), penalty.data(), dmin, from, n);
    if (k < n) {
        penalty[k] = kClosed;
        finished.push_back(k);
    }
    return k;
}

double AugmentSearch::smallest_open(std::size_t n, double& best_free) const {
    return open_minima(d.data(), penalty.data(), n, best_free);
}

template <class T>
double AugmentSearch::relax(const T* line, double shift, std::int64_t from, const double* pot,
                            std::size_t n, double& best_free) {
#ifdef FUSEKIT_AVX512_KERNELS
    if (kHasAvx512) {
        return relax_line_avx512(line, shift, from, pot, d.data(), pred.data(), penalty.data(), n,
                                 best_free);
    }
#endif
    return relax_line(line, shift, from, pot, d.data(), pred.data(), penalty.data(), n,
                      best_free);
}

template double AugmentSearch::relax<float>(const float*, double, std::int64_t, const double*,
                                            std::size_t, double&);
template double AugmentSearch::relax<double>(const double*, double, std::int64_t,
                                             const double*, std::size_t, double&);

}  // namespace fusekit
