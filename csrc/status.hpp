// Status codes returned by every kernel; bindings.cpp maps them to Python exceptions.
#pragma once

namespace fusekit {

enum class Status : int {
    ok = 0,
    invalid_shape,      // sizes disagree with each other
    non_finite,         // NaN or -inf where a finite value (or +inf) is required
    infeasible,         // no complete assignment avoids the forbidden (+inf) pairs
};

}  // namespace fusekit
