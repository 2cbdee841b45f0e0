#include "lap.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "augment.hpp"
#include "candidates.hpp"
#include "lines.hpp"
#include "rectangular.hpp"
#include "reduction.hpp"
#include "simd.hpp"

namespace fusekit {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Below this size the dense solver is faster than candidate lists (measured on uniform
// matrices: 300x300 dense 0.29 ms vs 0.47 ms; from 400x400 the candidates win).
constexpr std::size_t kMinCandidateSquare = 384;

// Whether new neurons, a share of `neurons`, are many: half of them, or from 32 on, where
// the dense solver's wandering costs more than the tall solver.
bool many_new(double share, std::size_t neurons) {
    return share >= 0.5 || share * static_cast<double>(neurons) >= 32.0;
}

// The share of `neurons` (a wide layout's rows) that are new for certain: those that the
// `lines` columns outside the slots cannot all take.
double forced_new(const Run& slots, std::size_t neurons, std::size_t lines) {
    const std::size_t existing = lines - (slots.end - slots.head + 1);
    return neurons > existing ? 1.0 - static_cast<double>(existing) / static_cast<double>(neurons)
                              : 0.0;
}

// The dense solver's first rows that tell whether a wide problem's rows are mostly new
// neurons (their cheapest column a slot): the first reduction pass reads them anyway.
constexpr std::size_t kProbedRows = 16;

// Lane by lane, the two smallest of two pairs (low <= high in each) into low, high.
template <class Lanes>
__attribute__((always_inline)) inline void merge_pairs(Lanes& low, Lanes& high, const Lanes& low2,
                                                       const Lanes& high2) {
    const Lanes least_high = high2 < high ? high2 : high;
    const Lanes most_low = low2 > low ? low2 : low;
    high = most_low < least_high ? most_low : least_high;
    low = low2 < low ? low2 : low;
}

// Each lane's pair and total merged with those of the lanes kStep, kStep / 2, ..., 1 apart:
// every lane then holds the two smallest and the total of all of them.
template <std::size_t kStep, class Lanes>
__attribute__((always_inline)) inline void merge_lanes(Lanes& low, Lanes& high, Lanes& total) {
    if constexpr (kStep > 0) {
        constexpr auto lanes = std::make_index_sequence<sizeof(Lanes) / sizeof(double)>{};
        merge_pairs(low, high, exchanged<kStep>(low, lanes), exchanged<kStep>(high, lanes));
        total += exchanged<kStep>(total, lanes);
        merge_lanes<kStep / 2>(low, high, total);
    }
}

// Smallest and second smallest reduced cost row[j] - v[j] (m >= 2), in one pass of
// min/max chains on values only: a lane's pair (a <= b) takes h as a = min(a, h),
// b = min(b, max(a, h)). Where they are is found afterwards (first_at), since tracking
// indices doubled the work per entry (two compares and four blends) and half of a short
// row's time went to merging the lanes' indices. sum, of all of them, is finite only if
// they are: a check of the values in a pass made anyway. kVectors vectors of kBytes
// (kVectorBytes) run side by side so that their chains overlap.
template <class T, std::size_t kBytes>
FUSEKIT_CLONES void two_smallest(const T* __restrict row, const double* __restrict v,
                                 std::size_t m, double& min1, double& min2, double& sum) {
    typedef typename Vectors<kBytes>::Doubles Lanes;
    constexpr std::size_t kWidth = kBytes / sizeof(double), kVectors = 4;
    constexpr std::size_t kBlock = kWidth * kVectors;
    Lanes a[kVectors], b[kVectors], total[kVectors];
    for (std::size_t s = 0; s < kVectors; ++s) {
        for (std::size_t l = 0; l < kWidth; ++l) {
            total[s][l] = 0.0;
            a[s][l] = b[s][l] = kInf;
        }
    }
    const auto offer = [&](std::size_t s, const Lanes& h) {
        const Lanes high = h > a[s] ? h : a[s];
        b[s] = high < b[s] ? high : b[s];
        a[s] = h < a[s] ? h : a[s];
    };
    const auto take = [&](std::size_t s, std::size_t j) {
        Lanes h, w;
        for (std::size_t l = 0; l < kWidth; ++l) h[l] = static_cast<double>(row[j + l]);
        std::memcpy(&w, v + j, sizeof w);
        h -= w;
        total[s] += h;
        offer(s, h);
    };
    // Entries j..end (fewer than a vector's), padded with +inf.
    sum = 0.0;
    const auto take_part = [&](std::size_t s, std::size_t j, std::size_t end) {
        Lanes h;
        for (std::size_t l = 0; l < kWidth; ++l) {
            h[l] = j + l < end ? static_cast<double>(row[j + l]) - v[j + l] : kInf;
            sum += j + l < end ? h[l] : 0.0;
        }
        offer(s, h);
    };
    // The first entries up to a vector boundary (entries_to_boundary) apart.
    std::size_t j = std::min(m, entries_to_boundary<kWidth>(row));
    if (j > 0) take_part(1, 0, j);
    for (; j + kBlock <= m; j += kBlock) {
        for (std::size_t s = 0; s < kVectors; ++s) take(s, j + s * kWidth);
    }
    for (; j + kWidth <= m; j += kWidth) take(0, j);
    if (j < m) take_part(0, j, m);
    // The pairs merged: the vectors', then the lanes' in butterfly steps (lane by lane in
    // scalar code, the lanes' merge made 150x50 problems 4-7% slower).
    for (std::size_t s = 1; s < kVectors; ++s) {
        merge_pairs(a[0], b[0], a[s], b[s]);
        total[0] += total[s];
    }
    merge_lanes<kWidth / 2>(a[0], b[0], total[0]);
    min1 = a[0][0];
    min2 = b[0][0];
    sum += total[0][0];
}

// The first column j >= from with row[j] - v[j] == value; m if none.
template <class T>
FUSEKIT_CLONES std::size_t first_at(const T* __restrict row, const double* __restrict v,
                                    std::size_t from, std::size_t m, double value) {
    return first_where<LaneFlag<double>>(from, m, [=](std::size_t j) {
        return static_cast<double>(row[j]) - v[j] == value;
    });
}

#ifdef FUSEKIT_AVX512_KERNELS
// Which of the 8 entries from j (of `lanes`) have row[j] - v[j] == target, as bits.
template <class T>
__attribute__((target("avx512f"))) inline unsigned equal_avx512(const T* row, const double* v,
                                                               std::size_t j, __m512d target,
                                                               __mmask8 lanes = 0xff) {
    const __m512d h =
        _mm512_sub_pd(load8_avx512(row + j, lanes), _mm512_maskz_loadu_pd(lanes, v + j));
    return _mm512_mask_cmp_pd_mask(lanes, h, target, _CMP_EQ_OQ);
}

// first_at on compare masks, four vectors to a branch (the vector-type form tests a 64-byte
// compare's lanes one by one).
template <class T>
__attribute__((target("avx512f"))) std::size_t first_at_avx512(const T* __restrict row,
                                                               const double* __restrict v,
                                                               std::size_t from, std::size_t m,
                                                               double value) {
    const __m512d target = _mm512_set1_pd(value);
    std::size_t j = from;
    // to a vector boundary first (entries_to_boundary)
    const std::size_t head = std::min(m, j + entries_to_boundary<8>(row + j));
    if (j < head) {
        const unsigned found = equal_avx512(row, v, j, target, first_lanes(head - j));
        if (found != 0) return j + static_cast<std::size_t>(__builtin_ctz(found));
        j = head;
    }
    for (; j + 32 <= m; j += 32) {
        const unsigned found = equal_avx512(row, v, j, target) |
                               equal_avx512(row, v, j + 8, target) << 8 |
                               equal_avx512(row, v, j + 16, target) << 16 |
                               equal_avx512(row, v, j + 24, target) << 24;
        if (found != 0) return j + static_cast<std::size_t>(__builtin_ctz(found));
    }
    for (; j < m; j += 8) {
        const unsigned found = equal_avx512(row, v, j, target, first_lanes(m - j));
        if (found != 0) return j + static_cast<std::size_t>(__builtin_ctz(found));
    }
    return m;
}
#endif

// first_at on the widest kernel the CPU runs.
template <class T>
std::size_t first_reduced_at(const T* row, const double* v, std::size_t from, std::size_t m,
                             double value) {
#ifdef FUSEKIT_AVX512_KERNELS
    if (kHasAvx512) return first_at_avx512(row, v, from, m, value);
#endif
    return first_at(row, v, from, m, value);
}

#ifdef FUSEKIT_AVX512_KERNELS
// Entries j.. of `lanes` into a lane minimum and sum (two_smallest_avx512).
template <class T>
__attribute__((target("avx512f"), always_inline)) inline void take_lanes_avx512(
    const T* row, const double* v, std::size_t j, __mmask8 lanes, __m512d& low,
    __m512d& total) {
    const __m512d h = _mm512_mask_sub_pd(_mm512_set1_pd(kInf), lanes, load8_avx512(row + j, lanes),
                                         _mm512_maskz_loadu_pd(lanes, v + j));
    total = _mm512_mask_add_pd(total, lanes, total, h);
    low = _mm512_min_pd(h, low);
}

// two_smallest in AVX-512 with one chain per lane instead of a pair: each of 32 lanes keeps
// the minimum of its entries only (entry j >= head in lane (j - head) mod 32; the head, the
// entries before the row's first vector boundary, in lanes 24 on). The second smallest is
// then the other lanes' smallest or the winning lane's own second, found in a look at that
// lane's m / 32 entries (eight to a gather), which also tells where the smallest is (at; m
// when the two tie). The pair cost three operations per vector where this costs one, on the
// two ports that run 64-byte vectors (544-entry rows from L2: 2.3 cycles a vector, 1.7 now),
// and the column a second look at the row.
template <class T>
__attribute__((target("avx512f"))) void two_smallest_avx512(const T* __restrict row,
                                                           const double* __restrict v,
                                                           std::size_t m, double& min1,
                                                           double& min2, std::size_t& at,
                                                           double& sum) {
    const __m512d inf = _mm512_set1_pd(kInf), zero = _mm512_setzero_pd();
    __m512d low[4] = {inf, inf, inf, inf}, total[4] = {zero, zero, zero, zero};
    const std::size_t head = std::min(m, entries_to_boundary<8>(row));
    if (head > 0) take_lanes_avx512(row, v, 0, first_lanes(head), low[3], total[3]);
    std::size_t j = head;
    for (; j + 32 <= m; j += 32) {
        for (std::size_t s = 0; s < 4; ++s) {
            const __m512d h =
                _mm512_sub_pd(load8_avx512(row + j + 8 * s), _mm512_loadu_pd(v + j + 8 * s));
            total[s] = _mm512_add_pd(total[s], h);
            low[s] = _mm512_min_pd(h, low[s]);
        }
    }
    for (std::size_t s = 0; s < 4 && j + 8 * s < m; ++s) {
        take_lanes_avx512(row, v, j + 8 * s, first_lanes(m - j - 8 * s), low[s], total[s]);
    }
    sum = _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(total[0], total[1]),
                                             _mm512_add_pd(total[2], total[3])));
    const double first = _mm512_reduce_min_pd(
        _mm512_min_pd(_mm512_min_pd(low[0], low[1]), _mm512_min_pd(low[2], low[3])));
    const __m512d f = _mm512_set1_pd(first);
    std::uint32_t winners = 0;  // the lanes whose minimum is the smallest, as bits
    for (std::size_t s = 0; s < 4; ++s) {
        const __mmask8 equal = _mm512_cmp_pd_mask(low[s], f, _CMP_EQ_OQ);
        winners |= static_cast<std::uint32_t>(equal) << (8 * s);
    }
    min1 = min2 = first;
    at = m;
    if ((winners & (winners - 1)) != 0) return;  // two lanes tie
    __m512d second = inf;
    for (std::size_t s = 0; s < 4; ++s) {
        const auto others = static_cast<__mmask8>(~winners >> (8 * s));
        second = _mm512_min_pd(second, _mm512_mask_blend_pd(others, inf, low[s]));
    }
    // The winning lane's entries: the first holding the smallest, the others' smallest.
    const auto lane = static_cast<std::size_t>(__builtin_ctz(winners));
    std::size_t ties = 0;
    if (lane >= 24 && lane - 24 < head) {  // its entry in the head comes first
        const double h = static_cast<double>(row[lane - 24]) - v[lane - 24];
        ties = h == first;
        at = h == first ? lane - 24 : m;
        second = _mm512_min_pd(second, _mm512_set1_pd(h == first ? kInf : h));
    }
    const __m512i steps = _mm512_setr_epi64(0, 32, 64, 96, 128, 160, 192, 224);
    const __m512i end = _mm512_set1_epi64(static_cast<long long>(m));
    for (std::size_t k = head + lane; k < m; k += 256) {
        const __m512i at8 = _mm512_add_epi64(_mm512_set1_epi64(static_cast<long long>(k)), steps);
        const __mmask8 in = _mm512_cmplt_epu64_mask(at8, end);
        const __m512d h = _mm512_sub_pd(gather8_avx512(row, at8, in), gather8_avx512(v, at8, in));
        const __mmask8 is_first = _mm512_mask_cmp_pd_mask(in, h, f, _CMP_EQ_OQ);
        if (is_first != 0) at = k + 32 * static_cast<std::size_t>(__builtin_ctz(is_first));
        ties += static_cast<std::size_t>(__builtin_popcount(is_first));
        second = _mm512_min_pd(second, _mm512_mask_blend_pd(in & ~is_first, inf, h));
    }
    if (ties > 1) return;  // the lane holds it twice
    min2 = _mm512_reduce_min_pd(second);
    if (!(first < min2)) at = m;
}
#endif

// Rows of at least this many entries take two_smallest_avx512 (measured on random 50-row
// tops: 250 entries 4% slower, 350 6% faster, 150 13% slower: a short row's time goes to
// the last reductions and the look at the lane, whose latencies chain).
constexpr std::size_t kMinLaneLook = 256;

// The two smallest reduced costs of a row (two_smallest), on the widest kernel the CPU runs,
// and the first column holding the smallest when the two differ (at; m when they tie).
template <class T>
void row_two_smallest(const T* row, const double* v, std::size_t m, double& min1, double& min2,
                      std::size_t& at, double& sum) {
#ifdef FUSEKIT_AVX512_KERNELS
    if (kHasAvx512 && m >= kMinLaneLook) return two_smallest_avx512(row, v, m, min1, min2, at, sum);
#endif
    if (kVectorBytes == 64) {
        two_smallest<T, 64>(row, v, m, min1, min2, sum);
    } else {
        two_smallest<T, 32>(row, v, m, min1, min2, sum);
    }
    at = min1 < min2 ? first_reduced_at(row, v, 0, m, min1) : m;
}

// min over j != skip of row[j] - v[j].
template <class T>
FUSEKIT_CLONES double min_except(const T* __restrict row, const double* __restrict v,
                                 std::size_t skip, std::size_t m) {
    double best = kInf;
#pragma omp simd reduction(min : best)
    for (std::size_t j = 0; j < m; ++j) {
        const double h = j == skip ? kInf : static_cast<double>(row[j]) - v[j];
        best = h < best ? h : best;
    }
    return best;
}

// What is known of a matrix's values when the dense solver starts: checked and finite;
// checked, with forbidden (+inf) pairs; or not checked yet (wide matrices, and tall ones
// solved through their transpose, which the solver checks in its first pass).
enum class Values { finite, forbidden, unchecked };

// The dense solver for square and wide (nr < nc) problems: rows are augmented one by one
// over all columns, each search step reading one row of the matrix. Keeps the column
// potentials v; row potentials are implicit, u[i] = c[i, x[i]] - v[x[i]]. Columns start at
// v = 0 and v only decreases, so a wide problem's unassigned columns keep the largest
// potential, 0: its optimality conditions hold without padding. Between phases every
// assigned row is tight at its smallest reduced cost.
template <class T>
class Solver {
   public:
    // Row i of the matrix starts at cost + i * stride (stride >= nc).
    Solver(const T* cost, std::size_t nr, std::size_t nc, std::size_t stride)
        : c_(cost), nr_(nr), nc_(nc), stride_(stride), v_(nc, 0.0), x_(nr, -1), y_(nc, -1) {}

    const std::vector<double>& potentials() const { return v_; }
    const std::vector<std::int64_t>& row_solution() const { return x_; }

    // PFNM's new-neuron slots, columns slots.head..end: run() declines (declined(), nothing
    // solved) when the first kProbedRows rows of its first reduction pass say that many rows
    // are new neurons, whose searches would wander through the slots.
    void watch(const Run& slots) {
        slots_ = slots;
        watching_ = true;
    }
    bool declined() const { return declined_; }

    Status run(Values values) {
        std::vector<std::int64_t> free_rows;
        if (values == Values::finite && nr_ == nc_) {
            column_reduction(free_rows);
        } else {
            all_rows(free_rows);
        }
        // Unchecked (wide) matrices are checked as the row reduction's first pass reads them;
        // on a doubt, row by row.
        if (nc_ >= 2 && !augmenting_row_reduction(free_rows, values == Values::unchecked)) {
            bool has_inf = false;
            for (std::size_t i = 0; i < nr_; ++i) {
                if (!valid_costs(row(i), nc_, has_inf)) return Status::non_finite;
            }
            restart(free_rows);
            augmenting_row_reduction(free_rows, false);  // finite costs whose sum overflowed
        }
        // The searches' arrays only when a row is left (often none: 50x550 random vectors).
        if (declined_ || free_rows.empty()) return Status::ok;
        AugmentSearch search(nc_);
        search.set_ends(y_.data(), nc_);
        for (std::int64_t f : free_rows) {
            if (x_[static_cast<std::size_t>(f)] >= 0) continue;
            const Status s = augment(f, search);
            if (s != Status::ok) return s;
        }
        return Status::ok;
    }

   private:
    const T* row(std::size_t i) const { return c_ + i * stride_; }
    double at(std::size_t i, std::size_t j) const { return static_cast<double>(row(i)[j]); }

    // Jonker-Volgenant column reduction and reduction transfer (square problems).
    void column_reduction(std::vector<std::int64_t>& free_rows) {
        std::vector<std::int64_t> argmin(nr_, 0);
        for (std::size_t j = 0; j < nr_; ++j) v_[j] = at(0, j);
        for (std::size_t i = 1; i < nr_; ++i) {
            argmin_into(row(i), static_cast<std::int64_t>(i), v_.data(), argmin.data(), nr_);
        }
        std::vector<int> matches(nr_, 0);
        for (std::size_t jj = nr_; jj-- > 0;) {
            const auto i = static_cast<std::size_t>(argmin[jj]);
            if (++matches[i] == 1) {
                x_[i] = static_cast<std::int64_t>(jj);
                y_[jj] = static_cast<std::int64_t>(i);
            } else if (v_[jj] < v_[static_cast<std::size_t>(x_[i])]) {
                y_[static_cast<std::size_t>(x_[i])] = -1;
                x_[i] = static_cast<std::int64_t>(jj);
                y_[jj] = static_cast<std::int64_t>(i);
            }
        }
        for (std::size_t i = 0; i < nr_; ++i) {
            if (matches[i] == 0) {
                free_rows.push_back(static_cast<std::int64_t>(i));
            } else if (matches[i] == 1) {
                // Transfer the row's slack to its column so the row sits at its second best.
                const auto j1 = static_cast<std::size_t>(x_[i]);
                const double second = min_except(row(i), v_.data(), j1, nr_);
                if (second < kInf) v_[j1] -= second - (at(i, j1) - v_[j1]);
            }
        }
    }

    void all_rows(std::vector<std::int64_t>& free_rows) const {
        free_rows.resize(nr_);
        for (std::size_t i = 0; i < nr_; ++i) free_rows[i] = static_cast<std::int64_t>(i);
    }

    // Back to no assignment, every row free.
    void restart(std::vector<std::int64_t>& free_rows) {
        std::fill(v_.begin(), v_.end(), 0.0);
        std::fill(x_.begin(), x_.end(), -1);
        std::fill(y_.begin(), y_.end(), -1);
        all_rows(free_rows);
    }

    // Jonker-Volgenant augmenting row reduction, in passes over the free rows. With check,
    // stops (false) at the first pass's first row holding NaN or -inf: its sum is then NaN
    // or -inf, where forbidden pairs (+inf) make it +inf. A row with one allowed column takes
    // it as it is (its second cheapest, +inf, leaves nothing to transfer); a row with none is
    // left to the search, which finds the problem infeasible. (Skipping the reduction when
    // a pair was forbidden made such problems 2-3x slower to solve.)
    // Passes go on while each frees a 32nd of the rows still free (JV's two passes left 149
    // of 500 rows to augment on random vectors 500x1000, nine passes 67: 20-28% faster, as
    // for a uniform top; a 16th stopped at 88), and stop at the first after the second
    // that does not.
    bool augmenting_row_reduction(std::vector<std::int64_t>& free_rows, bool check) {
        for (int pass = 0; pass < kMaxReductionPasses; ++pass) {
            std::size_t k = 0;
            const std::size_t previous = free_rows.size();
            std::size_t kept = 0;
            while (k < previous) {
                const auto i = static_cast<std::size_t>(free_rows[k++]);
                double umin, usubmin, sum;
                std::size_t at;
                row_two_smallest(row(i), v_.data(), nc_, umin, usubmin, at, sum);
                if (check && pass == 0 && !(sum > -kInf)) return false;
                if (!(umin < kInf)) {
                    free_rows[kept++] = static_cast<std::int64_t>(i);
                    continue;
                }
                // The first column holding umin (also what the probe sees, on a tie too), or on
                // a tie the row's own.
                const bool probing = watching_ && pass == 0;
                const bool tied = !(umin < usubmin);
                std::size_t j1 = tied && probing ? first_reduced_at(row(i), v_.data(), 0, nc_, umin)
                                                 : at;
                if (probing && probe(j1, k, previous)) return true;
                if (tied) {
                    j1 = tied_column(i, umin);
                } else if (usubmin < kInf) {
                    v_[j1] -= usubmin - umin;
                }
                const std::int64_t i0 = y_[j1];
                x_[i] = static_cast<std::int64_t>(j1);
                y_[j1] = static_cast<std::int64_t>(i);
                if (i0 >= 0) {
                    x_[static_cast<std::size_t>(i0)] = -1;
                    // Classic JV re-processes i0 at once when v dropped; on random matrices
                    // that chases the same columns dozens of times per row, so the displaced
                    // row waits for the next pass (measured 3-5x faster overall).
                    free_rows[kept++] = i0;
                }
            }
            free_rows.resize(kept);
            if (reduction_stalled(pass, previous, kept, 32)) break;
        }
        return true;
    }

    // Of the columns where row i's reduced cost ties at its minimum umin, the first free one
    // from the row's own start on, round the columns, or the first from there if all are
    // taken: were it the first for all rows, tied rows would all compete for the same first
    // columns (tied integer 500x2500: 1.44 ms, 0.45 ms from the row's start, 0.35 ms on
    // a free one). Kept out of the reduction's loop, which continuous costs never leave for
    // it (inlined, its loops made 150-column rows 5-7% slower).
    __attribute__((noinline, cold)) std::size_t tied_column(std::size_t i, double umin) const {
        // The first tied column from `from` on, round the columns (umin is one of them).
        const auto next_tied = [&](std::size_t from) {
            const std::size_t j = first_reduced_at(row(i), v_.data(), from, nc_, umin);
            return j < nc_ ? j : first_reduced_at(row(i), v_.data(), 0, from, umin);
        };
        const std::size_t first = next_tied(i * nc_ / nr_);
        std::size_t j = first;
        while (y_[j] >= 0) {
            j = next_tied(j + 1 < nc_ ? j + 1 : 0);
            if (j == first) return first;  // round the row: every tied column is taken
        }
        return j;
    }

    // Counts the probed row whose cheapest column is j (the k-th row of the first pass, of
    // `rows`) and stops watching once the probed rows decide; true, declined, when they leave
    // many new neurons (all new 100x600 decides after 6 rows). A tie goes to the earlier
    // column, existing neurons before PFNM's slots: ties do not count (on tied integer costs
    // the dense solver stays the faster).
    bool probe(std::size_t j, std::size_t k, std::size_t rows) {
        if (k == 1) slot_rows_ = 0;
        slot_rows_ += j >= slots_.head && j <= slots_.end;
        const double forced = forced_new(slots_, nr_, nc_);
        const auto probed = static_cast<double>(std::min(kProbedRows, rows));
        const auto many = [&](std::size_t count) {
            return many_new(std::max(forced, static_cast<double>(count) / probed), nr_);
        };
        declined_ = many(slot_rows_);
        watching_ = !declined_ && many(slot_rows_ + static_cast<std::size_t>(probed) - k);
        return declined_;
    }

    // Shortest augmenting path from free row f over reduced costs (augment.hpp), then the
    // potential update and the augmentation.
    Status augment(std::int64_t f, AugmentSearch& s) {
        const T* first = row(static_cast<std::size_t>(f));
        for (std::size_t j = 0; j < nc_; ++j) s.d[j] = static_cast<double>(first[j]);
        std::fill(s.pred.begin(), s.pred.end(), f);
        double best_free;
        double dmin = s.start(0.0, v_.data(), nc_, best_free);
        std::size_t sink;
        for (;;) {
            if (!(dmin < kInf)) return Status::infeasible;
            const std::size_t j = s.pick(dmin, best_free == dmin, nc_);
            if (y_[j] < 0) {
                sink = j;
                break;
            }
            const auto i = static_cast<std::size_t>(y_[j]);
            const double h = at(i, j) - v_[j] - dmin;
            dmin = s.relax(row(i), h, y_[j], v_.data(), nc_, best_free);
        }
        for (std::size_t j : s.finished) v_[j] += s.d[j] - dmin;
        std::size_t j = sink;
        for (;;) {
            const auto i = static_cast<std::size_t>(s.pred[j]);
            y_[j] = static_cast<std::int64_t>(i);
            const std::int64_t previous = x_[i];
            x_[i] = static_cast<std::int64_t>(j);
            if (static_cast<std::int64_t>(i) == f) break;
            j = static_cast<std::size_t>(previous);
        }
        return Status::ok;
    }

    const T* c_;
    std::size_t nr_, nc_, stride_;
    std::vector<double> v_;
    std::vector<std::int64_t> x_, y_;
    Run slots_{0, 0};
    bool watching_ = false, declined_ = false;
    std::size_t slot_rows_ = 0;
};

// Columns head..end of the longest run of at least kMinRun consecutive columns each dominating
// the previous in the given rows (PFNM's new-neuron slots, in a wide problem); false if none.
// The first rows propose the rising columns with vector compares, and the longest stretch of
// them is then verified on the other rows.
template <class T>
bool longest_column_run(const T* cost, std::size_t nc, const std::vector<std::size_t>& rows,
                        std::size_t& head, std::size_t& end) {
    constexpr std::size_t kProposing = 8, kWhole = 2;
    std::vector<unsigned char> rising(nc, 1);
    const std::size_t proposing = std::min(rows.size(), kProposing);
    // The first rows over every column; the others only over the runs those leave (a run in
    // all of them is one in the first): 2 whole rows and the runs' stretches, not 8 rows.
    const std::size_t whole = std::min(proposing, kWhole);
    for (std::size_t t = 0; t < whole; ++t) keep_rising(cost + rows[t] * nc, rising.data(), nc);
    std::vector<Run> runs = rising_runs(rising);
    if (proposing > whole && !runs.empty()) {
        for (std::size_t t = whole; t < proposing; ++t) {
            const T* line = cost + rows[t] * nc;
            for (const Run& r : runs) {
                keep_rising(line + r.head, rising.data() + r.head, r.end - r.head + 1);
            }
        }
        runs = rising_runs(rising);
    }
    if (runs.empty()) return false;
    const Run longest = *std::max_element(runs.begin(), runs.end(), [](const Run& p, const Run& q) {
        return p.end - p.head < q.end - q.head;
    });
    head = longest.head;
    end = longest.end;
    for (std::size_t t = proposing; t < rows.size(); ++t) {
        const T* run = cost + rows[t] * nc + head;
        if (!dominates(run, run + 1, end - head)) return false;
    }
    return true;
}

// Wide: PFNM's slots as a range of columns, found on a sample of 16 rows (the tall solver
// checks the run on the whole matrix); false without one.
template <class T>
bool wide_slots(const T* cost, std::size_t nr, std::size_t nc, Run& slots) {
    constexpr std::size_t kSampledRows = 16;
    std::vector<std::size_t> rows;
    for (std::size_t i = 0; i < nr; i += (nr + kSampledRows - 1) / kSampledRows) rows.push_back(i);
    return longest_column_run(cost, nc, rows, slots.head, slots.end);
}

// Whether new neurons are many for certain (forced_new, same arguments).
bool surely_many_new(const Run& slots, std::size_t neurons, std::size_t lines) {
    return many_new(forced_new(slots, neurons, lines), neurons);
}

// A tall matrix's runs, given one found on a sample of its lines: that one when each of its
// rows dominates the previous on every column (a sample's run holds the whole matrix's, so
// it is then the longest), else all of them, looked for anew. The run's rows are contiguous:
// their block dominates itself shifted back by a row, in one call.
template <class T>
std::vector<Run> runs_from_sample(const T* cost, std::size_t nr, std::size_t nc, Run sampled) {
    const T* first = cost + sampled.head * nc;
    if (dominates(first, first + nc, (sampled.end - sampled.head) * nc)) return {sampled};
    return dominated_runs(cost, nr, nc);
}

// Problems of up to this many entries (16 MiB of float64) may be solved through a transposed
// copy: short tall ones with few new neurons on the dense solver (whose row reduction reads
// the matrix once, where the tall solver's candidate lists read it twice), wide ones with
// many on the tall solver (the dense solver's searches wander through every row already on
// a slot: 500x600 with 50 new neurons, 22 ms dense, 1 ms tall).
constexpr std::size_t kMaxTransposed = std::size_t{1} << 21;

#ifdef FUSEKIT_AVX512_KERNELS
// Rows [0, 8 * (nr / 8)) x columns [0, 8 * (nc / 8)) of a row-major nr x nc matrix into out
// (nc rows of nr, each `stride` apart), an 8 x 8 block at a time transposed in registers: a
// scalar copy of 600x100 made two scattered accesses per entry and took as long as the dense
// solver's row reduction.
__attribute__((target("avx512f"))) void transpose_blocks_avx512(const double* __restrict cost,
                                                                std::size_t nr, std::size_t nc,
                                                                double* __restrict out,
                                                                std::size_t stride) {
    const __m512i pairs_low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i pairs_high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    const __m512i halves_low = _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11);
    const __m512i halves_high = _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15);
    for (std::size_t j0 = 0; j0 + 8 <= nc; j0 += 8) {
        for (std::size_t i0 = 0; i0 + 8 <= nr; i0 += 8) {
            const double* in = cost + i0 * nc + j0;
            __m512d r[8], t[8], q[8];
            for (std::size_t k = 0; k < 8; ++k) r[k] = _mm512_loadu_pd(in + k * nc);
            for (std::size_t k = 0; k < 8; k += 2) {  // entries 0,2,4,6 (t[k]), 1,3,5,7 (t[k+1])
                t[k] = _mm512_unpacklo_pd(r[k], r[k + 1]);
                t[k + 1] = _mm512_unpackhi_pd(r[k], r[k + 1]);
            }
            for (std::size_t k = 0; k < 8; k += 4) {  // q[k + c]: entries c, c + 4 of 4 rows
                q[k] = _mm512_permutex2var_pd(t[k], pairs_low, t[k + 2]);
                q[k + 1] = _mm512_permutex2var_pd(t[k + 1], pairs_low, t[k + 3]);
                q[k + 2] = _mm512_permutex2var_pd(t[k], pairs_high, t[k + 2]);
                q[k + 3] = _mm512_permutex2var_pd(t[k + 1], pairs_high, t[k + 3]);
            }
            double* to = out + j0 * stride + i0;
            for (std::size_t c = 0; c < 4; ++c) {
                _mm512_storeu_pd(to + c * stride,
                                 _mm512_permutex2var_pd(q[c], halves_low, q[4 + c]));
                _mm512_storeu_pd(to + (c + 4) * stride,
                                 _mm512_permutex2var_pd(q[c], halves_high, q[4 + c]));
            }
        }
    }
}

// The same for float32, an 8 x 8 block at a time in 32-byte registers (a scalar copy of
// tall 150x50 float32 made it 25% slower to solve than in float64).
__attribute__((target("avx512f"))) void transpose_blocks_avx512(const float* __restrict cost,
                                                                std::size_t nr, std::size_t nc,
                                                                float* __restrict out,
                                                                std::size_t stride) {
    for (std::size_t j0 = 0; j0 + 8 <= nc; j0 += 8) {
        for (std::size_t i0 = 0; i0 + 8 <= nr; i0 += 8) {
            const float* in = cost + i0 * nc + j0;
            __m256 r[8], t[8], q[8];
            for (std::size_t k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(in + k * nc);
            for (std::size_t k = 0; k < 8; k += 2) {  // rows k, k+1 interleaved by pairs
                t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
                t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
            }
            for (std::size_t k = 0; k < 8; k += 4) {  // q[k + c]: entries c, c + 4 of 4 rows
                q[k] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(1, 0, 1, 0));
                q[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(3, 2, 3, 2));
                q[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(1, 0, 1, 0));
                q[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(3, 2, 3, 2));
            }
            float* to = out + j0 * stride + i0;
            for (std::size_t c = 0; c < 4; ++c) {
                _mm256_storeu_ps(to + c * stride, _mm256_permute2f128_ps(q[c], q[4 + c], 0x20));
                _mm256_storeu_ps(to + (c + 4) * stride,
                                 _mm256_permute2f128_ps(q[c], q[4 + c], 0x31));
            }
        }
    }
}
#endif

// Rows [i_begin, i_end) x columns [j_begin, j_end) of a row-major nr x nc matrix into out
// (as transpose_blocks_avx512), in 32 x 32 tiles that stay in cache, each written a
// contiguous output row at a time (measured: 19 us for 600x100, where row-by-row tiles took
// 31).
template <class T>
void transpose_tiles(const T* __restrict cost, std::size_t nc, T* __restrict out,
                     std::size_t stride, std::size_t i_begin, std::size_t i_end,
                     std::size_t j_begin, std::size_t j_end) {
    constexpr std::size_t kTile = 32;
    for (std::size_t i0 = i_begin; i0 < i_end; i0 += kTile) {
        const std::size_t i1 = std::min(i_end, i0 + kTile);
        for (std::size_t j0 = j_begin; j0 < j_end; j0 += kTile) {
            const std::size_t j1 = std::min(j_end, j0 + kTile);
            for (std::size_t j = j0; j < j1; ++j) {
                for (std::size_t i = i0; i < i1; ++i) out[j * stride + i] = cost[i * nc + j];
            }
        }
    }
}

// Arrays that start on a cache line (the transposed copy: written 64 bytes at a time, it
// took 24-28 us for 600x100 instead of 17 when its lines were split against a cache-aligned
// source, a heap address's chance).
constexpr std::align_val_t kLine{64};
struct LineAlignedDelete {
    void operator()(void* p) const { ::operator delete[](p, kLine); }
};
template <class T>
using LineAligned = std::unique_ptr<T[], LineAlignedDelete>;

// The nc x nr transpose of a row-major nr x nc matrix, its rows `stride` apart (stride >= nr;
// what lies between them is not written).
template <class T>
LineAligned<T> transposed(const T* cost, std::size_t nr, std::size_t nc, std::size_t stride) {
    LineAligned<T> out(static_cast<T*>(::operator new[](nc * stride * sizeof(T), kLine)));
    std::size_t rows = 0, columns = 0;  // the block transposed in registers
#ifdef FUSEKIT_AVX512_KERNELS
    if (kHasAvx512) {
        transpose_blocks_avx512(cost, nr, nc, out.get(), stride);
        rows = nr / 8 * 8;
        columns = nc / 8 * 8;
    }
#endif
    transpose_tiles(cost, nc, out.get(), stride, 0, rows, columns, nc);
    transpose_tiles(cost, nc, out.get(), stride, rows, nr, 0, nc);
    return out;
}

// n entries rounded up to whole cache lines: rows that far apart all start on one, so that
// the transposed copy's 64-byte stores never straddle two (150x50: 1.8 us a copy, 1.2 with
// them apart by 152).
template <class T>
std::size_t line_stride(std::size_t n) {
    constexpr std::size_t kPerLine = 64 / sizeof(T);
    return (n + kPerLine - 1) / kPerLine * kPerLine;
}

// Whether a tall problem is solved by the dense solver through its transposed copy, faster
// than the tall solver (whose candidate lists cost two passes over a top block that holds
// few candidates per column) when less than four times taller than wide, unless many
// neurons are new: the tall one then takes them at once, and the dense one declines after
// its first rows. Without slot runs, which the dense solver's searches could wander
// through, up to ten times taller and 65,536 entries (uniform and integer 200x40-700x90,
// 0-90% of the pairs forbidden: 0.56-0.94x the tall solver's time; at 100,000 entries up to
// 1.10x). Both solvers check the values in a pass they make anyway.
bool dense_through_transpose(std::size_t nr, std::size_t nc, const std::vector<Run>& runs) {
    constexpr std::size_t kWithoutSlotsHeight = 10, kWithoutSlotsEntries = std::size_t{1} << 16;
    if (nr * nc > kMaxTransposed) return false;
    if (!runs.empty()) return nr < 4 * nc && !surely_many_new(runs[0], nc, nr);
    return nr < 4 * nc || (nr <= kWithoutSlotsHeight * nc && nr * nc <= kWithoutSlotsEntries);
}

// Square and wide problems on the dense solver. Given a wide problem's slot columns, it may
// decline (Solver::watch): *declined says so, and nothing is written.
template <class T>
Status solve_dense(const T* cost, std::size_t nr, std::size_t nc, std::size_t stride,
                   Values values, std::int64_t* col_of_row, double* u, double* v,
                   const Run* slots = nullptr, bool* declined = nullptr) {
    Solver<T> solver(cost, nr, nc, stride);
    if (slots) solver.watch(*slots);
    const Status s = solver.run(values);
    if (declined) *declined = solver.declined();
    if (s != Status::ok || solver.declined()) return s;
    const auto& x = solver.row_solution();
    const auto& pot = solver.potentials();
    for (std::size_t i = 0; i < nr; ++i) {
        const auto j = static_cast<std::size_t>(x[i]);
        col_of_row[i] = static_cast<std::int64_t>(j);
        if (u) u[i] = static_cast<double>(cost[i * stride + j]) - pot[j];
    }
    if (v) std::copy(pot.begin(), pot.end(), v);
    return Status::ok;
}

// Solves the transpose (nc x nr, its rows `stride` apart) of an nr x nc problem with `solve`
// and maps the assignment and potentials back: rows and columns swap roles, so do u and v.
template <class T, class Solve>
Status solve_transposed(const T* cost, std::size_t nr, std::size_t nc, std::size_t stride,
                        Solve solve, std::int64_t* col_of_row, double* u, double* v) {
    const LineAligned<T> flipped = transposed(cost, nr, nc, stride);
    std::vector<std::int64_t> row_of_col(nc, -1);
    std::vector<double> uf(nc), vf(nr);
    const Status s = solve(flipped.get(), nc, nr, row_of_col.data(), uf.data(), vf.data());
    if (s != Status::ok) return s;
    for (std::size_t j = 0; j < nc; ++j) {
        if (row_of_col[j] >= 0) col_of_row[row_of_col[j]] = static_cast<std::int64_t>(j);
    }
    if (u) std::copy(vf.begin(), vf.end(), u);
    if (v) std::copy(uf.begin(), uf.end(), v);
    return Status::ok;
}

}  // namespace

template <class T>
Status solve_assignment(const T* cost, std::size_t nr, std::size_t nc, std::int64_t* col_of_row,
                        double* u, double* v) {
    std::fill(col_of_row, col_of_row + nr, -1);
    if (u) std::fill(u, u + nr, 0.0);
    if (v) std::fill(v, v + nc, 0.0);
    if (nr == 0 || nc == 0) return Status::ok;
    if (nr > nc) {
        std::vector<Run> runs = dominated_runs(cost, nr, nc);
        if (dense_through_transpose(nr, nc, runs)) {
            bool declined = false;
            const Run* slots = runs.empty() ? nullptr : &runs[0];
            const std::size_t stride = line_stride<T>(nr);
            const auto dense = [slots, stride, &declined](const T* c, std::size_t r,
                                                          std::size_t k, std::int64_t* x,
                                                          double* a, double* b) {
                return solve_dense(c, r, k, stride, Values::unchecked, x, a, b, slots, &declined);
            };
            const Status s = solve_transposed(cost, nr, nc, stride, dense, col_of_row, u, v);
            if (!declined) return s;
        }
        return solve_tall(cost, nr, nc, std::move(runs), col_of_row, u, v);
    }
    if (nr < nc) {
        Run slots{0, 0};
        if (nr * nc <= kMaxTransposed && wide_slots(cost, nr, nc, slots)) {
            if (!surely_many_new(slots, nr, nc)) {
                bool declined = false;
                const Status s = solve_dense(cost, nr, nc, nc, Values::unchecked, col_of_row, u,
                                             v, &slots, &declined);
                if (!declined) return s;
            }
            const auto tall = [slots](const T* c, std::size_t r, std::size_t k, std::int64_t* x,
                                      double* a, double* b) {
                return solve_tall(c, r, k, runs_from_sample(c, r, k, slots), x, a, b);
            };
            return solve_transposed(cost, nr, nc, nr, tall, col_of_row, u, v);
        }
        return solve_dense(cost, nr, nc, nc, Values::unchecked, col_of_row, u, v);
    }
    // NaN and -inf are invalid; with +inf (forbidden) pairs the dense solver starts from its
    // row reduction alone (after a column reduction too, tied integers with a fifth of the
    // pairs forbidden were up to 1.5x slower, though most such problems were faster).
    bool has_inf = false;
    if (!valid_costs(cost, nr * nc, has_inf)) return Status::non_finite;
    if (nr >= kMinCandidateSquare && solve_by_candidates(cost, nr, col_of_row, u, v)) {
        return Status::ok;
    }
    return solve_dense(cost, nr, nc, nc, has_inf ? Values::forbidden : Values::finite, col_of_row,
                       u, v);
}

template Status solve_assignment<float>(const float*, std::size_t, std::size_t, std::int64_t*,
                                        double*, double*);
template Status solve_assignment<double>(const double*, std::size_t, std::size_t, std::int64_t*,
                                         double*, double*);

}  // namespace fusekit
