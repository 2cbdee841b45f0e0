// Vectorised helpers on matrix lines shared by the candidate and rectangular solvers.
#pragma once
#include <cstddef>
#include <vector>

namespace fusekit {

// acc[j] = min(acc[j], line[j]) for j < n.
template <class T>
void min_into(const T* line, double* acc, std::size_t n);

// k-th smallest of x[0..n), n >= k (reorders x).
double kth_smallest(double* x, std::size_t n, std::size_t k);

// An upper bound on the k-th smallest of line[0..n), close to it: the k-th smallest of the
// minima of 4k strided blocks (elementwise minima of consecutive 4k-wide segments, fully
// vectorised); k block minima are k distinct entries, so they bound it from above. +inf
// when n <= k.
double kth_smallest_bound(const double* line, std::size_t n, std::size_t k,
                          std::vector<double>& block_min);

}  // namespace fusekit
