#include "candidates.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "lines.hpp"
#include "reduction.hpp"
#include "simd.hpp"

namespace fusekit {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Candidates: the pairs within a typical gap of their row's smallest (reduced) cost, the
// gap from a row's minimum to its 8th smallest value. Measured on uniform 1000x1000: 4
// leaves violations (an extra pass and re-solve), 16 slows the collection and the solve.
constexpr std::size_t kGapRank = 8;
// When the candidates cannot assign every row the gap grows this much (or less, when that
// passes the edge budget), at most kMaxGrowths times.
constexpr double kGapGrowth = 2.0;
constexpr int kMaxGrowths = 3;
// Row reduction passes before the shortest-path phase: cheap on short lists, and on
// uniform 1000x1000 8 passes leave ~80 of 1000 agents free against ~190 after JV's 2.
constexpr int kReductionPasses = 8;
// Re-solves before falling back to the dense solver (each adds violated pairs).
constexpr int kMaxRounds = 12;
// Candidate pairs per row, on average, beyond which the dense solver (O(n) extra memory)
// takes over: on tie-heavy matrices whole rows lie within the gap (16 bytes per pair).
constexpr std::size_t kMaxEdgesPerRow = 64;

struct Edge {
    std::int64_t object;
    double cost;
};

// The n x n matrix; rows are the agents, columns the objects.
template <class T>
struct View {
    const T* cost;
    std::size_t n;
    double at(std::size_t a, std::size_t o) const { return static_cast<double>(cost[a * n + o]); }
};

constexpr std::size_t kChunk = 8;

// Whether some x[l] <= bound[l] in one chunk, as a min-reduction (which vectorises
// reliably), so that scalar work happens only on the rare chunks holding a candidate.
template <class T>
inline bool chunk_at_most(const T* __restrict x, const double* __restrict bound) {
    double gap = kInf;
#pragma omp simd reduction(min : gap)
    for (std::size_t l = 0; l < kChunk; ++l) {
        const double g = static_cast<double>(x[l]) - bound[l];
        gap = g < gap ? g : gap;
    }
    return !(gap > 0.0);
}

// Whether the column minima's rows are all different: then that assignment is optimal
// (u = 0, v = column minima is dual feasible and tight on it), as on near-permutation
// problems, which need nothing more than this one pass.
bool minima_form_assignment(const std::vector<std::int64_t>& row_of_min,
                            std::int64_t* col_of_row) {
    const std::size_t n = row_of_min.size();
    std::vector<std::int64_t> col(n, -1);
    for (std::size_t j = 0; j < n; ++j) {
        const std::int64_t i = row_of_min[j];
        if (i < 0 || col[static_cast<std::size_t>(i)] >= 0) return false;
        col[static_cast<std::size_t>(i)] = static_cast<std::int64_t>(j);
    }
    std::copy(col.begin(), col.end(), col_of_row);
    return true;
}

// buffer = row - shift, or row converted to double when shift is null.
template <class T>
FUSEKIT_CLONES void subtract(const T* __restrict row, const double* __restrict shift,
                             std::size_t n, double* __restrict buffer) {
    if (shift == nullptr) {
        for (std::size_t j = 0; j < n; ++j) buffer[j] = static_cast<double>(row[j]);
        return;
    }
#pragma omp simd
    for (std::size_t j = 0; j < n; ++j) buffer[j] = static_cast<double>(row[j]) - shift[j];
}

// Row i as doubles (a view when possible): costs, or reduced costs c_ij - s_j when column
// potentials s are given.
template <class T>
const double* ranked_row(const View<T>& view, std::size_t i, const double* shift,
                         std::vector<double>& buffer) {
    const T* row = view.cost + i * view.n;
    if constexpr (std::is_same_v<T, double>) {
        if (shift == nullptr) return row;
    }
    buffer.resize(view.n);
    subtract(row, shift, view.n, buffer.data());
    return buffer.data();
}

// The typical gap between a row's smallest value and its k-th smallest, the median over a
// sample of rows. Values are reduced costs c_ij - s_j when column potentials s are given,
// else costs. NaN when no gap is finite.
template <class T>
double typical_gap(const View<T>& view, const double* shift, std::size_t k) {
    constexpr std::size_t kSample = 16;
    const std::size_t step = std::max<std::size_t>(1, view.n / kSample);
    std::vector<double> gaps, buffer, block_min;
    for (std::size_t i = 0; i < view.n; i += step) {
        const double* row = ranked_row(view, i, shift, buffer);
        gaps.push_back(kth_smallest_bound(row, view.n, k, block_min) - min_of(row, view.n));
    }
    const double gap = kth_smallest(gaps.data(), gaps.size(), gaps.size() / 2 + 1);
    return gap < kInf ? std::max(gap, 0.0) : std::numeric_limits<double>::quiet_NaN();
}

// Appends (object, value) for every entry of x at or below bound to found: chunks are
// tested vectorised, and only the set bits of those that hit are visited.
template <class T>
FUSEKIT_CLONES void collect_at_most(const T* __restrict x, std::size_t n, double bound,
                                    std::vector<Edge>& found) {
    double chunk_bound[kChunk];
    std::fill(chunk_bound, chunk_bound + kChunk, bound);
    const auto take = [&](std::size_t j) {
        found.push_back({static_cast<std::int64_t>(j), static_cast<double>(x[j])});
    };
    std::size_t j0 = 0;
    for (; j0 + kChunk <= n; j0 += kChunk) {
        if (!chunk_at_most(x + j0, chunk_bound)) continue;
        unsigned mask = 0;
        for (unsigned l = 0; l < kChunk; ++l) {
            mask |= static_cast<unsigned>(static_cast<double>(x[j0 + l]) <= bound) << l;
        }
        for (; mask != 0; mask &= mask - 1) {
            take(j0 + static_cast<std::size_t>(__builtin_ctz(mask)));
        }
    }
    for (std::size_t j = j0; j < n; ++j) {
        if (static_cast<double>(x[j]) <= bound) take(j);
    }
}

// Every pair whose value is within gap of its row's smallest, in one pass with no per-row
// selection. rho[i] receives row i's threshold, a lower bound on the value of every pair
// left out. Edges keep the true costs. False (graph incomplete) past the edge budget.
template <class T>
bool within_gap(const View<T>& view, const double* shift, double gap,
                std::vector<std::vector<Edge>>& graph, std::vector<double>& rho) {
    graph.assign(view.n, {});
    std::vector<double> buffer;
    rho.resize(view.n);
    std::size_t edges = 0;
    for (std::size_t i = 0; i < view.n; ++i) {
        const double* row = ranked_row(view, i, shift, buffer);
        rho[i] = min_of(row, view.n) + gap;
        collect_at_most(row, view.n, rho[i], graph[i]);
        for (Edge& e : graph[i]) e.cost = view.at(i, static_cast<std::size_t>(e.object));
        edges += graph[i].size();
        if (edges > kMaxEdgesPerRow * view.n) return false;
    }
    return true;
}

// Jonker-Volgenant shortest augmenting paths on the candidate graph, agents <= objects.
// Object potentials v start at 0 and only decrease, and an object keeps v = 0 until it
// is assigned: the conditions that make a rectangular solution optimal (lap.hpp).
class SparseSolver {
   public:
    explicit SparseSolver(std::size_t objects)
        : v_(objects, 0.0), d_(objects, kInf), pred_cost_(objects, 0.0), y_(objects, -1),
          pred_(objects, -1), state_(objects, 0) {}

    // False when some agent cannot be assigned within the graph (its lists are too short).
    // start_v: initial object potentials (square problems only), or empty for zeros.
    bool solve(const std::vector<std::vector<Edge>>& graph, const std::vector<double>& start_v) {
        const std::size_t na = graph.size();
        if (start_v.empty()) {
            std::fill(v_.begin(), v_.end(), 0.0);
        } else {
            v_ = start_v;
        }
        std::fill(y_.begin(), y_.end(), -1);
        x_.assign(na, -1);
        x_cost_.assign(na, 0.0);
        std::vector<std::size_t> free_agents(na);
        for (std::size_t a = 0; a < na; ++a) free_agents[a] = a;
        for (int pass = 0; pass < kReductionPasses; ++pass) row_reduction(graph, free_agents);
        for (std::size_t a : free_agents) {
            if (!augment(graph, a)) return false;
        }
        return true;
    }

    const std::vector<double>& object_potentials() const { return v_; }
    const std::vector<std::int64_t>& object_of_agent() const { return x_; }
    // u_a = c(a, x_a) - v(x_a): the agent potentials, tight on assigned pairs.
    double agent_potential(std::size_t a) const {
        return x_cost_[a] - v_[static_cast<std::size_t>(x_[a])];
    }

   private:
    struct Entry {
        double d;
        int assigned;  // on ties prefer free objects: the search ends sooner
        std::int64_t object;
        bool operator>(const Entry& o) const {
            return d > o.d || (d == o.d && assigned > o.assigned);
        }
    };

    void relax(const std::vector<Edge>& edges, std::int64_t agent, double h) {
        for (const Edge& e : edges) {
            const auto o = static_cast<std::size_t>(e.object);
            if (state_[o] == 2) continue;
            const double nd = e.cost - v_[o] - h;
            if (!(nd < d_[o])) continue;
            d_[o] = nd;
            pred_[o] = agent;
            pred_cost_[o] = e.cost;
            if (state_[o] == 0) {
                state_[o] = 1;
                touched_.push_back(o);
            }
            heap_.push_back({nd, y_[o] >= 0, e.object});
            std::push_heap(heap_.begin(), heap_.end(), std::greater<>());
        }
    }

    // Jonker-Volgenant augmenting row reduction: each free agent takes its cheapest object
    // (by reduced cost c - v), lowering that object's potential to its second cheapest so
    // the agent stays tight; a displaced agent waits for the next pass. Potentials only
    // decrease and objects stay assigned, so the rectangular conditions hold throughout.
    void row_reduction(const std::vector<std::vector<Edge>>& graph,
                       std::vector<std::size_t>& free_agents) {
        std::size_t kept = 0;
        for (std::size_t a : free_agents) {
            const std::vector<Edge>& edges = graph[a];
            TwoCheapest best;  // over the agent's edges (at: the edge's index)
            for (std::size_t t = 0; t < edges.size(); ++t) {
                const double h = edges[t].cost - v_[static_cast<std::size_t>(edges[t].object)];
                best.offer(h, static_cast<std::int64_t>(t));
            }
            if (best.at_first < 0) {
                free_agents[kept++] = a;
                continue;
            }
            const Edge* first = &edges[static_cast<std::size_t>(best.at_first)];
            auto o = static_cast<std::size_t>(first->object);
            if (best.first < best.second) {
                if (best.second < kInf) v_[o] -= best.second - best.first;
            } else if (y_[o] >= 0) {
                // a tie: take the other one, free if possible
                first = &edges[static_cast<std::size_t>(best.at_second)];
                o = static_cast<std::size_t>(first->object);
            }
            const std::int64_t previous = y_[o];
            y_[o] = static_cast<std::int64_t>(a);
            x_[a] = first->object;
            x_cost_[a] = first->cost;
            if (previous >= 0) {
                x_[static_cast<std::size_t>(previous)] = -1;
                free_agents[kept++] = static_cast<std::size_t>(previous);
            }
        }
        free_agents.resize(kept);
    }

    void reset_search() {
        for (std::size_t o : touched_) {
            d_[o] = kInf;
            state_[o] = 0;
        }
        touched_.clear();
        heap_.clear();
        finished_.clear();
    }

    bool augment(const std::vector<std::vector<Edge>>& graph, std::size_t f) {
        relax(graph[f], static_cast<std::int64_t>(f), 0.0);
        std::size_t sink = 0;
        double dmin = 0.0;
        for (;;) {
            if (heap_.empty()) {
                reset_search();
                return false;
            }
            std::pop_heap(heap_.begin(), heap_.end(), std::greater<>());
            const Entry top = heap_.back();
            heap_.pop_back();
            const auto o = static_cast<std::size_t>(top.object);
            if (state_[o] == 2 || top.d != d_[o]) continue;  // stale entry
            dmin = top.d;
            state_[o] = 2;
            finished_.push_back(o);
            if (y_[o] < 0) {
                sink = o;
                break;
            }
            const auto i = static_cast<std::size_t>(y_[o]);
            relax(graph[i], y_[o], x_cost_[i] - v_[o] - dmin);
        }
        for (std::size_t o : finished_) v_[o] += d_[o] - dmin;
        for (std::size_t o = sink;;) {
            const auto i = static_cast<std::size_t>(pred_[o]);
            const std::int64_t previous = x_[i];
            y_[o] = static_cast<std::int64_t>(i);
            x_[i] = static_cast<std::int64_t>(o);
            x_cost_[i] = pred_cost_[o];
            if (i == f) break;
            o = static_cast<std::size_t>(previous);
        }
        reset_search();
        return true;
    }

    std::vector<double> v_, d_, pred_cost_, x_cost_;
    std::vector<std::int64_t> y_, pred_, x_;
    std::vector<unsigned char> state_;  // 0 untouched, 1 reached, 2 final
    std::vector<std::size_t> touched_, finished_;
    std::vector<Entry> heap_;
};

// Reduced costs of one matrix row, c_ij - r - col[j]; true when some is negative.
template <class T>
FUSEKIT_CLONES bool row_violates(const T* __restrict row, double r, const double* __restrict col,
                                 std::size_t n) {
    LaneFlag<double> bad = 0;
#pragma omp simd reduction(| : bad)
    for (std::size_t j = 0; j < n; ++j) bad |= static_cast<double>(row[j]) - r - col[j] < 0.0;
    return bad != 0;
}

bool has_edge(const std::vector<Edge>& edges, std::int64_t object) {
    for (const Edge& e : edges) {
        if (e.object == object) return true;
    }
    return false;
}

// Adds every pair of the full matrix whose reduced cost is negative under the sparse
// solution's potentials (and not yet a candidate); none added proves optimality. Returns
// the count, or SIZE_MAX past the edge budget (graph then incomplete).
template <class T>
std::size_t add_violations(const View<T>& view, const SparseSolver& solver,
                           std::vector<std::vector<Edge>>& graph) {
    std::vector<double> row_pot(view.n);
    std::size_t edges = 0;
    for (std::size_t i = 0; i < view.n; ++i) {
        row_pot[i] = solver.agent_potential(i);
        edges += graph[i].size();
    }
    const std::vector<double>& col_pot = solver.object_potentials();
    std::size_t added = 0;
    for (std::size_t i = 0; i < view.n; ++i) {
        const T* row = view.cost + i * view.n;
        if (!row_violates(row, row_pot[i], col_pot.data(), view.n)) continue;
        for (std::size_t j = 0; j < view.n; ++j) {
            const double c = static_cast<double>(row[j]);
            if (!(c - row_pot[i] - col_pot[j] < 0.0)) continue;
            const auto o = static_cast<std::int64_t>(j);
            if (has_edge(graph[i], o)) continue;  // rounding on a pair already solved
            graph[i].push_back({o, c});
            if (++added + edges > kMaxEdgesPerRow * view.n) return SIZE_MAX;
        }
    }
    return added;
}

// Whether the lists alone prove optimality, sparing a pass over the matrix. A pair left out
// of agent a's full list has value c - s_o >= rho_a (the list's k-th value, s the ranking
// potentials), so under the final potentials its reduced cost is at least
// rho_a - u_a - max_o (v_o - s_o); the solver only lowers potentials, so this often holds.
bool certified_by_bounds(const double* rho, const SparseSolver& solver, const double* shift) {
    const std::vector<double>& v = solver.object_potentials();
    double rise = -kInf;
    for (std::size_t o = 0; o < v.size(); ++o) {
        rise = std::max(rise, v[o] - (shift ? shift[o] : 0.0));
    }
    for (std::size_t a = 0; a < solver.object_of_agent().size(); ++a) {
        if (rho[a] < kInf && rho[a] - solver.agent_potential(a) < rise) return false;
    }
    return true;
}

}  // namespace

template <class T>
bool solve_by_candidates(const T* cost, std::size_t n, std::int64_t* col_of_row, double* u,
                         double* v) {
    const View<T> view{cost, n};
    // Candidates are ranked by reduced cost against the column minima (Jonker-Volgenant's
    // column reduction), which also start the solver.
    std::vector<double> start(n, kInf);
    std::vector<std::int64_t> row_of_min(n, -1);
    for (std::size_t i = 0; i < n; ++i) {
        argmin_into(cost + i * n, static_cast<std::int64_t>(i), start.data(), row_of_min.data(), n);
    }
    if (minima_form_assignment(row_of_min, col_of_row)) {
        if (u) std::fill(u, u + n, 0.0);
        if (v) std::copy(start.begin(), start.end(), v);
        return true;
    }
    // A fully forbidden column (+inf) gives no usable reference: rank raw costs.
    if (!std::all_of(start.begin(), start.end(), [](double x) { return std::isfinite(x); })) {
        start.clear();
    }
    const double* ranking = start.empty() ? nullptr : start.data();
    // Pairs within a gap of the row's smallest value; each widening multiplies the gap.
    double gap = typical_gap(view, ranking, std::min(n, kGapRank));
    if (std::isnan(gap)) return false;
    std::vector<double> rho;
    std::vector<std::vector<Edge>> graph;
    if (!within_gap(view, ranking, gap, graph, rho)) return false;

    SparseSolver solver(n);
    bool solved = false;
    // Gaps tried after the first: doubled while the lists cannot assign every row, and
    // halfway (geometrically) between the largest such gap and the smallest past the edge
    // budget once one is: BERT-base's MLP similarities need 1.5-2x the typical gap, where
    // 4x passed the budget and sent every one of them to the dense solver.
    double infeasible = gap, too_many = kInf;
    int growths = 0;
    for (int round = 0; round < kMaxRounds && !solved; ++round) {
        if (!solver.solve(graph, start)) {
            if (!(gap > 0.0)) return false;
            infeasible = gap;
            for (;;) {
                if (++growths > kMaxGrowths) return false;
                gap = too_many < kInf ? std::sqrt(infeasible * too_many)
                                      : kGapGrowth * infeasible;
                if (within_gap(view, ranking, gap, graph, rho)) break;
                too_many = gap;
            }
            continue;
        }
        if (certified_by_bounds(rho.data(), solver, ranking)) {
            solved = true;
        } else {
            const std::size_t added = add_violations(view, solver, graph);
            if (added == SIZE_MAX) return false;  // past the edge budget
            solved = added == 0;
        }
    }
    if (!solved) return false;

    const auto& x = solver.object_of_agent();
    std::copy(x.begin(), x.end(), col_of_row);
    if (u) {
        for (std::size_t a = 0; a < n; ++a) u[a] = solver.agent_potential(a);
    }
    if (v) std::copy(solver.object_potentials().begin(), solver.object_potentials().end(), v);
    return true;
}

template bool solve_by_candidates<float>(const float*, std::size_t, std::int64_t*, double*,
                                         double*);
template bool solve_by_candidates<double>(const double*, std::size_t, std::int64_t*, double*,
                                          double*);

}  // namespace fusekit
