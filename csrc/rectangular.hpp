// Tall assignment (more rows than columns), augmenting over the short side: the solver
// behind lap.hpp for tall problems at least four times taller than wide or with many new
// neurons, and for wide ones with many new neurons through their transpose (lap.cpp picks
// the orientation; the others go to the dense solver).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "status.hpp"

namespace fusekit {

// Rows head..end of a run: consecutive rows each dominating the previous (elementwise >=).
struct Run {
    std::size_t head, end;  // first free member, last member
};

// Runs of fewer lines are not worth collapsing: their members are listed one by one.
constexpr std::size_t kMinRun = 4;

// The runs of at least kMinRun lines that the flags mark: rising[o] says line o dominates
// line o - 1 (rising[0] is not read), in order.
std::vector<Run> rising_runs(const std::vector<unsigned char>& rising);

// The longest few runs of at least kMinRun rows of a row-major nr x nc matrix, longest first
// (PFNM's new-neuron slots, with their growing penalty, form one). Mostly one vector compare
// per third row: unrelated rows are told apart in their first chunk.
template <class T>
std::vector<Run> dominated_runs(const T* cost, std::size_t nr, std::size_t nc);

// Same contract and outputs as solve_assignment (lap.hpp) for nr > nc > 0, NaN and -inf
// refused (Status::non_finite): the runs' rows checked on their own, the others as their
// entries are offered to the lists. Agents (the columns, the short side) are all assigned, one
// shortest augmenting path each, searched over the agents only: the free objects (the long
// side) enter a search through each agent's few cheapest free objects, kept in short sorted
// lists built in one or two passes over the matrix and refilled from the agent's own line
// when exhausted; objects that are matched are read one line at a time. Runs of consecutive
// objects each dominating the next (elementwise <=, as PFNM's new-neuron slots with their
// growing penalty: `runs`, from dominated_runs) enter as one object, their first free member.
// Extra memory O(m + n k).
template <class T>
Status solve_tall(const T* cost, std::size_t nr, std::size_t nc, std::vector<Run> runs,
                  std::int64_t* col_of_row, double* u, double* v);

}  // namespace fusekit
