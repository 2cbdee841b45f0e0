// The shortest-path step of Jonker-Volgenant augmentation on a dense matrix, shared by the
// square and wide solver (lap.cpp) and the tall one (rectangular.cpp).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace fusekit {

// Dijkstra over the n nodes of one side (the columns of a square or wide problem, the
// columns of a tall one searched from its free rows) with dense relaxations: each step
// reads one whole row of the matrix, which on these problems beats index lists with
// gathers (few rows per search).
// Reduced distances live in d; penalty is 0 on nodes that end a search (free), +inf on the
// others, so that ties prefer an end and the search stops early on degenerate problems, and
// NaN on the nodes the search has closed (one load tells open from closed).
struct AugmentSearch {
    explicit AugmentSearch(std::size_t n) : d(n), penalty(n, 0.0), pred(n) {}

    // The nodes that end a search: those with match[k] < 0 (free), penalty 0; the others +inf.
    void set_ends(const std::int64_t* match, std::size_t n);

    // d[k] holds node k's entry cost on entry: it becomes d[k] - offset - pot[k], every
    // node open: the last search's closed nodes reopen at +inf, since a finished search leaves
    // them all assigned (its sink included). Returns the smallest distance, and in best_free
    // the smallest on free nodes.
    double start(double offset, const double* pot, std::size_t n, double& best_free);

    // Closes an open node at distance dmin, a free one when tied (free_tied), and returns it.
    std::size_t pick(double dmin, bool free_tied, std::size_t n);

    // Relaxes every open node k through a row of the matrix (node k at line[k]): distance
    // line[k] - shift - pot[k], reached from `from`. Returns the new smallest open distance.
    template <class T>
    double relax(const T* line, double shift, std::int64_t from, const double* pot,
                 std::size_t n, double& best_free);

    // Closes the first open node from `from` on at distance dmin and returns it; n, closing
    // nothing, if there is none (the nodes before `from` are closed or farther).
    std::size_t pick_tied_after(double dmin, std::size_t from, std::size_t n);

    // What relax returns when a step has nothing to relax: the smallest distance over the
    // open nodes, and in best_free over the free ones.
    double smallest_open(std::size_t n, double& best_free) const;

    std::vector<double> d, penalty;
    std::vector<std::int64_t> pred;
    std::vector<std::size_t> finished;  // closed nodes, in order
};

}  // namespace fusekit
