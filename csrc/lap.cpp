#include "lap.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "augment.hpp"
#include "candidates.hpp"
#include "lines.hpp"
#include "rectangular.hpp"
#include "simd.hpp"

namespace fusekit {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The two smallest values offered and where they were (-1: none yet); ties keep the
// earlier index.
struct TwoSmallest {
    double first = kInf, second = kInf;
    std::int64_t at_first = -1, at_second = -1;
    void offer(double x, std::int64_t at) {
        if (at < 0) return;
        if (x < first || (x == first && at < at_first)) {
            second = first;
            at_second = at_first;
            first = x;
            at_first = at;
        } else if (x < second || (x == second && (at_second < 0 || at < at_second))) {
            second = x;
            at_second = at;
        }
    }
};

// Below this size the dense solver is faster than candidate lists (measured: uniform
// 100x100 dense 0.05 ms vs 0.10 ms).
constexpr std::size_t kMinCandidateSquare = 256;

// Smallest and second smallest reduced cost row[j] - v[j] with their columns (m >= 2), in
// one pass; ties keep the earlier column. Eight lanes each keep their two smallest and
// where they are, merged at the end. GCC/Clang vector types: the selects compile to
// compares and blends, where the same loop over arrays spilled to memory every step.
template <class T>
FUSEKIT_CLONES void two_smallest(const T* __restrict row, const double* __restrict v,
                                 std::size_t m, double& min1, std::size_t& j1, double& min2,
                                 std::size_t& j2) {
    typedef double Values __attribute__((vector_size(64)));
    typedef std::int64_t Indices __attribute__((vector_size(64)));
    constexpr std::size_t kLanes = 8;
    Values a, b;
    Indices ia, ib, at;
    for (std::size_t l = 0; l < kLanes; ++l) {
        a[l] = b[l] = kInf;
        ia[l] = ib[l] = -1;
        at[l] = static_cast<std::int64_t>(l);
    }
    const std::size_t whole = m / kLanes * kLanes;
    for (std::size_t j0 = 0; j0 < whole; j0 += kLanes, at += static_cast<std::int64_t>(kLanes)) {
        Values h, w;
        for (std::size_t l = 0; l < kLanes; ++l) h[l] = static_cast<double>(row[j0 + l]);
        std::memcpy(&w, v + j0, sizeof w);
        h -= w;
        const auto first = h < a, second = h < b;
        b = first ? a : (second ? h : b);
        ib = first ? ia : (second ? at : ib);
        a = first ? h : a;
        ia = first ? at : ia;
    }
    TwoSmallest best;
    for (std::size_t j = whole; j < m; ++j) {
        best.offer(static_cast<double>(row[j]) - v[j], static_cast<std::int64_t>(j));
    }
    for (std::size_t l = 0; l < kLanes; ++l) {
        best.offer(a[l], ia[l]);
        best.offer(b[l], ib[l]);
    }
    min1 = best.first;
    min2 = best.second;
    // Rows of +inf leave indices unset: any two distinct columns then do.
    j1 = best.at_first >= 0 ? static_cast<std::size_t>(best.at_first) : 0;
    j2 = best.at_second >= 0 && static_cast<std::size_t>(best.at_second) != j1
             ? static_cast<std::size_t>(best.at_second)
             : (j1 == 0 ? 1 : 0);
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

// The dense solver for square and wide (nr < nc) problems: rows are augmented one by one
// over all columns, each search step reading one row of the matrix. Keeps the column
// potentials v; row potentials are implicit, u[i] = c[i, x[i]] - v[x[i]]. Columns start at
// v = 0 and v only decreases, so a wide problem's unassigned columns keep the largest
// potential, 0: its optimality conditions hold without padding. Between phases every
// assigned row is tight at its smallest reduced cost.
template <class T>
class Solver {
   public:
    Solver(const T* cost, std::size_t nr, std::size_t nc)
        : c_(cost), nr_(nr), nc_(nc), v_(nc, 0.0), x_(nr, -1), y_(nc, -1), search_(nc) {}

    const std::vector<double>& potentials() const { return v_; }
    const std::vector<std::int64_t>& row_solution() const { return x_; }

    // may_reduce: finite matrix (the reductions assume finite second-best costs).
    Status run(bool may_reduce) {
        std::vector<std::int64_t> free_rows;
        if (may_reduce && nr_ == nc_) {
            column_reduction(free_rows);
        } else {
            free_rows.resize(nr_);
            for (std::size_t i = 0; i < nr_; ++i) free_rows[i] = static_cast<std::int64_t>(i);
        }
        if (may_reduce && nc_ >= 2) augmenting_row_reduction(free_rows);
        for (std::size_t j = 0; j < nc_; ++j) search_.penalty[j] = y_[j] < 0 ? 0.0 : kInf;
        for (std::int64_t f : free_rows) {
            if (x_[static_cast<std::size_t>(f)] >= 0) continue;
            const Status s = augment(f);
            if (s != Status::ok) return s;
        }
        return Status::ok;
    }

   private:
    const T* row(std::size_t i) const { return c_ + i * nc_; }
    double at(std::size_t i, std::size_t j) const { return static_cast<double>(c_[i * nc_ + j]); }

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

    // Jonker-Volgenant augmenting row reduction, two passes over the free rows.
    void augmenting_row_reduction(std::vector<std::int64_t>& free_rows) {
        for (int pass = 0; pass < 2; ++pass) {
            std::size_t k = 0;
            const std::size_t previous = free_rows.size();
            std::size_t kept = 0;
            while (k < previous) {
                const auto i = static_cast<std::size_t>(free_rows[k++]);
                double umin, usubmin;
                std::size_t j1, j2;
                two_smallest(row(i), v_.data(), nc_, umin, j1, usubmin, j2);
                std::int64_t i0 = y_[j1];
                if (umin < usubmin) {
                    v_[j1] -= usubmin - umin;
                } else if (i0 >= 0) {
                    j1 = j2;
                    i0 = y_[j1];
                }
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
        }
    }

    // Shortest augmenting path from free row f over reduced costs (augment.hpp), then the
    // potential update and the augmentation.
    Status augment(std::int64_t f) {
        AugmentSearch& s = search_;
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
        s.penalty[sink] = kInf;
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
    std::size_t nr_, nc_;
    std::vector<double> v_;
    std::vector<std::int64_t> x_, y_;
    AugmentSearch search_;
};

// NaN and -inf are invalid; +inf (forbidden) disables the reductions, whose bookkeeping
// assumes finite second-best costs.
template <class T>
FUSEKIT_CLONES Status check_values(const T* cost, std::size_t size, bool& has_inf) {
    std::size_t bad = 0, infinite = 0;
    const T inf = std::numeric_limits<T>::infinity();
#pragma omp simd reduction(+ : bad, infinite)
    for (std::size_t k = 0; k < size; ++k) {
        bad += !(cost[k] > -inf);
        infinite += cost[k] == inf;
    }
    has_inf = infinite > 0;
    return bad > 0 ? Status::non_finite : Status::ok;
}

}  // namespace

template <class T>
Status solve_assignment(const T* cost, std::size_t nr, std::size_t nc, std::int64_t* col_of_row,
                        double* u, double* v) {
    std::fill(col_of_row, col_of_row + nr, -1);
    if (u) std::fill(u, u + nr, 0.0);
    if (v) std::fill(v, v + nc, 0.0);
    if (nr == 0 || nc == 0) return Status::ok;
    bool has_inf = false;
    const Status valid = check_values(cost, nr * nc, has_inf);
    if (valid != Status::ok) return valid;
    if (nr > nc) return solve_tall(cost, nr, nc, col_of_row, u, v);
    if (nr == nc && nr >= kMinCandidateSquare && solve_by_candidates(cost, nr, col_of_row, u, v)) {
        return Status::ok;
    }
    Solver<T> solver(cost, nr, nc);
    const Status s = solver.run(!has_inf);
    if (s != Status::ok) return s;
    const auto& x = solver.row_solution();
    const auto& pot = solver.potentials();
    for (std::size_t i = 0; i < nr; ++i) {
        const auto j = static_cast<std::size_t>(x[i]);
        col_of_row[i] = static_cast<std::int64_t>(j);
        if (u) u[i] = static_cast<double>(cost[i * nc + j]) - pot[j];
    }
    if (v) std::copy(pot.begin(), pot.end(), v);
    return Status::ok;
}

template Status solve_assignment<float>(const float*, std::size_t, std::size_t, std::int64_t*,
                                        double*, double*);
template Status solve_assignment<double>(const double*, std::size_t, std::size_t, std::int64_t*,
                                         double*, double*);

}  // namespace fusekit
