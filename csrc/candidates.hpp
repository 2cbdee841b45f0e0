// Exact assignment through short candidate lists and a dual certificate on the full matrix.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fusekit {

// Solves the dense problem of solve_assignment (lap.hpp: same outputs) by keeping each
// agent's cheapest candidates (agents: the shorter side; objects: the longer), solving
// that sparse problem, and proving optimality on the full matrix with the dual potentials;
// violated pairs are added and the sparse problem solved again. warm_columns (square
// problems, or null): finite column potentials of a similar problem, which pick the
// candidates by reduced cost and start the solver. Returns false, with nothing written, when it gives
// up (the caller then runs the dense solver).
template <class T>
bool solve_by_candidates(const T* cost, std::size_t nr, std::size_t nc,
                         const double* warm_columns, std::int64_t* col_of_row, double* u,
                         double* v);

}  // namespace fusekit
