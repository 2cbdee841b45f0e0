// Cost kernels: dense matrices between neuron vectors, row-major, no Python types.
#pragma once
#include <cstddef>
#include <cstdint>

#include "status.hpp"

namespace fusekit {

// Fortran BLAS dgemm (column-major, 32-bit integers), as SciPy's OpenBLAS exports it.
// bindings.cpp looks the pointer up once, so the core links no BLAS of its own.
using Dgemm = void (*)(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const double* alpha, const double* a, const int* lda,
                       const double* b, const int* ldb, const double* beta, double* c,
                       const int* ldc);

// The same in single precision.
using Sgemm = void (*)(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

// The BLAS the kernels call: dgemm and sgemm, plus OpenBLAS's thread-count controls when the
// library exports them (null otherwise; the products then run with the library's own setting).
struct Blas {
    Dgemm gemm = nullptr;
    Sgemm single_gemm = nullptr;
    int (*get_threads)() = nullptr;
    void (*set_threads)(int) = nullptr;
};

// Smallest of x[0..n) (+inf when n == 0), or NaN when some value is NaN or infinite: the
// input validation of the kernels in one vectorised pass.
double finite_min(const double* x, std::size_t n);

// target[rows[k]] += sign * values[k * stride] (times scale elementwise unless null; rows
// of p doubles; rows unique and in range; sign +1 or -1; stride p, or 0 to add one vector
// to every row).
void add_rows(double* target, std::size_t p, const std::int64_t* rows, const double* values,
              std::size_t stride, const double* scale, std::size_t n, double sign);

// The moments of an assignment, one pass per client: with x = values[k] * scale,
// sums[rows[k]] += x * seen, squares[rows[k]] += (x * x) * seen, counts[rows[k]] += seen
// (rows of p doubles, unique and in range; scale and seen of length p).
void add_moments(double* sums, double* squares, double* counts, std::size_t p,
                 const std::int64_t* rows, const double* values, const double* scale,
                 const double* seen, std::size_t n);

// out[i, j] = sum_p (a[i, p] - b[j, p])^2 for a (n x p), b (m x p); out is n x m.
Status sqeuclidean_cost(const Blas& blas, const double* a, std::size_t n, const double* b,
                        std::size_t m, std::size_t p, double* out);

// out[i] = sum over the coordinates q with s[q] > 0 of ln(1/s[q] + 1/precisions[i, q]) for
// the n_global rows of precisions (n_global x p): the log-determinant of a local neuron's
// Gaussian marginal under global i (ALGORITHMS.md section 3, "Empirical Bayes").
void log_det_rows(const double* s, const double* precisions, std::size_t n_global,
                  std::size_t p, double* out);

// Inputs of the PFNM / NAFI matching cost of one client against the global posterior
// (ALGORITHMS.md section 3-4). Per-coordinate arrays have length p; s = client precision
// 1/sigma_s^2 (0 = unobserved), mu0 and sigma0_2 the prior.
struct PosteriorCostInput {
    const double* local;       // (n_local x p) client neuron vectors w_j
    const double* precision;   // (p) s
    const double* sums;        // (n_global x p) precision-weighted sums incl. prior term
    const double* precisions;  // (n_global x p) P_i incl. 1/sigma0^2, all > 0
    const double* counts;      // (n_global) n_i, 1 <= n_i < n_clients
    const double* mu0;         // (p)
    const double* sigma0_2;    // (p), > 0
    std::size_t n_local, n_global, p;
    double n_clients, gamma0;
    double lam;  // NAFI's KL weight; 0 gives PFNM
};

// Fills out ((n_global + n_local) x n_local) with the cost to minimise: rows < n_global
// are existing global neurons, row n_global + k - 1 is the k-th new-neuron slot. A product
// of at least kSingleFlops runs in single precision (the entries it cancels are recomputed
// exactly, as in double precision).
constexpr double kSingleFlops = 1e9;
Status posterior_cost(const Blas& blas, const PosteriorCostInput& in, double* out);

}  // namespace fusekit
