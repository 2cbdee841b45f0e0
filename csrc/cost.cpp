#include "cost.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <optional>
#include <type_traits>
#include <vector>

#include "simd.hpp"


namespace fusekit {

namespace {

// Scratch memory reused across calls on the same thread: the operands are megabytes, and
// fresh allocations cost more in page faults than the kernels' arithmetic at small sizes.
template <class T>
T* scratch(std::vector<T>& buffer, std::size_t size) {
    if (buffer.size() < size) buffer.resize(size);
    return buffer.data();
}

// Every cost here is a weighted squared distance sum_p a_ip (w_jp - m_ip)^2, expanded into
// a matrix product (BLAS dgemm) plus row and column terms. A result below this fraction
// of the magnitude of its terms has lost digits to cancellation (a local neuron close to
// a global one) and is recomputed as a sum of squared differences; above it, rounding of
// a length-p product stays far below 1e-10 relative. Few entries qualify: about one per
// local neuron that matches.
constexpr double kCancellation = 1.0 / 64;

// Threads: the products run on OpenBLAS's thread pool only when they are large; everything
// else here is serial and vectorised. An OpenMP team spinning between the products took the
// cores from OpenBLAS's threads: measured 10-60x slower on 2 shared cores.

// Bounds the left operand of one product call (rows x k doubles) at 32 MB: fewer, larger
// calls, because each call wakes OpenBLAS's threads again (on 2 busy cores, 4 MB tiles
// ran 4x slower multi-threaded than single-threaded).
constexpr std::size_t kTileElements = std::size_t{1} << 22;

// Products below this many flops run on one BLAS thread. A PFNM matrix of a 784-100-10
// layer (150 x 100 x 800, 24 MFLOP) took 0.63 ms on one thread and 0.59 ms on two of an
// idle 2-core machine, but 3-5x longer on two when another process held one core (the
// second thread waits for a core the scheduler gives elsewhere).
constexpr double kSerialFlops = 256e6;

// OpenBLAS's pthreads build keeps one process-wide thread count (its "_local" setter
// included), so concurrent kernels share the change: the first one in sets one thread,
// the last one out restores the count it found.
class SerialBlas {
public:
    explicit SerialBlas(const Blas& blas) : blas_(blas.set_threads ? &blas : nullptr) {
        if (blas_ == nullptr) return;
        std::lock_guard<std::mutex> lock(mutex_);
        if (active_++ == 0) {
            saved_ = blas_->get_threads();
            if (saved_ > 1) blas_->set_threads(1);
        }
    }
    ~SerialBlas() {
        if (blas_ == nullptr) return;
        std::lock_guard<std::mutex> lock(mutex_);
        if (--active_ == 0 && saved_ > 1) blas_->set_threads(saved_);
    }
    SerialBlas(const SerialBlas&) = delete;
    SerialBlas& operator=(const SerialBlas&) = delete;

private:
    const Blas* blas_;
    static inline std::mutex mutex_;
    static inline int active_ = 0;
    static inline int saved_ = 1;
};

// Row-major out (rows x m, row stride ld) = alpha * left (rows x k) * right (m x k)^T: the
// column-major product out^T = alpha * right^T' * left^T, with both operands read in place.
void product(const Blas& blas, const double* left, std::size_t rows, const double* right,
             std::size_t m, std::size_t k, double alpha, double* out, std::size_t ld) {
    if (k == 0) {
        for (std::size_t i = 0; i < rows; ++i) std::fill(out + i * ld, out + i * ld + m, 0.0);
        return;
    }
    const int mm = static_cast<int>(m), nn = static_cast<int>(rows), kk = static_cast<int>(k);
    const int ldk = kk, ldc = static_cast<int>(ld);
    const double beta = 0.0;
    const double flops = 2.0 * static_cast<double>(rows) * static_cast<double>(m) *
                         static_cast<double>(k);
    std::optional<SerialBlas> serial;
    if (flops < kSerialFlops) serial.emplace(blas);
    blas.gemm("T", "N", &mm, &nn, &kk, &alpha, right, &ldk, left, &ldk, &beta, out, &ldc);
}

// product() in single precision, alpha = 1: the result, rounded to float, widened into out.
// About twice dgemm's rate; a length-k product keeps about sqrt(k) x 6e-8 of its terms'
// magnitude, which the cancellation check bounds as in double precision.
void product(const Blas& blas, const float* left, std::size_t rows, const float* right,
             std::size_t m, std::size_t k, double* out, std::size_t ld) {
    thread_local std::vector<float> out_buffer;
    float* result = scratch(out_buffer, rows * m);
    const int mm = static_cast<int>(m), nn = static_cast<int>(rows), kk = static_cast<int>(k);
    const float alpha = 1.0f, beta = 0.0f;
    blas.single_gemm("T", "N", &mm, &nn, &kk, &alpha, right, &kk, left, &kk, &beta, result,
                     &mm);
    for (std::size_t i = 0; i < rows; ++i) {
        std::copy(result + i * m, result + (i + 1) * m, out + i * ld);
    }
}

void product(const Blas& blas, const double* left, std::size_t rows, const double* right,
             std::size_t m, std::size_t k, double* out, std::size_t ld) {
    product(blas, left, rows, right, m, k, 1.0, out, ld);
}

// The epilogue of a product row: row[j] = scale * row[j] + a * column[j] + c. Returns
// whether some entry fell below kCancellation * (c_bound + a_bound * column_bound[j]), its
// magnitude bound.
FUSEKIT_CLONES bool finish_row(double* __restrict row, std::size_t m, double scale, double a,
                               const double* __restrict column, double c, double c_bound,
                               double a_bound, const double* __restrict column_bound) {
    LaneFlag<double> cancelled = 0;
#pragma omp simd reduction(| : cancelled)
    for (std::size_t j = 0; j < m; ++j) {
        row[j] = scale * row[j] + a * column[j] + c;
        cancelled |= row[j] < kCancellation * (c_bound + a_bound * column_bound[j]);
    }
    return cancelled != 0;
}

double squared_norm(const double* x, std::size_t p) {
    double acc = 0.0;
#pragma omp simd reduction(+ : acc)
    for (std::size_t q = 0; q < p; ++q) acc += x[q] * x[q];
    return acc;
}

double squared_distance(const double* x, const double* y, std::size_t p) {
    double acc = 0.0;
#pragma omp simd reduction(+ : acc)
    for (std::size_t q = 0; q < p; ++q) acc += (x[q] - y[q]) * (x[q] - y[q]);
    return acc;
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

// Coordinates that enter the product, cut into runs of equal weight. Unobserved ones
// (s = 0) cost nothing. Consecutive observed coordinates q, q' share a run when s_q = s_q'
// and P_iq = P_iq' for every global i, so that each global weighs the whole run by one
// a_i = s P_i / (s + P_i) (PFNM's usual state: one precision per client and tensor). A
// run's term sum_q a_i (w_jq - m_iq)^2 = a_i |w_j|^2 - 2 a_i m_i.w_j + a_i |m_i|^2 then
// takes one product column per coordinate and one per run (a_i against |w_j|^2 over the
// run), where a weight per coordinate would take two per coordinate: the same sums, up to
// rounding, in about half the product.
struct Runs {
    std::vector<std::size_t> observed;  // the coordinates with s > 0, in order
    std::vector<std::size_t> start;     // run r: observed[start[r]] .. observed[start[r + 1] - 1]

    std::size_t count() const { return start.empty() ? 0 : start.size() - 1; }
    // Whether the observed coordinates are 0, 1, ..., n - 1, so that no loop gathers.
    bool contiguous() const { return observed.empty() || observed.back() + 1 == observed.size(); }
};

// brk[k] |= x[k] != x[k - 1] for k >= 1: where a run of equal values ends.
FUSEKIT_CLONES void mark_changes(const double* __restrict x, std::size_t n,
                                 unsigned char* __restrict brk) {
#pragma omp simd
    for (std::size_t k = 1; k < n; ++k) brk[k] |= x[k] != x[k - 1];
}

Runs find_runs(const PosteriorCostInput& in) {
    Runs runs;
    const std::size_t p = in.p;
    std::vector<double> values;
    for (std::size_t q = 0; q < p; ++q) {
        if (in.precision[q] > 0.0) {
            runs.observed.push_back(q);
            values.push_back(in.precision[q]);
        }
    }
    const std::size_t n = runs.observed.size();
    if (n == 0) return runs;
    std::vector<unsigned char> brk(n, 0);
    brk[0] = 1;
    mark_changes(values.data(), n, brk.data());
    const bool contiguous = runs.contiguous();
    for (std::size_t i = 0; i < in.n_global; ++i) {
        const double* row = in.precisions + i * p;
        if (!contiguous) {
            for (std::size_t k = 0; k < n; ++k) values[k] = row[runs.observed[k]];
            row = values.data();
        }
        mark_changes(row, n, brk.data());
    }
    for (std::size_t k = 0; k < n; ++k) {
        if (brk[k]) runs.start.push_back(k);
    }
    runs.start.push_back(n);
    return runs;
}

// The per-global-neuron terms outside the product.
struct GlobalTerms {
    std::vector<double> norm_weight;  // factor of the local neuron's |w_j|^2 (direct product)
    std::vector<double> row_term;     // sum_p a_ip m_ip^2
    std::vector<double> max_weight;   // max_p a_ip, for the cancellation bound
    std::vector<double> offset;       // 2 log((S - n_i) / n_i) + lam * KL constant
    std::vector<double> row_scale;    // factor of the product row (direct product)

    explicit GlobalTerms(std::size_t n)
        : norm_weight(n), row_term(n), max_weight(n), offset(n), row_scale(n, 1.0) {}

    void set_offset(const PosteriorCostInput& in, std::size_t i, double kl) {
        const double S = in.n_clients, n_i = in.counts[i];
        offset[i] = 2.0 * std::log((S - n_i) / n_i) + in.lam * kl;
    }
};

// Coordinate k of a list, or k itself when the list is 0, 1, 2, ... (the common case: all
// coordinates observed), so that the loops below need no gathers.
template <bool kContiguous>
inline std::size_t coordinate(const std::size_t* list, std::size_t k) {
    return kContiguous ? k : list[k];
}

// left[k] = scale * m_k with m_k = sums[coordinate k] * inv_precision; returns sum m_k^2.
template <bool kContiguous, class T>
FUSEKIT_CLONES double scaled_means(const double* __restrict sums, const std::size_t* list,
                                   std::size_t n, double scale, double inv_precision,
                                   T* __restrict left) {
    double mm = 0.0;
#pragma omp simd reduction(+ : mm)
    for (std::size_t k = 0; k < n; ++k) {
        const double m = sums[coordinate<kContiguous>(list, k)] * inv_precision;
        left[k] = static_cast<T>(scale * m);
        mm += m * m;
    }
    return mm;
}

// One run over every coordinate: the product reads the sums in place and its row is scaled
// by -2 a_i / P_i afterwards, a_i |w_j|^2 added in the epilogue.
void direct_row(const PosteriorCostInput& in, std::size_t i, GlobalTerms& t) {
    const double* sums = in.sums + i * in.p;
    const double s = in.precision[0], P = in.precisions[i * in.p];
    const double a = posterior_weight(s, P, in.lam), inv = 1.0 / P;
    t.norm_weight[i] = a;
    t.row_scale[i] = -2.0 * a * inv;
    t.row_term[i] = a * squared_norm(sums, in.p) * inv * inv;
    t.max_weight[i] = a;
    // Identical terms of the KL constant: one evaluation for all coordinates.
    t.set_offset(in, i, in.lam != 0.0 ? static_cast<double>(in.p) * kl_constant(s, P) : 0.0);
}

// Row i of the product's left operand, [-2 a_ir m_iq (each observed q, run r) | a_ir (each
// run)], and the terms outside the product.
template <bool kContiguous, class T>
void global_row(const PosteriorCostInput& in, const Runs& runs, std::size_t i, T* left,
                GlobalTerms& t) {
    const double* sums = in.sums + i * in.p;
    const double* prec = in.precisions + i * in.p;
    const std::size_t n = runs.observed.size(), nr = runs.count();
    double row_term = 0.0, max_weight = 0.0, kl = 0.0;
    for (std::size_t r = 0; r < nr; ++r) {
        const std::size_t first = runs.start[r], length = runs.start[r + 1] - first;
        const std::size_t q = runs.observed[first];
        const double s = in.precision[q], P = prec[q];
        const double a = posterior_weight(s, P, in.lam);
        const double mm = kContiguous
                              ? scaled_means<true>(sums + first, nullptr, length, -2.0 * a,
                                                   1.0 / P, left + first)
                              : scaled_means<false>(sums, runs.observed.data() + first, length,
                                                    -2.0 * a, 1.0 / P, left + first);
        left[n + r] = static_cast<T>(a);
        row_term += a * mm;
        max_weight = std::max(max_weight, a);
        if (in.lam != 0.0) kl += static_cast<double>(length) * kl_constant(s, P);
    }
    t.row_term[i] = row_term;
    t.max_weight[i] = max_weight;
    t.set_offset(in, i, kl);
}

// out[k] = w[coordinate k of list]; returns the sum of squares.
template <bool kContiguous, class T>
FUSEKIT_CLONES double gather(const double* __restrict w, const std::size_t* list, std::size_t n,
                             T* __restrict out) {
    double acc = 0.0;
#pragma omp simd reduction(+ : acc)
    for (std::size_t k = 0; k < n; ++k) {
        const double x = w[coordinate<kContiguous>(list, k)];
        out[k] = static_cast<T>(x);
        acc += x * x;
    }
    return acc;
}

// Row j of the product's right operand, [w_jq (each observed q) | |w_j|^2 over each run];
// returns |w_j|^2 over the observed coordinates.
template <bool kContiguous, class T>
double local_row(const double* w, const Runs& runs, T* right) {
    const std::size_t n = runs.observed.size(), nr = runs.count();
    double total = 0.0;
    for (std::size_t r = 0; r < nr; ++r) {
        const std::size_t first = runs.start[r], length = runs.start[r + 1] - first;
        const double norm =
            kContiguous ? gather<true>(w + first, nullptr, length, right + first)
                        : gather<false>(w, runs.observed.data() + first, length, right + first);
        right[n + r] = static_cast<T>(norm);
        total += norm;
    }
    return total;
}

// sum_q weight_q (w_q - mu0_q)^2.
FUSEKIT_CLONES double weighted_distance(const double* __restrict w, const double* __restrict mu0,
                                        const double* __restrict weight, std::size_t p) {
    double acc = 0.0;
#pragma omp simd reduction(+ : acc)
    for (std::size_t q = 0; q < p; ++q) {
        const double e = w[q] - mu0[q];
        acc += weight[q] * e * e;
    }
    return acc;
}

// The exact cost sum_p a_ip (w_jp - m_ip)^2 of one pair, for entries the expansion cancels.
double exact_posterior_entry(const PosteriorCostInput& in, std::size_t i, std::size_t j) {
    const double* w = in.local + j * in.p;
    const double* sums = in.sums + i * in.p;
    const double* prec = in.precisions + i * in.p;
    double acc = 0.0;
    for (std::size_t q = 0; q < in.p; ++q) {
        const double e = w[q] - sums[q] / prec[q];
        acc += posterior_weight(in.precision[q], prec[q], in.lam) * e * e;
    }
    return acc;
}

// Rows n_global.. of out: every slot k has the same per-neuron cost (distance to the
// prior) plus the slot's own penalty 2 log(k S / gamma0).
void new_neuron_rows(const PosteriorCostInput& in, double* out) {
    const std::size_t p = in.p, nl = in.n_local;
    std::vector<double> weight(p);
    double new_offset = 0.0;
    for (std::size_t q = 0; q < p; ++q) {
        const double P0 = 1.0 / in.sigma0_2[q];
        weight[q] = posterior_weight(in.precision[q], P0, in.lam);
        if (in.lam != 0.0) new_offset += in.lam * kl_constant(in.precision[q], P0);
    }
    std::vector<double> to_prior(nl);
    for (std::size_t j = 0; j < nl; ++j) {
        to_prior[j] = weighted_distance(in.local + j * p, in.mu0, weight.data(), p) + new_offset;
    }
    for (std::size_t k = 0; k < nl; ++k) {
        const double penalty =
            2.0 * std::log(static_cast<double>(k + 1) * in.n_clients / in.gamma0);
        double* row = out + (in.n_global + k) * nl;
        for (std::size_t j = 0; j < nl; ++j) row[j] = to_prior[j] + penalty;
    }
}

// Row i of out from its product row: the terms outside the product added, entries the
// expansion cancelled computed exactly, the row's offset added.
void finish_posterior_row(const PosteriorCostInput& in, const GlobalTerms& terms,
                          const std::vector<double>& norm, std::size_t i, double* row) {
    const std::size_t nl = in.n_local;
    const double row_term = terms.row_term[i], a_max = terms.max_weight[i];
    if (finish_row(row, nl, terms.row_scale[i], terms.norm_weight[i], norm.data(), row_term,
                   row_term, a_max, norm.data())) {
        for (std::size_t j = 0; j < nl; ++j) {
            if (row[j] < kCancellation * (row_term + a_max * norm[j])) {
                row[j] = exact_posterior_entry(in, i, j);
            }
        }
    }
    const double offset = terms.offset[i];
    for (std::size_t j = 0; j < nl; ++j) row[j] += offset;
}

// Rows < n_global of posterior_cost, with product operands of type T: double, or float
// where the product is large enough to gain (kSingleFlops). In double precision a direct
// product reads the inputs in place; otherwise the operands are built in T, the global side
// a tile of rows at a time.
template <class T>
void posterior_products(const Blas& blas, const PosteriorCostInput& in, const Runs& runs,
                        bool direct, double* out) {
    const std::size_t p = in.p, nl = in.n_local, ng = in.n_global;
    const std::size_t width = direct ? p : runs.observed.size() + runs.count();
    const bool contiguous = runs.contiguous();
    const bool in_place = direct && std::is_same_v<T, double>;

    // The per-local-neuron side: the right operand and |w_j|^2 over the observed coordinates.
    thread_local std::vector<T> right_buffer, left_buffer;
    T* built = in_place ? nullptr : scratch(right_buffer, nl * width);
    std::vector<double> norm(nl);
    for (std::size_t j = 0; j < nl; ++j) {
        const double* w = in.local + j * p;
        if (in_place) {
            norm[j] = squared_norm(w, p);
        } else if (direct) {
            norm[j] = gather<true>(w, nullptr, p, built + j * width);
        } else {
            norm[j] = contiguous ? local_row<true>(w, runs, built + j * width)
                                 : local_row<false>(w, runs, built + j * width);
        }
    }
    const T* right = built;
    if constexpr (std::is_same_v<T, double>) {
        if (in_place) right = in.local;
    }

    GlobalTerms terms(ng);
    // A float product's result is widened from a tile of its own: bounded like the operand.
    const std::size_t across = std::is_same_v<T, float> ? std::max(width, nl) : width;
    const std::size_t tile =
        in_place ? ng : std::max<std::size_t>(1, kTileElements / std::max<std::size_t>(across, 1));
    T* left = in_place ? nullptr : scratch(left_buffer, std::min(tile, ng) * width);
    for (std::size_t i0 = 0; i0 < ng; i0 += tile) {
        const std::size_t rows = std::min(tile, ng - i0);
        for (std::size_t r = 0; r < rows; ++r) {
            if (direct) {
                direct_row(in, i0 + r, terms);
                if (!in_place) gather<true>(in.sums + (i0 + r) * p, nullptr, p, left + r * p);
            } else if (contiguous) {
                global_row<true>(in, runs, i0 + r, left + r * width, terms);
            } else {
                global_row<false>(in, runs, i0 + r, left + r * width, terms);
            }
        }
        const T* tile_left = left;
        if constexpr (std::is_same_v<T, double>) {
            if (in_place) tile_left = in.sums + i0 * p;
        }
        product(blas, tile_left, rows, right, nl, width, out + i0 * nl, nl);
        for (std::size_t i = i0; i < i0 + rows; ++i) {
            finish_posterior_row(in, terms, norm, i, out + i * nl);
        }
    }
}

}  // namespace

FUSEKIT_CLONES double finite_min(const double* x, std::size_t n) {
    const double inf = std::numeric_limits<double>::infinity();
    double smallest = inf;
    LaneFlag<double> bad = 0;
#pragma omp simd reduction(min : smallest) reduction(| : bad)
    for (std::size_t k = 0; k < n; ++k) {
        smallest = x[k] < smallest ? x[k] : smallest;
        bad |= !(std::fabs(x[k]) < inf);
    }
    return bad ? std::numeric_limits<double>::quiet_NaN() : smallest;
}

FUSEKIT_CLONES void add_rows(double* target, std::size_t p, const std::int64_t* rows,
                             const double* values, std::size_t stride, const double* scale,
                             std::size_t n, double sign) {
    for (std::size_t k = 0; k < n; ++k) {
        double* __restrict row = target + static_cast<std::size_t>(rows[k]) * p;
        const double* __restrict v = values + k * stride;
        // sign is +1 or -1, so sign * x is exact: the result equals numpy's
        // target += x / target -= x, with x = v (or the rounded product v * scale).
        if (scale == nullptr) {
#pragma omp simd
            for (std::size_t q = 0; q < p; ++q) row[q] += sign * v[q];
        } else {
#pragma omp simd
            for (std::size_t q = 0; q < p; ++q) row[q] += sign * (v[q] * scale[q]);
        }
    }
}

FUSEKIT_CLONES void add_moments(double* sums, double* squares, double* counts, std::size_t p,
                                const std::int64_t* rows, const double* values,
                                const double* scale, const double* seen, std::size_t n) {
    for (std::size_t k = 0; k < n; ++k) {
        const std::size_t offset = static_cast<std::size_t>(rows[k]) * p;
        double* __restrict sum = sums + offset;
        double* __restrict square = squares + offset;
        double* __restrict count = counts + offset;
        const double* __restrict v = values + k * p;
        // The products rounded as numpy rounds them (x, then x * x; seen is 0 or 1), so the
        // moments equal those of scaled copies added with add_rows, bit for bit.
#pragma omp simd
        for (std::size_t q = 0; q < p; ++q) {
            const double x = v[q] * scale[q];
            const double xx = x * x;
            sum[q] += x * seen[q];
            square[q] += xx * seen[q];
            count[q] += seen[q];
        }
    }
}

// The end of the run of equal (P, noise) that starts at k: the first index after k where
// either differs from index k's, or n. Blocks of 8 compared in vector lanes.
FUSEKIT_CLONES std::size_t run_end(const double* __restrict P, const double* __restrict noise,
                                   std::size_t k, std::size_t n) {
    const double p0 = P[k], n0 = noise[k];
    constexpr std::size_t kBlock = 8;
    std::size_t j = k + 1;
    while (j + kBlock <= n) {
        LaneFlag<double> differ = 0;
#pragma omp simd reduction(| : differ)
        for (std::size_t b = 0; b < kBlock; ++b) differ |= (P[j + b] != p0) | (noise[j + b] != n0);
        if (differ) break;
        j += kBlock;
    }
    while (j < n && P[j] == p0 && noise[j] == n0) ++j;
    return j;
}

void log_det_rows(const double* s, const double* precisions, std::size_t n_global,
                  std::size_t p, double* out) {
    std::vector<std::size_t> seen;
    std::vector<double> noise;
    for (std::size_t q = 0; q < p; ++q) {
        if (s[q] > 0.0) {
            seen.push_back(q);
            noise.push_back(1.0 / s[q]);
        }
    }
    const std::size_t n = seen.size();
    std::vector<double> gathered(n == p ? 0 : n);
    for (std::size_t i = 0; i < n_global; ++i) {
        const double* row = precisions + i * p;
        if (n != p) {  // unobserved coordinates: the observed ones gathered side by side
            for (std::size_t k = 0; k < n; ++k) gathered[k] = row[seen[k]];
            row = gathered.data();
        }
        // With scalar variances a row holds a few runs of equal s and P: one logarithm
        // per run, times its length.
        double acc = 0.0;
        for (std::size_t k = 0; k < n;) {
            const std::size_t end = run_end(row, noise.data(), k, n);
            acc += static_cast<double>(end - k) * std::log(noise[k] + 1.0 / row[k]);
            k = end;
        }
        out[i] = acc;
    }
}

Status sqeuclidean_cost(const Blas& blas, const double* a, std::size_t n, const double* b,
                        std::size_t m, std::size_t p, double* out) {
    if (n == 0 || m == 0) return Status::ok;
    std::vector<double> norm_a(n), norm_b(m);
    for (std::size_t i = 0; i < n; ++i) norm_a[i] = squared_norm(a + i * p, p);
    for (std::size_t j = 0; j < m; ++j) norm_b[j] = squared_norm(b + j * p, p);
    product(blas, a, n, b, m, p, -2.0, out, m);
    for (std::size_t i = 0; i < n; ++i) {
        double* row = out + i * m;
        if (!finish_row(row, m, 1.0, 1.0, norm_b.data(), norm_a[i], norm_a[i], 1.0,
                        norm_b.data())) {
            continue;
        }
        for (std::size_t j = 0; j < m; ++j) {
            if (row[j] < kCancellation * (norm_a[i] + norm_b[j])) {
                row[j] = squared_distance(a + i * p, b + j * p, p);
            }
        }
    }
    return Status::ok;
}

Status posterior_cost(const Blas& blas, const PosteriorCostInput& in, double* out) {
    if (in.n_local == 0) return Status::ok;
    const Runs runs = find_runs(in);
    const std::size_t n = runs.observed.size();
    // One run over every coordinate (scalar variances, all observed): one product of the
    // inputs themselves.
    const bool direct = runs.count() == 1 && n == in.p;
    const std::size_t width = direct ? in.p : n + runs.count();
    const double flops = 2.0 * static_cast<double>(in.n_global) *
                         static_cast<double>(in.n_local) * static_cast<double>(width);
    if (blas.single_gemm != nullptr && flops >= kSingleFlops) {
        posterior_products<float>(blas, in, runs, direct, out);
    } else {
        posterior_products<double>(blas, in, runs, direct, out);
    }
    new_neuron_rows(in, out);
    return Status::ok;
}

}  // namespace fusekit
