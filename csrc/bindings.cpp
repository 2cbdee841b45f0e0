// The only file that knows Python: shape checks, contiguous copies, GIL release, and the
// mapping from Status to Python exceptions.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "cost.hpp"
#include "status.hpp"

namespace py = pybind11;
using fusekit::Status;

namespace {

using Array = py::array_t<double, py::array::c_style | py::array::forcecast>;

void raise_for(Status status, const std::string& what) {
    switch (status) {
        case Status::ok:
            return;
        case Status::invalid_shape:
            throw py::value_error(what + ": invalid shape");
        case Status::non_finite:
            throw py::value_error(what + ": expected finite values, found NaN or -inf");
        case Status::infeasible:
            throw py::value_error(what + ": no complete assignment avoids forbidden pairs");
    }
}

void require_2d(const Array& x, const char* name) {
    if (x.ndim() != 2) {
        throw py::value_error(std::string(name) + ": expected a 2-D array, got " +
                              std::to_string(x.ndim()) + "-D");
    }
}

Array sqeuclidean_cost(const Array& a, const Array& b, int n_threads) {
    require_2d(a, "a");
    require_2d(b, "b");
    if (a.shape(1) != b.shape(1)) {
        throw py::value_error("a and b: expected the same number of columns, got " +
                              std::to_string(a.shape(1)) + " and " + std::to_string(b.shape(1)));
    }
    const auto n = static_cast<std::size_t>(a.shape(0));
    const auto m = static_cast<std::size_t>(b.shape(0));
    const auto p = static_cast<std::size_t>(a.shape(1));
    Array out({n, m});
    Status status;
    {
        py::gil_scoped_release release;
        status = fusekit::sqeuclidean_cost(a.data(), n, b.data(), m, p, out.mutable_data(),
                                           n_threads);
    }
    raise_for(status, "sqeuclidean_cost");
    return out;
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
    m.def("sqeuclidean_cost", &sqeuclidean_cost, py::arg("a"), py::arg("b"),
          py::arg("n_threads") = 0,
          "Pairwise squared Euclidean distances between the rows of a (n, p) and b (m, p).");
    m.def("has_openmp", &has_openmp, "Whether the extension was built with OpenMP.");
}
