// Vectorised helpers on matrix lines shared by the dense, candidate and rectangular solvers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace fusekit {

// Whether b[j] >= a[j] for every j < n (false at a NaN), tested in chunks so that unrelated
// lines are told apart at once. dominates(line, line + 1, n - 1): whether line[0..n) never
// decreases.
template <class T>
bool dominates(const T* a, const T* b, std::size_t n);

// rising[j] &= line[j] >= line[j - 1] for 1 <= j < n: which steps of a line never fall,
// narrowed one line at a time.
template <class T>
void keep_rising(const T* line, unsigned char* rising, std::size_t n);

// acc[j] = min(acc[j], line[j]) for j < n.
template <class T>
void min_into(const T* line, double* acc, std::size_t n);

// Whether x[0..n) holds valid costs only (no NaN, no -inf); has_inf: whether it holds +inf.
template <class T>
bool valid_costs(const T* x, std::size_t n, bool& has_inf);

// Block minima of `count` rows of n entries, every step-th row from `first`: the seen + t-th
// row read (first + t * step * n) into block (seen + t) % blocks of block_min (blocks x n,
// min_into each). One call per range of rows. NaN entries are passed over.
template <class T>
void block_minima(const T* first, std::size_t count, std::size_t step, std::size_t n,
                  std::size_t seen, double* block_min, std::size_t blocks);

// out[a] = the k-th smallest of x[i * n + a] over i < rows (1 <= k <= rows), for every
// column a of a rows x n matrix at once, whose columns it sorts: a sorting network over
// the rows, each compare-exchange a vector min and max across the columns (counting ranks
// took rows^2 compares per column, 7% of a 550x50 solve).
void kth_smallest_columns(double* x, std::size_t rows, std::size_t n, std::size_t k,
                          double* out);

// Whether line b is line a plus one constant, b[j] - a[j] the same for every j < n (exactly,
// in double): PFNM's new-neuron slots, a cost per local neuron plus a penalty per slot.
template <class T>
bool shifted_line(const T* a, const T* b, std::size_t n);

// min of line[0..n), +inf when n == 0.
template <class T>
double min_of(const T* line, std::size_t n);

// acc[j] = min(acc[j], line[j]) for j < n, and at[j] = index where line[j] is smaller: the
// minima of a matrix's columns and their rows, updated one row (index) at a time.
template <class T>
void argmin_into(const T* line, std::int64_t index, double* acc, std::int64_t* at, std::size_t n);

// k-th smallest of x[0..n), n >= k (reorders x).
double kth_smallest(double* x, std::size_t n, std::size_t k);

// An upper bound on the k-th smallest of line[0..n), close to it: the k-th smallest of the
// minima of 4k strided blocks (elementwise minima of consecutive 4k-wide segments, fully
// vectorised); k block minima are k distinct entries, so they bound it from above. +inf
// when n <= k.
double kth_smallest_bound(const double* line, std::size_t n, std::size_t k,
                          std::vector<double>& block_min);

}  // namespace fusekit
