#include "lap.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include "candidates.hpp"
#include "simd.hpp"

namespace fusekit {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Below these sizes (the longer side) the dense solver is faster than candidate lists
// (measured: uniform 100x100 dense 0.05 ms vs 0.10 ms; PFNM-shaped 200x100 0.08 vs 0.05).
constexpr std::size_t kMinCandidateObjects = 64;
constexpr std::size_t kMinCandidateSquare = 256;

// Relaxes every column not yet finalised through row `row` (reached at offset h, so the
// new distance of column j is row[j] - v[j] - h) and returns the smallest distance among
// the columns not yet finalised. Dense and branch-free so that it vectorises: the
// shortest-path step visits few rows, so touching all columns of those rows is cheaper
// than maintaining index lists with gathers.
template <class T>
FUSEKIT_CLONES double relax_row(const T* __restrict row, const double* __restrict v, double h,
                                std::int64_t i, double* __restrict d,
                                std::int64_t* __restrict pred,
                                const std::int64_t* __restrict done,
                                const double* __restrict assigned_penalty, std::size_t m,
                                double& best_free) {
    double best = kInf, best_unassigned = kInf;
#pragma omp simd reduction(min : best, best_unassigned)
    for (std::size_t j = 0; j < m; ++j) {
        const double nd = static_cast<double>(row[j]) - v[j] - h;
        const bool update = (done[j] == 0) & (nd < d[j]);
        const double dj = update ? nd : d[j];
        d[j] = dj;
        pred[j] = update ? i : pred[j];
        const double candidate = done[j] != 0 ? kInf : dj;
        best = candidate < best ? candidate : best;
        const double unassigned = candidate + assigned_penalty[j];
        best_unassigned = unassigned < best_unassigned ? unassigned : best_unassigned;
    }
    best_free = best_unassigned;
    return best;
}

// Reduced costs row[j] - v[j] of a fresh row; returns their minimum.
template <class T>
FUSEKIT_CLONES double start_row(const T* __restrict row, const double* __restrict v,
                                std::int64_t i, double* __restrict d,
                                std::int64_t* __restrict pred, std::int64_t* __restrict done,
                                const double* __restrict assigned_penalty, std::size_t m,
                                double& best_free) {
    double best = kInf, best_unassigned = kInf;
#pragma omp simd reduction(min : best, best_unassigned)
    for (std::size_t j = 0; j < m; ++j) {
        const double dj = static_cast<double>(row[j]) - v[j];
        d[j] = dj;
        pred[j] = i;
        done[j] = 0;
        best = dj < best ? dj : best;
        const double unassigned = dj + assigned_penalty[j];
        best_unassigned = unassigned < best_unassigned ? unassigned : best_unassigned;
    }
    best_free = best_unassigned;
    return best;
}

// Smallest and second smallest reduced cost row[j] - v[j] with their columns (m >= 2).
// Three vectorisable passes beat one branchy scalar pass.
template <class T>
FUSEKIT_CLONES void two_smallest(const T* __restrict row, const double* __restrict v,
                                 std::size_t m, double& min1, std::size_t& j1, double& min2,
                                 std::size_t& j2) {
    double best = kInf;
#pragma omp simd reduction(min : best)
    for (std::size_t j = 0; j < m; ++j) {
        const double h = static_cast<double>(row[j]) - v[j];
        best = h < best ? h : best;
    }
    std::size_t first = 0;
    while (first + 1 < m && !(static_cast<double>(row[first]) - v[first] == best)) ++first;
    double second = kInf;
#pragma omp simd reduction(min : second)
    for (std::size_t j = 0; j < m; ++j) {
        const double h = static_cast<double>(row[j]) - v[j];
        const double candidate = j == first ? kInf : h;
        second = candidate < second ? candidate : second;
    }
    std::size_t other = first == 0 ? 1 : 0;
    for (std::size_t j = 0; j < m; ++j) {
        if (j != first && static_cast<double>(row[j]) - v[j] == second) {
            other = j;
            break;
        }
    }
    min1 = best;
    j1 = first;
    min2 = second;
    j2 = other;
}

// First column j, not finalised (and unassigned when kUnassigned) with d[j] == dmin; such a
// column exists. Tested eight at a time so that the scan is mostly vector compares.
template <bool kUnassigned>
FUSEKIT_CLONES std::size_t find_tied(const double* __restrict d, const std::int64_t* __restrict done,
                      const double* __restrict penalty, double dmin, std::size_t m) {
    constexpr std::size_t kChunk = 8;
    std::size_t j0 = 0;
    for (; j0 + kChunk <= m; j0 += kChunk) {
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (std::size_t l = 0; l < kChunk; ++l) {
            const double key = kUnassigned ? d[j0 + l] + penalty[j0 + l] : d[j0 + l];
            hit |= (key == dmin) & (done[j0 + l] == 0);
        }
        if (hit) break;
    }
    for (std::size_t j = j0;; ++j) {
        const double key = kUnassigned ? d[j] + penalty[j] : d[j];
        if (key == dmin && done[j] == 0) return j;
    }
}

// Column minima so far, updated with row i (the column reduction, row by row).
template <class T>
FUSEKIT_CLONES void column_min_update(const T* __restrict row, std::int64_t i,
                                      double* __restrict v, std::int64_t* __restrict argmin,
                                      std::size_t m) {
#pragma omp simd
    for (std::size_t j = 0; j < m; ++j) {
        const double h = static_cast<double>(row[j]);
        const bool smaller = h < v[j];
        v[j] = smaller ? h : v[j];
        argmin[j] = smaller ? i : argmin[j];
    }
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

// The solver proper, for n <= m (every row gets a column). Keeps the column potentials v;
// row potentials are implicit, u[i] = c[i, x[i]] - v[x[i]]. Invariants between phases:
// every assigned row is tight at its smallest reduced cost, and (when n < m) v <= 0 with
// v = 0 on every unassigned column, which is what makes a rectangular solution optimal.
template <class T>
class Solver {
   public:
    Solver(const T* cost, std::size_t n, std::size_t m)
        : c_(cost), n_(n), m_(m), v_(m, 0.0), x_(n, -1), y_(m, -1) {}

    std::vector<double>& potentials() { return v_; }
    const std::vector<std::int64_t>& row_solution() const { return x_; }

    Status run(bool warm, bool may_reduce) {
        std::vector<std::int64_t> free_rows;
        if (!warm && n_ == m_ && may_reduce) {
            column_reduction(free_rows);
        } else {
            if (warm) shift_potentials();
            free_rows.resize(n_);
            for (std::size_t i = 0; i < n_; ++i) free_rows[i] = static_cast<std::int64_t>(i);
        }
        if (may_reduce && m_ >= 2) {
            augmenting_row_reduction(free_rows);
            if (warm && n_ < m_) {
                release_unassigned_columns(free_rows);
                augmenting_row_reduction(free_rows);
            }
        } else if (warm && n_ < m_) {
            // Without the reduction every column is still free: potentials must start at 0.
            std::fill(v_.begin(), v_.end(), 0.0);
        }
        d_.assign(m_, 0.0);
        pred_.assign(m_, 0);
        done_.assign(m_, 0);
        penalty_.resize(m_);
        for (std::size_t j = 0; j < m_; ++j) penalty_[j] = y_[j] < 0 ? 0.0 : kInf;
        for (std::int64_t f : free_rows) {
            if (x_[static_cast<std::size_t>(f)] >= 0) continue;
            const Status s = augment(f);
            if (s != Status::ok) return s;
        }
        return Status::ok;
    }

   private:
    const T* row(std::size_t i) const { return c_ + i * m_; }
    double at(std::size_t i, std::size_t j) const { return static_cast<double>(c_[i * m_ + j]); }

    // Warm potentials of a rectangular problem must be <= 0 (only differences matter).
    void shift_potentials() {
        if (n_ == m_ || m_ == 0) return;
        const double top = *std::max_element(v_.begin(), v_.end());
        for (double& vj : v_) vj -= top;
    }

    // Jonker-Volgenant column reduction and reduction transfer (square, cold start only).
    void column_reduction(std::vector<std::int64_t>& free_rows) {
        std::vector<std::int64_t> argmin(m_, 0);
        for (std::size_t j = 0; j < m_; ++j) v_[j] = at(0, j);
        for (std::size_t i = 1; i < n_; ++i) {
            column_min_update(row(i), static_cast<std::int64_t>(i), v_.data(), argmin.data(), m_);
        }
        std::vector<int> matches(n_, 0);
        for (std::size_t jj = m_; jj-- > 0;) {
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
        for (std::size_t i = 0; i < n_; ++i) {
            if (matches[i] == 0) {
                free_rows.push_back(static_cast<std::int64_t>(i));
            } else if (matches[i] == 1) {
                // Transfer the row's slack to its column so the row sits at its second best.
                const auto j1 = static_cast<std::size_t>(x_[i]);
                const double second = min_except(row(i), v_.data(), j1, m_);
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
                two_smallest(row(i), v_.data(), m_, umin, j1, usubmin, j2);
                if (!(umin < kInf)) {  // nothing reachable: leave it to the augmentation
                    free_rows[kept++] = static_cast<std::int64_t>(i);
                    continue;
                }
                std::int64_t i0 = y_[j1];
                const bool strict = umin < usubmin;
                if (strict) {
                    // usubmin may be +inf when only one column is allowed: then any decrease
                    // keeps the row tight, so use a finite one.
                    const double drop = usubmin < kInf ? usubmin - umin : 0.0;
                    v_[j1] -= drop;
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

    // A warm start may leave unassigned columns with v < 0; raising them to 0 keeps dual
    // feasibility only if rows now preferring them give up their column (which may cascade).
    void release_unassigned_columns(std::vector<std::int64_t>& free_rows) {
        std::vector<std::size_t> pending;
        for (std::size_t j = 0; j < m_; ++j) {
            if (y_[j] < 0 && v_[j] < 0.0) pending.push_back(j);
        }
        while (!pending.empty()) {
            const std::size_t k = pending.back();
            pending.pop_back();
            if (y_[k] >= 0 || v_[k] >= 0.0) continue;
            v_[k] = 0.0;
            for (std::size_t i = 0; i < n_; ++i) {
                const std::int64_t xi = x_[i];
                if (xi < 0) continue;
                const auto j = static_cast<std::size_t>(xi);
                if (at(i, k) < at(i, j) - v_[j]) {
                    x_[i] = -1;
                    y_[j] = -1;
                    free_rows.push_back(static_cast<std::int64_t>(i));
                    if (v_[j] < 0.0) pending.push_back(j);
                }
            }
        }
    }

    // Index of a not-yet-final column at distance dmin, an unassigned one when one ties
    // (then the search ends early, which matters on degenerate problems).
    std::size_t pick(double dmin, bool unassigned) const {
        return unassigned ? find_tied<true>(d_.data(), done_.data(), penalty_.data(), dmin, m_)
                          : find_tied<false>(d_.data(), done_.data(), penalty_.data(), dmin, m_);
    }

    // Dijkstra from free row f over reduced costs, then potential update and augmentation.
    Status augment(std::int64_t f) {
        finished_.clear();
        double dmin_free;
        double dmin = start_row(row(static_cast<std::size_t>(f)), v_.data(), f, d_.data(),
                                pred_.data(), done_.data(), penalty_.data(), m_, dmin_free);
        std::size_t sink;
        for (;;) {
            if (!(dmin < kInf)) return Status::infeasible;
            const std::size_t j = pick(dmin, dmin_free == dmin);
            done_[j] = 1;
            finished_.push_back(j);
            if (y_[j] < 0) {
                sink = j;
                break;
            }
            const auto i = static_cast<std::size_t>(y_[j]);
            const double h = at(i, j) - v_[j] - dmin;
            dmin = relax_row(row(i), v_.data(), h, static_cast<std::int64_t>(i), d_.data(),
                             pred_.data(), done_.data(), penalty_.data(), m_, dmin_free);
        }
        for (std::size_t j : finished_) v_[j] += d_[j] - dmin;
        penalty_[sink] = kInf;
        std::size_t j = sink;
        for (;;) {
            const auto i = static_cast<std::size_t>(pred_[j]);
            y_[j] = static_cast<std::int64_t>(i);
            const std::int64_t previous = x_[i];
            x_[i] = static_cast<std::int64_t>(j);
            if (static_cast<std::int64_t>(i) == f) break;
            j = static_cast<std::size_t>(previous);
        }
        return Status::ok;
    }

    const T* c_;
    std::size_t n_, m_;
    std::vector<double> v_, d_;
    std::vector<double> penalty_;  // 0 on unassigned columns, +inf on assigned ones
    std::vector<std::int64_t> x_, y_, pred_, done_;
    std::vector<std::size_t> finished_;
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

template <class T>
void transpose(const T* src, std::size_t nr, std::size_t nc, T* dst) {
    constexpr std::size_t kBlock = 32;
    for (std::size_t i0 = 0; i0 < nr; i0 += kBlock) {
        for (std::size_t j0 = 0; j0 < nc; j0 += kBlock) {
            const std::size_t i1 = std::min(nr, i0 + kBlock), j1 = std::min(nc, j0 + kBlock);
            for (std::size_t i = i0; i < i1; ++i) {
                for (std::size_t j = j0; j < j1; ++j) dst[j * nr + i] = src[i * nc + j];
            }
        }
    }
}

}  // namespace

template <class T>
Status solve_assignment(const T* cost, std::size_t nr, std::size_t nc, const double* warm_u,
                        const double* warm_v, std::int64_t* col_of_row, double* u, double* v) {
    std::fill(col_of_row, col_of_row + nr, -1);
    if (u) std::fill(u, u + nr, 0.0);
    if (v) std::fill(v, v + nc, 0.0);
    if (nr == 0 || nc == 0) return Status::ok;
    bool has_inf = false;
    const Status valid = check_values(cost, nr * nc, has_inf);
    if (valid != Status::ok) return valid;
    if (warm_u != nullptr) {
        for (std::size_t i = 0; i < nr; ++i) {
            if (!std::isfinite(warm_u[i])) return Status::non_finite;
        }
        for (std::size_t j = 0; j < nc; ++j) {
            if (!std::isfinite(warm_v[j])) return Status::non_finite;
        }
    }
    if (std::max(nr, nc) >= (nr == nc ? kMinCandidateSquare : kMinCandidateObjects)) {
        // Warm starts pay on square problems. On rectangular ones every object a warm start
        // priced but the new solution leaves unassigned must return to potential 0, which
        // takes re-solves and a full certificate pass: measured slower than a cold solve
        // (PFNM-shaped 600x100), so those are solved cold.
        const double* warm_columns = nr == nc ? warm_v : nullptr;
        if (solve_by_candidates(cost, nr, nc, warm_columns, col_of_row, u, v)) return Status::ok;
    }

    // Work on the orientation with no more rows than columns.
    const bool flip = nr > nc;
    std::vector<T> flipped;
    const T* c = cost;
    std::size_t n = nr, m = nc;
    if (flip) {
        flipped.resize(nr * nc);
        transpose(cost, nr, nc, flipped.data());
        c = flipped.data();
        std::swap(n, m);
    }
    Solver<T> solver(c, n, m);
    const double* warm_cols = flip ? warm_u : warm_v;
    const bool warm = warm_cols != nullptr;
    if (warm) {
        auto& pot = solver.potentials();
        std::copy(warm_cols, warm_cols + m, pot.begin());  // checked finite above
    }
    const Status s = solver.run(warm, !has_inf);
    if (s != Status::ok) return s;

    const auto& x = solver.row_solution();
    const auto& pot = solver.potentials();
    for (std::size_t i = 0; i < n; ++i) {
        const auto j = static_cast<std::size_t>(x[i]);
        if (flip) {
            col_of_row[j] = static_cast<std::int64_t>(i);
        } else {
            col_of_row[i] = static_cast<std::int64_t>(j);
        }
        const double ui = static_cast<double>(c[i * m + j]) - pot[j];
        if (flip) {
            if (v) v[i] = ui;
        } else {
            if (u) u[i] = ui;
        }
    }
    double* col_pot = flip ? u : v;
    if (col_pot) std::copy(pot.begin(), pot.end(), col_pot);
    return Status::ok;
}

template <class T>
void solve_assignments(const T* const* costs, const std::size_t* nr, const std::size_t* nc,
                       std::size_t count, std::int64_t* const* col_of_row, Status* statuses,
                       int n_threads) {
    std::size_t workers = n_threads > 0 ? static_cast<std::size_t>(n_threads)
                                        : std::max(1u, std::thread::hardware_concurrency());
    workers = std::min(workers, count);
    std::atomic<std::size_t> next{0};
    auto work = [&] {
        for (std::size_t k = next++; k < count; k = next++) {
            statuses[k] = solve_assignment(costs[k], nr[k], nc[k], nullptr, nullptr,
                                           col_of_row[k], nullptr, nullptr);
        }
    };
    std::vector<std::thread> pool;
    for (std::size_t t = 1; t < workers; ++t) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
}

template Status solve_assignment<float>(const float*, std::size_t, std::size_t, const double*,
                                        const double*, std::int64_t*, double*, double*);
template Status solve_assignment<double>(const double*, std::size_t, std::size_t, const double*,
                                         const double*, std::int64_t*, double*, double*);
template void solve_assignments<float>(const float* const*, const std::size_t*,
                                       const std::size_t*, std::size_t, std::int64_t* const*,
                                       Status*, int);
template void solve_assignments<double>(const double* const*, const std::size_t*,
                                        const std::size_t*, std::size_t, std::int64_t* const*,
                                        Status*, int);

}  // namespace fusekit
