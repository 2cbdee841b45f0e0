// Exact assignment through short candidate lists and a dual certificate on the full matrix.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fusekit {

// Solves the dense problem of solve_assignment (lap.hpp: same outputs) through candidate
// pairs (PERFORMANCE.md: most pairs are hopeless). Agents are the shorter side, objects the
// longer; each agent keeps its cheapest pairs, the sparse problem is solved with
// Jonker-Volgenant shortest augmenting paths, and the dual potentials prove optimality on
// the full matrix: from the candidate bounds alone when they suffice, else by a pass that
// adds the violated pairs for another solve. The result has the dense optimum's cost.
// warm_columns (square problems, or null): finite column potentials of a similar problem,
// which pick the candidates by reduced cost and start the solver. Returns false, with
// nothing written, when it gives up (the caller then runs the dense solver).
template <class T>
bool solve_by_candidates(const T* cost, std::size_t nr, std::size_t nc,
                         const double* warm_columns, std::int64_t* col_of_row, double* u,
                         double* v);

}  // namespace fusekit
