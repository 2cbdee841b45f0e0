// Linear assignment: Jonker-Volgenant shortest augmenting paths. Square problems go through
// candidate pairs with a dual certificate (candidates.hpp) when large, else the dense
// matrix; rectangular ones augment over their short side (rectangular.hpp).
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
// maximum, 0, on unassigned columns (rows) of a rectangular problem.
//
// Extra memory: O(nr + nc) for rectangular and small square problems; large square ones
// keep at most kMaxEdgesPerRow (candidates.cpp) candidate pairs per row, else fall back
// to the dense solver.
template <class T>
Status solve_assignment(const T* cost, std::size_t nr, std::size_t nc, std::int64_t* col_of_row,
                        double* u, double* v);

}  // namespace fusekit
