#include "cost.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "simd.hpp"

#ifdef FUSEKIT_OPENMP
#include <omp.h>
#endif

namespace fusekit {

namespace {

// Every cost here is out[i, j] = sum_p (r[i, p] * w[j, p] - t[i, p])^2 + offset[i]: a
// weighted squared distance with r = sqrt(weight) and t = r * centre. Written with the
// square root folded in, each (i, j, p) term is two fused multiply-adds, the same work as
// one GEMM pair, and unlike the |w|^2 - 2 w.m + |m|^2 expansion it does not cancel
// catastrophically for near matches.
//
// Blocking: kRows rows of (r, t) for kDepth coordinates sit in a small packed panel
// ([p][row] so each is a broadcast), the points are transposed once so that kCols
// consecutive columns are one vector load, and the output tile stays in registers.
constexpr std::size_t kRows = 4;
constexpr std::size_t kDepth = 128;

template <std::size_t kCols>
__attribute__((always_inline)) inline void panel_product(const double* __restrict rt,
                                                         const double* __restrict wt,
                                                         std::size_t depth, std::size_t m,
                                                         double* __restrict out,
                                                         std::size_t ld, std::size_t rows) {
    std::size_t j0 = 0;
    for (; j0 + kCols <= m; j0 += kCols) {
        double acc[kRows][kCols];
        for (std::size_t ii = 0; ii < kRows; ++ii) {
            for (std::size_t jj = 0; jj < kCols; ++jj) {
                acc[ii][jj] = ii < rows ? out[ii * ld + j0 + jj] : 0.0;
            }
        }
        for (std::size_t q = 0; q < depth; ++q) {
            const double* w = wt + q * m + j0;
            const double* panel = rt + q * 2 * kRows;
            for (std::size_t ii = 0; ii < kRows; ++ii) {
                const double r = panel[ii], t = panel[kRows + ii];
                for (std::size_t jj = 0; jj < kCols; ++jj) {
                    const double e = r * w[jj] - t;
                    acc[ii][jj] += e * e;
                }
            }
        }
        for (std::size_t ii = 0; ii < rows; ++ii) {
            for (std::size_t jj = 0; jj < kCols; ++jj) out[ii * ld + j0 + jj] = acc[ii][jj];
        }
    }
    for (std::size_t ii = 0; ii < rows; ++ii) {
        for (std::size_t q = 0; q < depth; ++q) {
            const double r = rt[q * 2 * kRows + ii], t = rt[q * 2 * kRows + kRows + ii];
            const double* w = wt + q * m;
            for (std::size_t j = j0; j < m; ++j) {
                const double e = r * w[j] - t;
                out[ii * ld + j] += e * e;
            }
        }
    }
}

__attribute__((target("avx512f,avx512dq,avx2,fma"))) void panel_avx512(
    const double* rt, const double* wt, std::size_t depth, std::size_t m, double* out,
    std::size_t ld, std::size_t rows) {
    panel_product<24>(rt, wt, depth, m, out, ld, rows);
}

__attribute__((target("avx2,fma"))) void panel_avx2(const double* rt, const double* wt,
                                                     std::size_t depth, std::size_t m,
                                                     double* out, std::size_t ld,
                                                     std::size_t rows) {
    panel_product<12>(rt, wt, depth, m, out, ld, rows);
}

void panel_default(const double* rt, const double* wt, std::size_t depth, std::size_t m,
                   double* out, std::size_t ld, std::size_t rows) {
    panel_product<4>(rt, wt, depth, m, out, ld, rows);
}

using PanelFn = void (*)(const double*, const double*, std::size_t, std::size_t, double*,
                         std::size_t, std::size_t);

PanelFn select_panel() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) {
        return panel_avx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return panel_avx2;
#endif
    return panel_default;
}

int thread_count(int n_threads) {
#ifdef FUSEKIT_OPENMP
    return n_threads > 0 ? n_threads : omp_get_max_threads();
#else
    (void)n_threads;
    return 1;
#endif
}

// Drives the blocked product. pack(i0, rows, q0, depth, panel) writes r and t of rows
// i0..i0+rows-1, coordinates q0..q0+depth-1, into panel[q][0..kRows) and
// panel[q][kRows..2 kRows) (missing rows zero). out rows have stride ld.
template <class Pack>
void weighted_distances(const Pack& pack, std::size_t n, const double* points, std::size_t m,
                        std::size_t p, double* out, std::size_t ld, int n_threads) {
    if (n == 0 || m == 0) return;
    std::vector<double> wt(p * m);
    for (std::size_t j0 = 0; j0 < m; j0 += 32) {
        for (std::size_t q0 = 0; q0 < p; q0 += 32) {
            for (std::size_t j = j0; j < std::min(m, j0 + 32); ++j) {
                for (std::size_t q = q0; q < std::min(p, q0 + 32); ++q) {
                    wt[q * m + j] = points[j * p + q];
                }
            }
        }
    }
    static const PanelFn panel_fn = select_panel();
    const std::size_t tiles = (n + kRows - 1) / kRows;
#ifdef FUSEKIT_OPENMP
#pragma omp parallel num_threads(thread_count(n_threads))
#endif
    {
        std::vector<double> panel(2 * kRows * kDepth);
#ifdef FUSEKIT_OPENMP
#pragma omp for schedule(dynamic, 4)
#endif
        for (std::ptrdiff_t tile = 0; tile < static_cast<std::ptrdiff_t>(tiles); ++tile) {
            const std::size_t i0 = static_cast<std::size_t>(tile) * kRows;
            const std::size_t rows = std::min(kRows, n - i0);
            for (std::size_t ii = 0; ii < rows; ++ii) {
                std::fill(out + (i0 + ii) * ld, out + (i0 + ii) * ld + m, 0.0);
            }
            for (std::size_t q0 = 0; q0 < p; q0 += kDepth) {
                const std::size_t depth = std::min(kDepth, p - q0);
                pack(i0, rows, q0, depth, panel.data());
                panel_fn(panel.data(), wt.data() + q0 * m, depth, m, out + i0 * ld, ld, rows);
            }
        }
    }
    (void)n_threads;
}

// Precision-weighted sum of squares for the NAFI/PFNM weights: client precision s and
// global precision P combine into s (P + lam s / 2) / (s + P), i.e. the PFNM weight
// s P / (s + P) plus lam/2 times the KL's s^2 / (P + s).
inline double posterior_weight(double s, double P, double lam) {
    return s * (P + 0.5 * lam * s) / (s + P);
}

// The parts of the KL that do not depend on the local neuron: 1/2 sum_p (r - 1 - ln r).
inline double kl_constant(double s, double P) {
    const double x = s / P;
    return 0.5 * (x - std::log1p(x));
}

}  // namespace

Status sqeuclidean_cost(const double* a, std::size_t n, const double* b, std::size_t m,
                        std::size_t p, double* out, int n_threads) {
    auto pack = [&](std::size_t i0, std::size_t rows, std::size_t q0, std::size_t depth,
                    double* panel) {
        for (std::size_t q = 0; q < depth; ++q) {
            for (std::size_t ii = 0; ii < kRows; ++ii) {
                panel[q * 2 * kRows + ii] = ii < rows ? 1.0 : 0.0;
                panel[q * 2 * kRows + kRows + ii] = ii < rows ? a[(i0 + ii) * p + q0 + q] : 0.0;
            }
        }
    };
    if (p == 0) {
        std::fill(out, out + n * m, 0.0);
        return Status::ok;
    }
    weighted_distances(pack, n, b, m, p, out, m, n_threads);
    return Status::ok;
}

Status posterior_cost(const PosteriorCostInput& in, double* out, int n_threads) {
    const std::size_t p = in.p, nl = in.n_local, ng = in.n_global;
    const double lam = in.lam;
    auto pack = [&](std::size_t i0, std::size_t rows, std::size_t q0, std::size_t depth,
                    double* panel) {
        for (std::size_t q = 0; q < depth; ++q) {
            const double s = in.precision[q0 + q];
            for (std::size_t ii = 0; ii < kRows; ++ii) {
                double r = 0.0, t = 0.0;
                if (ii < rows) {
                    const std::size_t k = (i0 + ii) * p + q0 + q;
                    const double P = in.precisions[k];
                    r = std::sqrt(posterior_weight(s, P, lam));
                    t = r * (in.sums[k] / P);
                }
                panel[q * 2 * kRows + ii] = r;
                panel[q * 2 * kRows + kRows + ii] = t;
            }
        }
    };
    if (p > 0) {
        weighted_distances(pack, ng, in.local, nl, p, out, nl, n_threads);
    } else {
        std::fill(out, out + ng * nl, 0.0);
    }
    const double S = in.n_clients;
    for (std::size_t i = 0; i < ng; ++i) {
        double offset = 2.0 * std::log((S - in.counts[i]) / in.counts[i]);
        if (lam != 0.0) {
            double kl = 0.0;
            for (std::size_t q = 0; q < p; ++q) {
                kl += kl_constant(in.precision[q], in.precisions[i * p + q]);
            }
            offset += lam * kl;
        }
        double* row = out + i * nl;
        for (std::size_t j = 0; j < nl; ++j) row[j] += offset;
    }

    // New-neuron slots: every slot k has the same per-neuron cost (distance to the prior)
    // plus the slot's own penalty 2 log(k S / gamma0).
    std::vector<double> weight(p), prior_kl(p);
    double new_offset = 0.0;
    for (std::size_t q = 0; q < p; ++q) {
        const double P0 = 1.0 / in.sigma0_2[q];
        weight[q] = posterior_weight(in.precision[q], P0, lam);
        if (lam != 0.0) new_offset += lam * kl_constant(in.precision[q], P0);
    }
    std::vector<double> to_prior(nl);
    for (std::size_t j = 0; j < nl; ++j) {
        double acc = 0.0;
        const double* w = in.local + j * p;
        for (std::size_t q = 0; q < p; ++q) {
            const double e = w[q] - in.mu0[q];
            acc += weight[q] * e * e;
        }
        to_prior[j] = acc + new_offset;
    }
    for (std::size_t k = 0; k < nl; ++k) {
        const double penalty =
            2.0 * std::log(static_cast<double>(k + 1) * S / in.gamma0);
        double* row = out + (ng + k) * nl;
        for (std::size_t j = 0; j < nl; ++j) row[j] = to_prior[j] + penalty;
    }
    return Status::ok;
}

}  // namespace fusekit
