// Linear assignment: Jonker-Volgenant shortest augmenting paths, never padded to a square.
// Large square problems go through candidate pairs with a dual certificate
// (candidates.hpp); small square and wide ones augment row by row over the dense matrix;
// tall ones augment over their short side, the columns (rectangular.hpp). PFNM-shaped
// problems are solved in their faster orientation (through a transposed copy, up to a size).
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
// Extra memory, whatever the values (ties included): O(nr + nc) for wide and small square
// problems, O(nr + k nc) for tall ones (k = 8 or 16 list entries and 2k block minima per
// column), at most kMaxEdgesPerRow (64, candidates.cpp) candidate pairs of 16 bytes per row
// for large square ones, which otherwise fall back to the dense solver, and a transposed
// copy of problems of up to kMaxTransposed (2^21, lap.cpp) entries solved in the other
// orientation.
template <class T>
Status solve_assignment(const T* cost, std::size_t nr, std::size_t nc, std::int64_t* col_of_row,
                        double* u, double* v);

}  // namespace fusekit
