// Pieces of Jonker-Volgenant's augmenting row reduction shared by the solvers: the two
// cheapest an agent is offered (candidate and tall solvers; the dense solver's vectorised
// scan tracks values only, and finds where after), and when the passes stop (dense and tall).
#pragma once
#include <cstddef>
#include <cstdint>
#include <limits>

namespace fusekit {

// At most this many reduction passes.
constexpr int kMaxReductionPasses = 16;

// Whether the reduction stops after pass `pass` (from 0), which left `after` of the `before`
// agents it started with free: when none is left, or from the second pass (JV's two) on, at
// the first that frees less than a `share`-th of them.
inline bool reduction_stalled(int pass, std::size_t before, std::size_t after,
                              std::size_t share) {
    return after == 0 || (pass >= 1 && share * (before - after) < before + share - 1);
}

// The two smallest reduced costs an agent is offered and where they are (-1: nowhere, or a
// bound on costs not looked at); ties keep the first offered.
struct TwoCheapest {
    double first = std::numeric_limits<double>::infinity();
    double second = std::numeric_limits<double>::infinity();
    std::int64_t at_first = -1, at_second = -1;
    void offer(double r, std::int64_t at) {
        if (r < first) {
            second = first;
            at_second = at_first;
            first = r;
            at_first = at;
        } else if (r < second) {
            second = r;
            at_second = at;
        }
    }
};

}  // namespace fusekit
