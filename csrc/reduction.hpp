// A piece of Jonker-Volgenant's augmenting row reduction shared by the candidate and tall
// solvers (the dense solver's vectorised scan tracks values only, and finds where after).
#pragma once
#include <cstdint>
#include <limits>

namespace fusekit {

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
