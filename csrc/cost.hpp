// Cost kernels: dense matrices between neuron vectors, row-major, no Python types.
#pragma once
#include <cstddef>

#include "status.hpp"

namespace fusekit {

// out[i, j] = sum_p (a[i, p] - b[j, p])^2 for a (n x p), b (m x p); out is n x m.
Status sqeuclidean_cost(const double* a, std::size_t n, const double* b, std::size_t m,
                        std::size_t p, double* out, int n_threads);

}  // namespace fusekit
