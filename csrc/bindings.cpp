// The only file that knows Python: shape checks, contiguous copies, GIL release, and the
// mapping from Status to Python exceptions.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cost.hpp"
#include "lap.hpp"
#include "status.hpp"

namespace py = pybind11;
using fusekit::Status;

namespace {

using Array = py::array_t<double, py::array::c_style | py::array::forcecast>;
using Index = py::array_t<std::int64_t, py::array::c_style>;

// Errors are fusekit's own classes (both are ValueError subclasses), so the front doors
// report bad input as bad input.
[[noreturn]] void raise_error(const char* cls_name, const std::string& message) {
    py::object cls = py::module_::import("fusekit.core.errors").attr(cls_name);
    PyErr_SetString(cls.ptr(), message.c_str());
    throw py::error_already_set();
}

[[noreturn]] void raise_parameter(const std::string& message) {
    raise_error("ParameterError", message);
}

[[noreturn]] void raise_infeasible(const std::string& message) {
    raise_error("InfeasibleAssignmentError", message);
}

void raise_for(Status status, const std::string& what) {
    switch (status) {
        case Status::ok:
            return;
        case Status::invalid_shape:
            raise_parameter(what + ": invalid shape");
        case Status::non_finite:
            raise_parameter(what + ": expected finite values or +inf, found NaN or -inf");
        case Status::infeasible:
            raise_infeasible(what +
                             ": no complete assignment avoids the forbidden (+inf) pairs");
    }
}

void require_2d(const py::array& x, const char* name) {
    if (x.ndim() != 2) {
        raise_parameter(std::string(name) + ": expected a 2-D array, got " +
                              std::to_string(x.ndim()) + "-D");
    }
}

void require_length(const Array& x, py::ssize_t n, const char* name) {
    if (x.ndim() != 1 || x.shape(0) != n) {
        raise_parameter(std::string(name) + ": expected a 1-D array of length " +
                              std::to_string(n));
    }
}

// SciPy's OpenBLAS dgemm and sgemm, looked up once through the capsules of
// scipy.linalg.cython_blas (the documented way to call SciPy's BLAS from compiled code), so
// the core links no BLAS.
// The thread-count controls come from the same library (found from dgemm's address), under
// SciPy's prefixed names or OpenBLAS's own; absent (another BLAS) they stay null.
const fusekit::Blas& blas() {
    static const fusekit::Blas instance = [] {
        py::object capi = py::module_::import("scipy.linalg.cython_blas").attr("__pyx_capi__");
        const auto lookup = [&capi](const char* name) {
            py::object capsule = capi[name];
            const char* capsule_name = PyCapsule_GetName(capsule.ptr());
            void* pointer = PyCapsule_GetPointer(capsule.ptr(), capsule_name);
            if (pointer == nullptr) throw py::error_already_set();
            return pointer;
        };
        void* pointer = lookup("dgemm");
        fusekit::Blas b;
        b.gemm = reinterpret_cast<fusekit::Dgemm>(pointer);
        b.single_gemm = reinterpret_cast<fusekit::Sgemm>(lookup("sgemm"));
        Dl_info info{};
        void* library = nullptr;
        if (dladdr(pointer, &info) != 0 && info.dli_fname != nullptr) {
            library = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
        }
        if (library != nullptr) {
            for (const char* prefix : {"scipy_openblas", "openblas"}) {
                const std::string p(prefix);
                void* get = dlsym(library, (p + "_get_num_threads").c_str());
                void* set = dlsym(library, (p + "_set_num_threads").c_str());
                if (get != nullptr && set != nullptr) {
                    b.get_threads = reinterpret_cast<int (*)()>(get);
                    b.set_threads = reinterpret_cast<void (*)(int)>(set);
                    break;
                }
            }
        }
        return b;
    }();
    return instance;
}

// Any float32 array, byte order aside (array_t<float> then makes it native): its dtype need
// not be numpy's own float32 object, which dtype::is asks (an array from a pickle, and its
// copies, hold another: they were solved in a float64 copy).
bool is_float32(const py::array& x) {
    return x.dtype().kind() == 'f' && x.dtype().itemsize() == 4;
}

// x as a C-contiguous array of T (a view, or a converted copy), refused before any buffer is
// read unless it is a numpy array of real numbers or booleans: object, string, bytes,
// complex, datetime and structured arrays raise ParameterTypeError (a TypeError).
template <class T>
py::array_t<T, py::array::c_style | py::array::forcecast> real_array(const py::object& x,
                                                                       const std::string& name) {
    if (!py::isinstance<py::array>(x)) {
        const std::string type = py::str(py::type::of(x).attr("__name__"));
        raise_error("ParameterTypeError", name + ": expected a numpy array, got " + type);
    }
    const auto array = py::reinterpret_borrow<py::array>(x);
    const char kind = array.dtype().kind();
    if (kind != 'f' && kind != 'i' && kind != 'u' && kind != 'b') {
        raise_error("ParameterTypeError", name + ": expected real numbers, got dtype " +
                                              std::string(py::str(array.dtype())));
    }
    auto converted = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(array);
    if (!converted) throw py::error_already_set();
    return converted;
}

Array real(const py::object& x, const std::string& name) { return real_array<double>(x, name); }

// SciPy's outputs (the assigned pairs, rows increasing: every row of a wide or square
// problem, a tall one's assigned rows only), and the potentials (None unless return_duals).
// Only the returned arrays are numpy arrays: each costs about 0.1 us to make, a tenth of a
// small problem's call.
template <class T>
py::tuple solve_typed(const py::array_t<T, py::array::c_style | py::array::forcecast>& cost,
                      bool return_duals, bool negated) {
    require_2d(cost, "cost");
    const auto nr = static_cast<std::size_t>(cost.shape(0));
    const auto nc = static_cast<std::size_t>(cost.shape(1));
    std::vector<std::int64_t> col_of_row(nr);
    py::object u = py::none(), v = py::none();
    double* u_out = nullptr;
    double* v_out = nullptr;
    if (return_duals) {
        Array u_array(static_cast<py::ssize_t>(nr)), v_array(static_cast<py::ssize_t>(nc));
        u_out = u_array.mutable_data();
        v_out = v_array.mutable_data();
        u = std::move(u_array);
        v = std::move(v_array);
    }
    Status status;
    {
        py::gil_scoped_release release;
        status = fusekit::solve_assignment<T>(cost.data(), nr, nc, col_of_row.data(), u_out, v_out);
    }
    // SciPy's messages (linear_sum_assignment), with what they mean here, in terms of the
    // caller's matrix (whose infinities swap sign when it was negated to maximise).
    const std::string forbidden = negated ? "-inf" : "+inf", invalid = negated ? "+inf" : "-inf";
    if (status == Status::non_finite) {
        raise_parameter("cost matrix contains invalid numeric entries (NaN or " + invalid + ")");
    }
    if (status == Status::infeasible) {
        raise_infeasible("cost matrix is infeasible: every complete assignment uses a "
                         "forbidden (" + forbidden + ") pair");
    }
    raise_for(status, "cost matrix");
    const std::size_t k = std::min(nr, nc);
    Index rows(static_cast<py::ssize_t>(k)), cols(static_cast<py::ssize_t>(k));
    std::int64_t* r = rows.mutable_data();
    std::int64_t* c = cols.mutable_data();
    for (std::size_t i = 0, t = 0; i < nr; ++i) {
        if (col_of_row[i] < 0) continue;
        r[t] = static_cast<std::int64_t>(i);
        c[t++] = col_of_row[i];
    }
    return py::make_tuple(rows, cols, u, v);
}

// Solved in float32 storage when given float32, else in float64.
py::tuple solve_assignment(const py::object& cost, bool return_duals, bool negated) {
    if (py::isinstance<py::array>(cost) && is_float32(py::reinterpret_borrow<py::array>(cost))) {
        return solve_typed<float>(real_array<float>(cost, "cost"), return_duals, negated);
    }
    return solve_typed<double>(real_array<double>(cost, "cost"), return_duals, negated);
}

Array sqeuclidean_cost(const py::object& a_in, const py::object& b_in) {
    const Array a = real(a_in, "a"), b = real(b_in, "b");
    require_2d(a, "a");
    require_2d(b, "b");
    if (a.shape(1) != b.shape(1)) {
        raise_parameter("a and b: expected the same number of columns, got " +
                              std::to_string(a.shape(1)) + " and " + std::to_string(b.shape(1)));
    }
    const auto n = static_cast<std::size_t>(a.shape(0));
    const auto m = static_cast<std::size_t>(b.shape(0));
    const auto p = static_cast<std::size_t>(a.shape(1));
    Array out({n, m});
    const fusekit::Blas& library = blas();
    Status status;
    {
        py::gil_scoped_release release;
        status = fusekit::sqeuclidean_cost(library, a.data(), n, b.data(), m, p, out.mutable_data());
    }
    raise_for(status, "sqeuclidean_cost");
    return out;
}

// Arguments arrive validated and broadcast by fusekit.matching; shapes are rechecked here
// because a wrong one would read out of bounds.
Array posterior_cost(const py::object& local_in, const py::object& precision_in,
                     const py::object& sums_in, const py::object& precisions_in,
                     const py::object& counts_in, const py::object& mu0_in,
                     const py::object& sigma0_2_in, double n_clients, double gamma0,
                     double lam) {
    const Array local = real(local_in, "local"), precision = real(precision_in, "client_precision"),
                sums = real(sums_in, "global_sums"),
                precisions = real(precisions_in, "global_precisions"),
                counts = real(counts_in, "global_counts"), mu0 = real(mu0_in, "mu0"),
                sigma0_2 = real(sigma0_2_in, "sigma0_2");
    require_2d(local, "local");
    require_2d(sums, "global_sums");
    require_2d(precisions, "global_precisions");
    const py::ssize_t nl = local.shape(0), p = local.shape(1), ng = sums.shape(0);
    if (sums.shape(1) != p || precisions.shape(0) != ng || precisions.shape(1) != p) {
        raise_parameter("global_sums / global_precisions: expected shape (J_global, " +
                              std::to_string(p) + ")");
    }
    require_length(precision, p, "client_precision");
    require_length(counts, ng, "global_counts");
    require_length(mu0, p, "mu0");
    require_length(sigma0_2, p, "sigma0_2");
    fusekit::PosteriorCostInput in{local.data(), precision.data(), sums.data(),
                                   precisions.data(), counts.data(), mu0.data(),
                                   sigma0_2.data(), static_cast<std::size_t>(nl),
                                   static_cast<std::size_t>(ng), static_cast<std::size_t>(p),
                                   n_clients, gamma0, lam};
    Array out({ng + nl, nl});
    const fusekit::Blas& library = blas();
    Status status;
    {
        py::gil_scoped_release release;
        status = fusekit::posterior_cost(library, in, out.mutable_data());
    }
    raise_for(status, "posterior_cost");
    return out;
}

// A writeable C-contiguous 2-D float64 array, written in place (a converted copy would
// silently drop the update).
void require_target(const py::array& target, const char* name) {
    if (!py::isinstance<py::array_t<double>>(target) || !(target.flags() & py::array::c_style) ||
        !target.writeable() || target.ndim() != 2) {
        raise_parameter(std::string(name) + ": expected a writeable C-contiguous 2-D float64 array");
    }
}

void require_rows(const Index& rows, py::ssize_t capacity) {
    if (rows.ndim() != 1) raise_parameter("rows: expected a 1-D array");
    const std::int64_t* r = rows.data();
    for (py::ssize_t k = 0; k < rows.size(); ++k) {
        if (r[k] < 0 || r[k] >= capacity) throw py::index_error("rows: index out of range");
    }
}

// target[rows[k]] += sign * values[k] (* scale) for every k, in place: one pass over the
// rows, where numpy's fancy-index += gathers, adds and scatters, and with scale the product
// values * scale is never stored. rows must be unique; values is (n, p), or (p,) for the
// same vector added to every row; scale is None or (p,).
void add_rows(py::array target, const Index& rows, const py::object& values_in, double sign,
              const py::object& scale_in) {
    const Array values = real(values_in, "values");
    require_target(target, "target");
    const py::ssize_t n = rows.size(), p = target.shape(1), capacity = target.shape(0);
    const bool one_vector = values.ndim() == 1 && values.shape(0) == p;
    if (rows.ndim() != 1 ||
        !(one_vector || (values.ndim() == 2 && values.shape(0) == n && values.shape(1) == p))) {
        raise_parameter("rows / values: expected shapes (n,) and (n, " +
                              std::to_string(p) + ") or (" + std::to_string(p) + ",)");
    }
    Array scale;
    const bool scaled = !scale_in.is_none();
    if (scaled) {
        scale = real(scale_in, "scale");
        require_length(scale, p, "scale");
    }
    if (sign != 1.0 && sign != -1.0) raise_parameter("sign: expected 1 or -1");
    require_rows(rows, capacity);
    const std::int64_t* r = rows.data();
    double* t = static_cast<double*>(target.mutable_data());
    const double* scale_data = scaled ? scale.data() : nullptr;
    py::gil_scoped_release release;
    fusekit::add_rows(t, static_cast<std::size_t>(p), r, values.data(),
                      one_vector ? 0 : static_cast<std::size_t>(p), scale_data,
                      static_cast<std::size_t>(n), sign);
}

// sums / squares / counts[rows[k]] += x * seen, (x * x) * seen, seen with x = values[k] * scale.
void add_moments(py::array sums, py::array squares, py::array counts, const Index& rows,
                 const py::object& values_in, const py::object& scale_in,
                 const py::object& seen_in) {
    require_target(sums, "sums");
    require_target(squares, "squares");
    require_target(counts, "counts");
    const py::ssize_t capacity = sums.shape(0), p = sums.shape(1);
    for (const py::array* t : {&squares, &counts}) {
        if (t->shape(0) != capacity || t->shape(1) != p) {
            raise_parameter("sums / squares / counts: expected the same shape");
        }
    }
    const Array values = real(values_in, "values"), scale = real(scale_in, "scale"),
                seen = real(seen_in, "seen");
    require_rows(rows, capacity);
    if (values.ndim() != 2 || values.shape(0) != rows.size() || values.shape(1) != p) {
        raise_parameter("values: expected shape (" + std::to_string(rows.size()) + ", " +
                        std::to_string(p) + ")");
    }
    require_length(scale, p, "scale");
    require_length(seen, p, "seen");
    double* s = static_cast<double*>(sums.mutable_data());
    double* q = static_cast<double*>(squares.mutable_data());
    double* c = static_cast<double*>(counts.mutable_data());
    py::gil_scoped_release release;
    fusekit::add_moments(s, q, c, static_cast<std::size_t>(p), rows.data(), values.data(),
                         scale.data(), seen.data(), static_cast<std::size_t>(rows.size()));
}

// Per global row, sum_q ln(1/s_q + 1/P_iq) over the coordinates with s_q > 0.
Array log_det_rows(const py::object& precision_in, const py::object& precisions_in) {
    const Array precision = real(precision_in, "client_precision"),
                precisions = real(precisions_in, "global_precisions");
    require_2d(precisions, "global_precisions");
    const py::ssize_t ng = precisions.shape(0), p = precisions.shape(1);
    require_length(precision, p, "client_precision");
    Array out(ng);
    double* o = out.mutable_data();
    py::gil_scoped_release release;
    fusekit::log_det_rows(precision.data(), precisions.data(), static_cast<std::size_t>(ng),
                          static_cast<std::size_t>(p), o);
    return out;
}

double finite_min(const py::object& x_in) {
    const Array x = real(x_in, "x");
    py::gil_scoped_release release;
    return fusekit::finite_min(x.data(), static_cast<std::size_t>(x.size()));
}

bool has_openmp() {
#ifdef FUSEKIT_OPENMP
    return true;
#else
    return false;
#endif
}

}  // namespace

PYBIND11_MODULE(_core, m) {
    m.doc() = "fusekit's C++ core: neuron cost matrices and assignment solvers";
    m.def("solve_assignment", &solve_assignment, py::arg("cost"), py::arg("return_duals") = false,
          py::arg("negated") = false,
          "Minimum-cost assignment of a real matrix (solved in float32 storage when float32, "
          "else float64); returns (rows, cols, u, v), rows increasing, u and v None unless "
          "return_duals. negated: the matrix is the negation of the caller's (maximising), "
          "whose infinities the errors name.");
    m.def("sqeuclidean_cost", &sqeuclidean_cost, py::arg("a"), py::arg("b"),
          "Pairwise squared Euclidean distances between the rows of a (n, p) and b (m, p).");
    m.def("posterior_cost", &posterior_cost, py::arg("local"), py::arg("client_precision"),
          py::arg("global_sums"), py::arg("global_precisions"), py::arg("global_counts"),
          py::arg("mu0"), py::arg("sigma0_2"), py::arg("n_clients"), py::arg("gamma0"),
          py::arg("lam"),
          "PFNM (lam = 0) / NAFI matching cost of one client against the global posterior.");
    m.def("add_rows", &add_rows, py::arg("target"), py::arg("rows"), py::arg("values"),
          py::arg("sign") = 1.0, py::arg("scale") = py::none(),
          "In place: target[rows[k]] += sign * values[k] (* scale) (rows unique), one pass.");
    m.def("add_moments", &add_moments, py::arg("sums"), py::arg("squares"), py::arg("counts"),
          py::arg("rows"), py::arg("values"), py::arg("scale"), py::arg("seen"),
          "In place, with x = values[k] * scale: sums[rows[k]] += x * seen, "
          "squares[rows[k]] += (x * x) * seen, counts[rows[k]] += seen (rows unique).");
    m.def("log_det_rows", &log_det_rows, py::arg("client_precision"),
          py::arg("global_precisions"),
          "Per global row i, sum over the coordinates q with s_q > 0 of "
          "ln(1/s_q + 1/P_iq).");
    m.def("finite_min", &finite_min, py::arg("x"),
          "Smallest value of a float64 array, NaN when some value is NaN or infinite.");
    m.def("has_openmp", &has_openmp, "Whether the extension was built with OpenMP.");
    m.attr("SINGLE_PRECISION_FLOPS") = fusekit::kSingleFlops;
}
