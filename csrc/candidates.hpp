// Exact square assignment through short candidate lists and a dual certificate on the full
// matrix.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fusekit {

// Solves the dense n x n problem of solve_assignment (lap.hpp: same outputs) through
// candidate pairs (PERFORMANCE.md: most pairs are hopeless): each row keeps the pairs
// within a typical gap of its smallest reduced cost, the sparse problem is solved with
// Jonker-Volgenant shortest augmenting paths, and the dual potentials prove optimality on
// the full matrix: from the candidate bounds alone when they suffice, else by a pass that
// adds the violated pairs for another solve. The result has the dense optimum's cost.
// Returns false, with nothing written, when it gives up (the caller then runs the dense
// solver): among others when the candidates would exceed kMaxEdgesPerRow per row on
// average (tie-heavy matrices), which bounds the extra memory to O(n).
template <class T>
bool solve_by_candidates(const T* cost, std::size_t n, std::int64_t* col_of_row, double* u,
                         double* v);

}  // namespace fusekit
