// Linear assignment: Jonker-Volgenant shortest augmenting paths, on candidate pairs with a
// dual certificate (candidates.hpp) for all but small problems, else on the dense matrix.
#pragma once
#include <cstddef>
#include <cstdint>

#include "status.hpp"

namespace fusekit {

// Minimises sum_i cost[i, col_of_row[i]] over assignments of min(nr, nc) pairs for a row-major
// nr x nc matrix (float or double); +inf marks a forbidden pair, NaN and -inf are rejected.
//
// col_of_row (length nr) receives the column of each row, or -1 for rows left unassigned
// (only when nr > nc). u (nr) and v (nc), when not null, receive dual potentials with
// u[i] + v[j] <= cost[i, j], equality on assigned pairs, and v (resp. u) equal to its
// maximum on unassigned columns (rows) of a rectangular problem.
//
// warm_u / warm_v (lengths nr / nc, both null or both set) are the duals of a previous,
// similar problem; they change how fast, never what, the solver finds. They speed up
// square problems; rectangular ones of candidate size are solved cold (faster, measured).
template <class T>
Status solve_assignment(const T* cost, std::size_t nr, std::size_t nc, const double* warm_u,
                        const double* warm_v, std::int64_t* col_of_row, double* u, double* v);

// Solves `count` independent problems (same contract as above, no warm start or duals)
// on up to n_threads threads (0: hardware concurrency). statuses receives each result.
template <class T>
void solve_assignments(const T* const* costs, const std::size_t* nr, const std::size_t* nc,
                       std::size_t count, std::int64_t* const* col_of_row, Status* statuses,
                       int n_threads);

}  // namespace fusekit
