#include "rectangular.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "augment.hpp"
#include "lines.hpp"
#include "reduction.hpp"
#include "simd.hpp"

namespace fusekit {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Free objects kept per agent: more agents compete for more objects, and an exhausted list
// is refilled by a strided pass over the agent's column, while every place costs an offer or
// so per agent to build. Measured on PFNM-shaped problems: 6 for 50 agents (with 8, 550x50
// and 2050x50 took 1-9% longer; with 4, random vectors 550x50 refilled 7 lists and took 22%
// longer), 8 for 100 (with 6, random vectors 600x100 refilled 6 lists instead of 1 and took
// 8% longer, though other tops gained as much), 16 for 500 (with 8, tied integer costs refill
// 4x more and take 2-4x longer).
std::size_t list_length(std::size_t agents) {
    return agents >= 256 ? 16 : agents >= 64 ? 8 : 6;
}

// The first k in [from, n) with x[k] == value, n if none.
FUSEKIT_CLONES std::size_t first_equal(const std::int64_t* __restrict x, std::size_t from,
                                       std::size_t n, std::int64_t value) {
    return first_where<LaneFlag<std::int64_t>>(from, n,
                                               [=](std::size_t k) { return x[k] == value; });
}

// At most this many runs (each costs a vector pass per search).
constexpr std::size_t kMaxRuns = 4;
// Distances this many units in the last place of the costs' scale apart count as tied, so
// that a search ends at a free agent instead of walking through PFNM's slots, whose
// alternating paths all cost the same up to rounding (measured: 7.5 of them per search on
// 600x100 all new, each 1e-14 short of the free agent). Optimality and the dual certificate
// hold to that tolerance, far inside what sums of the costs resolve anyway.
constexpr double kTiedUlps = 64.0;

// The tall matrix seen as objects (its m rows) x agents (its n columns, n < m).
template <class T>
struct Layout {
    const T* cost;
    std::size_t n, m;
    double at(std::size_t a, std::size_t o) const { return static_cast<double>(cost[o * n + a]); }
    // Object o's costs to every agent: one row of the matrix.
    const T* object_line(std::size_t o) const { return cost + o * n; }
};

// Each agent's cheapest free objects (outside runs), sorted, and a gate: every free object
// outside runs and off the list costs at least the gate (+inf: none left). Tied objects are
// in the agent's own order, round the objects from a start of its own: in the objects'
// order for all, tied agents would all list the same first objects and then compete for
// them, running their lists dry (tied integer 2500x500: a refill per agent, 3x slower).
class Lists {
   public:
    Lists(std::size_t agents, std::size_t objects)
        : length_(list_length(agents)), objects_(objects), cost_(agents * length_),
          rank_(agents * length_), count_(agents, 0), next_(agents, 0), gate_(agents, kInf),
          start_(agents), refilled_(agents, 0) {
        for (std::size_t a = 0; a < agents; ++a) start_[a] = a * objects / agents;
    }

    std::size_t length() const { return length_; }

    double* gates() { return gate_.data(); }

    // Whether object o at cost c may enter agent a's list (it then improves the list or
    // fills a free place).
    bool admits(std::size_t a, double c, std::size_t o) const {
        if (c < gate_[a]) return true;
        if (!(c <= gate_[a] && c < kInf)) return false;
        return count_[a] < length_ || rank(a, o) < rank_[(a + 1) * length_ - 1];
    }

    void offer(std::size_t a, double c, std::size_t o) {
        double* cs = cost_.data() + a * length_;
        std::size_t* rs = rank_.data() + a * length_;
        const std::size_t r = rank(a, o);
        std::size_t n = count_[a];
        std::size_t pos = n < length_ ? n : length_ - 1;  // a full list drops its last
        while (pos > 0 && (cs[pos - 1] > c || (cs[pos - 1] == c && rs[pos - 1] > r))) {
            cs[pos] = cs[pos - 1];
            rs[pos] = rs[pos - 1];
            --pos;
        }
        cs[pos] = c;
        rs[pos] = r;
        if (n < length_) count_[a] = ++n;
        if (n == length_) gate_[a] = cs[length_ - 1];
    }

    void clear(std::size_t a) {
        count_[a] = 0;
        next_[a] = 0;
        gate_[a] = kInf;
        refilled_[a] = 1;
    }

    // Whether agent a's list is still the one built over every object outside runs (a
    // refilled one lists the free objects only): every object off it costs at least the gate.
    bool complete(std::size_t a) const { return refilled_[a] == 0; }

    double gate(std::size_t a) const { return gate_[a]; }

    // f(cost, object) for each object agent a lists, taken or not.
    template <class F>
    void each(std::size_t a, F f) const {
        for (std::size_t t = 0; t < count_[a]; ++t) f(cost_[a * length_ + t], object(a, t));
    }

    // Skips listed objects for which `taken` holds; false when the list is used up.
    template <class Taken>
    bool first_free(std::size_t a, Taken taken, double& c, std::int64_t& o) {
        std::size_t t = next_[a];
        while (t < count_[a] && taken(object(a, t))) ++t;
        next_[a] = t;
        if (t == count_[a]) return false;
        c = cost_[a * length_ + t];
        o = object(a, t);
        return true;
    }

    bool exhausted_for_good(std::size_t a) const { return !(gate_[a] < kInf); }

    // A listed object of agent a that costs exactly c and is not taken, -1 if none.
    template <class Taken>
    std::int64_t free_at(std::size_t a, double c, Taken taken) const {
        for (std::size_t t = next_[a]; t < count_[a] && cost_[a * length_ + t] <= c; ++t) {
            if (cost_[a * length_ + t] == c && !taken(object(a, t))) return object(a, t);
        }
        return -1;
    }

    // The cost of the free listed object after the first (which first_free just returned),
    // or the gate (a bound on it, object -1) when the list holds no other.
    template <class Taken>
    double second_free(std::size_t a, Taken taken, std::int64_t& o) const {
        for (std::size_t t = next_[a] + 1; t < count_[a]; ++t) {
            o = object(a, t);
            if (!taken(o)) return cost_[a * length_ + t];
        }
        o = -1;
        return gate_[a];
    }

   private:
    std::size_t rank(std::size_t a, std::size_t o) const {
        return o >= start_[a] ? o - start_[a] : o + objects_ - start_[a];
    }
    // The object at place t of agent a's list.
    std::int64_t object(std::size_t a, std::size_t t) const {
        const std::size_t o = rank_[a * length_ + t] + start_[a];
        return static_cast<std::int64_t>(o < objects_ ? o : o - objects_);
    }

    std::size_t length_, objects_;
    std::vector<double> cost_;
    std::vector<std::size_t> rank_;
    std::vector<std::size_t> count_, next_;
    std::vector<double> gate_;
    std::vector<std::size_t> start_;
    std::vector<unsigned char> refilled_;
};

// Offers object o's entries row[j] to their agents' lists, j = j0 + (the place of each set
// bit of `bits`) / bits_per_entry.
template <class T>
inline void offer_hits(const T* row, std::size_t j0, std::uint64_t bits,
                       std::size_t bits_per_entry, std::size_t o, Lists& lists) {
    for (; bits != 0; bits &= bits - 1) {
        const std::size_t j =
            j0 + static_cast<std::size_t>(__builtin_ctzll(bits)) / bits_per_entry;
        const double c = static_cast<double>(row[j]);
        if (lists.admits(j, c, o)) lists.offer(j, c, o);
    }
}

// Offers the entries of rows first..first+count (object indices from o0) that are at or
// below their agent's gate (tall matrices: one object's costs to every agent per row), and
// checks the values: false if they hold NaN or -inf. Each row is compared at full width into
// hit (n + 8 bytes of scratch), read eight at a time; one call per range of rows, so the
// compares are not a call per row.
template <class T>
FUSEKIT_CLONES bool offer_rows(const T* __restrict first, std::size_t count, std::size_t o0,
                               std::size_t n, Lists& lists, unsigned char* __restrict hit) {
    const double* gate = lists.gates();
    LaneFlag<double> invalid = 0;
    for (std::size_t t = 0; t < count; ++t) {
        const T* row = first + t * n;
        const std::size_t o = o0 + t;
#pragma omp simd reduction(| : invalid)
        for (std::size_t j = 0; j < n; ++j) {
            const double c = static_cast<double>(row[j]);
            hit[j] = c <= gate[j];
            invalid |= !(c > -kInf);  // NaN and -inf fail the compare
        }
        for (std::size_t j0 = 0; j0 < n; j0 += 8) {
            std::uint64_t bits;
            std::memcpy(&bits, hit + j0, 8);
            if (j0 + 8 > n) bits &= (std::uint64_t{1} << (8 * (n - j0))) - 1;
            offer_hits(row, j0, bits, 8, o, lists);
        }
    }
    return invalid == 0;
}

#ifdef FUSEKIT_AVX512_KERNELS
// offer_rows in AVX-512: each row's compares go straight into bit masks, 64 entries to a
// word, where the byte flags above cost a store and a reload per eight entries (measured:
// offer_rows took 40% of a 550x50 solve). The values are checked through their sum, which a
// NaN or a -inf makes NaN or -inf for good, and only then entry by entry (a +inf beside
// them, or finite costs whose sum overflows to -inf): a compare per eight entries cost a
// tenth of a 600x100 solve, its masks contending with the gates' compares for one port.
template <class T>
__attribute__((target("avx512f"))) bool offer_rows_avx512(const T* __restrict first,
                                                           std::size_t count, std::size_t o0,
                                                           std::size_t n, Lists& lists) {
    const double* gate = lists.gates();
    __m512d sum[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()};  // two: the adds' latency
    for (std::size_t t = 0; t < count; ++t) {
        const T* row = first + t * n;
        const std::size_t o = o0 + t;
        for (std::size_t j0 = 0; j0 < n; j0 += 64) {
            const std::size_t width = std::min<std::size_t>(64, n - j0);
            std::uint64_t bits = 0;
            for (std::size_t l = 0; l < width; l += 8) {
                const __mmask8 lanes = first_lanes(width - l);
                const __m512d c = load8_avx512(row + j0 + l, lanes);
                const __mmask8 hit = _mm512_mask_cmp_pd_mask(
                    lanes, c, _mm512_maskz_loadu_pd(lanes, gate + j0 + l), _CMP_LE_OQ);
                sum[l / 8 % 2] = _mm512_add_pd(sum[l / 8 % 2], c);
                bits |= static_cast<std::uint64_t>(hit) << l;
            }
            offer_hits(row, j0, bits, 1, o, lists);
        }
    }
    const __m512d total = _mm512_add_pd(sum[0], sum[1]);
    if (_mm512_cmp_pd_mask(total, _mm512_set1_pd(-kInf), _CMP_GT_OQ) == 0xFF) return true;
    bool has_inf = false;
    return valid_costs(first, count * n, has_inf);
}
#endif

// offer_rows on the widest kernel the CPU runs.
template <class T>
bool offer_rows_any(const T* first, std::size_t count, std::size_t o0, std::size_t n,
                    Lists& lists, std::vector<unsigned char>& hit) {
#ifdef FUSEKIT_AVX512_KERNELS
    if (kHasAvx512) return offer_rows_avx512(first, count, o0, n, lists);
#endif
    if (hit.size() < n + 8) hit.assign(n + 8, 0);
    return offer_rows(first, count, o0, n, lists, hit.data());
}

}  // namespace

std::vector<Run> rising_runs(const std::vector<unsigned char>& rising) {
    std::vector<Run> found;
    const std::size_t n = rising.size();
    // Whether no three flags in a row start among the six from o (a run needs three): the
    // flags are mostly clear or scattered (realistic PFNM 50x550: 161 set after 8 rows).
    const auto no_run_in_six = [&](std::size_t o) {
        std::uint64_t eight;
        std::memcpy(&eight, rising.data() + o, sizeof eight);
        return (eight & eight >> 8 & eight >> 16) == 0;
    };
    static_assert(kMinRun == 4, "three flags in a row make a run");
    for (std::size_t o = 1; o < n; ++o) {
        while (o + 8 <= n && no_run_in_six(o)) o += 6;
        if (o >= n || !rising[o]) continue;
        std::size_t end = o;
        while (end + 1 < n && rising[end + 1]) ++end;
        if (end - o + 2 >= kMinRun) found.push_back({o - 1, end});
        o = end;
    }
    return found;
}

template <class T>
std::vector<Run> dominated_runs(const T* cost, std::size_t nr, std::size_t nc) {
    // Whether row o dominates row o - 1.
    const auto rises = [=](std::size_t o) {
        return dominates(cost + (o - 1) * nc, cost + o * nc, nc);
    };
    // A run's kMinRun - 1 steps (row o over row o - 1) in a row include a multiple of
    // kMinRun - 1: only those steps are tested, and a run is grown both ways from one that
    // rises (a third of the compares of testing every step: 1 us of a 550x50 solve).
    constexpr std::size_t kStride = kMinRun - 1;
    std::vector<Run> found;
    for (std::size_t o = kStride; o < nr; o += kStride) {
        if (!rises(o)) continue;
        std::size_t head = o - 1, end = o;
        while (head > 0 && rises(head)) --head;
        while (end + 1 < nr && rises(end + 1)) ++end;
        if (end - head + 1 >= kMinRun) found.push_back({head, end});
        // Step end + 1 falls: the loop's next step is the first multiple past it.
        o = (end + 1) / kStride * kStride;
    }
    std::stable_sort(found.begin(), found.end(), [](const Run& p, const Run& q) {
        return p.end - p.head > q.end - q.head;
    });
    if (found.size() > kMaxRuns) found.resize(kMaxRuns);
    return found;
}

namespace {

template <class T>
class ShortSideSolver {
   public:
    ShortSideSolver(Layout<T> layout, std::vector<Run> runs)
        : lay_(layout), n_(layout.n), m_(layout.m), runs_(std::move(runs)),
          run_of_(layout.m, 0), shifted_(layout.m, -1), lists_(layout.n, layout.m),
          head_cost_(layout.n, kInf), head_object_(layout.n, -1), u_(layout.n, 0.0),
          v_(layout.m, 0.0), x_(layout.n, -1), y_(layout.m, -1), search_(layout.n) {}

    Status solve() {
        mark_runs();
        if (!runs_valid() || !list_rows()) return Status::non_finite;
        for (std::size_t a = 0; a < n_; ++a) settle(a);
        if (!column_reduction()) return Status::infeasible;
        std::vector<std::size_t> free_agents;
        for (std::size_t a = 0; a < n_; ++a) {
            if (x_[a] < 0) free_agents.push_back(a);
        }
        row_reduction(free_agents);
        for (std::size_t a = 0; a < n_; ++a) fresh_head(a);
        searching_ = true;
        search_.set_ends(x_.data(), n_);
        // Each search ends at the free agent nearest to the free objects, whichever it is.
        for (std::size_t k = 0; k < free_agents.size(); ++k) {
            if (!augment()) return Status::infeasible;
        }
        return Status::ok;
    }

    // The column of each row (-1: unassigned) and the potentials of rows (u, objects) and
    // columns (v, agents).
    void write(std::int64_t* col_of_row, double* u, double* v) const {
        for (std::size_t a = 0; a < n_; ++a) {
            col_of_row[static_cast<std::size_t>(x_[a])] = static_cast<std::int64_t>(a);
            if (v) v[a] = u_[a] + phi_;
        }
        if (u) {
            for (std::size_t o = 0; o < m_; ++o) u[o] = y_[o] >= 0 ? v_[o] - phi_ : 0.0;
        }
    }

   private:
    bool taken(std::int64_t o) const { return y_[static_cast<std::size_t>(o)] >= 0; }

    // The runs enter the searches through their first free member only.
    void mark_runs() {
        for (std::size_t r = 0; r < runs_.size(); ++r) {
            run_first_.push_back(runs_[r].head);
            for (std::size_t o = runs_[r].head; o <= runs_[r].end; ++o) run_of_[o] = r + 1;
        }
    }

    // The runs' rows hold valid costs only (no NaN, no -inf); list_rows checks the others.
    // A run holds no NaN (dominates), and a -inf in one of its rows is one in every row
    // before it: its first row tells.
    bool runs_valid() const {
        bool has_inf = false;
        for (const Run& r : runs_) {
            if (!valid_costs(lay_.object_line(r.head), n_, has_inf)) return false;
        }
        return true;
    }

    // Tall: each agent (column) lists its cheapest rows outside runs, in two row-major
    // passes: the first bounds each column's k-th smallest from a sample of the rows, the
    // second offers only entries below that bound and checks the values. False on NaN or
    // -inf.
    bool list_rows() {
        // Rows outside runs, as ranges [begin, end): the runs are a few blocks of rows.
        std::vector<std::pair<std::size_t, std::size_t>> ranges;
        for (std::size_t o = 0; o < m_;) {
            std::size_t end = o;
            while (end < m_ && run_of_[end] == 0) ++end;
            if (end > o) ranges.emplace_back(o, end);
            o = end + 1;
        }
        std::size_t rows = 0;
        for (const auto& [begin, end] : ranges) rows += end - begin;
        if (rows == 0) return true;
        // The k-th smallest of a column's minima over 2k blocks of rows bounds its k-th
        // smallest entry (k block minima are k distinct entries) and stays close to it. Any
        // rows may form the blocks: every step-th row does, as long as each block still
        // gets kSampledPerBlock of them, so a looser bound does not cost more offers than
        // the skipped rows save (2000x50: 20-25% faster; 8 rows a block made 600x100 slower).
        // Short lists (fewer than 256 columns) take every second row at most: their rows'
        // offers are few, and reading every row of 550x50 cost more than the looser bound's
        // offers (550x50 5-10% faster, 600x100 2-7%; with 500 columns, 2500x500 4% slower).
        constexpr std::size_t kSampledPerBlock = 32;
        const std::size_t k = lists_.length();
        const std::size_t blocks = std::min(rows, 2 * k);
        const std::size_t fewest_step = k < 16 ? 2 : 1;
        const std::size_t step =
            std::max<std::size_t>(fewest_step, rows / (blocks * kSampledPerBlock));
        std::vector<double> block_min(blocks * n_, kInf);
        std::size_t seen = 0;
        for (const auto& [begin, end] : ranges) {
            const std::size_t count = (end - begin + step - 1) / step;
            block_minima(lay_.object_line(begin), count, step, n_, seen, block_min.data(), blocks);
            seen += count;
        }
        if (blocks > k) kth_smallest_columns(block_min.data(), blocks, n_, k, lists_.gates());
        std::vector<unsigned char> hit;
        bool valid = true;
        for (const auto& [begin, end] : ranges) {
            valid &= offer_rows_any(lay_.object_line(begin), end - begin, begin, n_, lists_, hit);
        }
        return valid;
    }

    // Agent a's whole line, free objects outside runs: the list anew.
    void refill(std::size_t a) {
        lists_.clear(a);
        for (std::size_t o = 0; o < m_; ++o) {
            if (run_of_[o] != 0 || y_[o] >= 0) continue;
            const double c = lay_.at(a, o);
            if (lists_.admits(a, c, o)) lists_.offer(a, c, o);
        }
    }

    // head_cost_ / head_object_: agent a's cheapest free object outside runs.
    void settle(std::size_t a) {
        const auto is_taken = [this](std::int64_t o) { return taken(o); };
        double c;
        std::int64_t o;
        if (!lists_.first_free(a, is_taken, c, o)) {
            if (lists_.exhausted_for_good(a)) {
                head_cost_[a] = kInf;
                head_object_[a] = -1;
                return;
            }
            refill(a);
            if (!lists_.first_free(a, is_taken, c, o)) {
                head_cost_[a] = kInf;
                head_object_[a] = -1;
                return;
            }
        }
        head_cost_[a] = c;
        head_object_[a] = o;
    }

    // Object o was free and is now matched: later searches no longer start from it.
    void matched(std::size_t o, std::size_t agent) {
        y_[o] = static_cast<std::int64_t>(agent);
        v_[o] = phi_;
        matched_objects_.push_back(o);
        if (run_of_[o] != 0) {
            ++runs_[run_of_[o] - 1].head;  // o was the run's first free member
            return;
        }
        // Before the searches, agents whose head was o are settled when their head is next
        // asked for (fresh_head): looking for them cost a pass over the agents per object
        // the reductions match. A search matches one.
        if (!searching_) return;
        const auto object = static_cast<std::int64_t>(o);
        for (std::size_t a = first_equal(head_object_.data(), 0, n_, object); a < n_;
             a = first_equal(head_object_.data(), a + 1, n_, object)) {
            settle(a);
        }
    }

    // Agent a's head, settled again if its object has been taken since.
    void fresh_head(std::size_t a) {
        if (head_object_[a] >= 0 && taken(head_object_[a])) settle(a);
    }

    // best[a] / from[a]: agent a's cheapest free object, through its list or a run.
    void cheapest_free(double* best, std::int64_t* from) const {
        std::copy(head_cost_.begin(), head_cost_.end(), best);
        std::copy(head_object_.begin(), head_object_.end(), from);
        for (const Run& r : runs_) {
            if (r.head > r.end) continue;
            argmin_into(lay_.object_line(r.head), static_cast<std::int64_t>(r.head), best,
                        from, n_);
        }
    }

    // Each agent's potential is its cheapest cost; agents whose cheapest object, or a listed
    // one as cheap, no earlier agent took are matched to it (tight, and free objects keep
    // potential 0).
    bool column_reduction() {
        std::vector<double> best(n_);
        std::vector<std::int64_t> from(n_);
        cheapest_free(best.data(), from.data());
        std::vector<std::size_t> claimed;
        for (std::size_t a = 0; a < n_; ++a) {
            if (!(best[a] < kInf)) return false;  // no allowed pair at all
            u_[a] = best[a];
            scale_ = std::max(scale_, std::abs(best[a]));
            auto o = static_cast<std::size_t>(from[a]);
            if (y_[o] >= 0) {
                // Tied costs: agents spread over the objects as cheap.
                const std::int64_t other =
                    lists_.free_at(a, best[a], [this](std::int64_t q) { return taken(q); });
                if (other < 0) continue;
                o = static_cast<std::size_t>(other);
            }
            x_[a] = static_cast<std::int64_t>(o);
            y_[o] = static_cast<std::int64_t>(a);
            claimed.push_back(o);
        }
        for (std::size_t o : claimed) matched(o, static_cast<std::size_t>(y_[o]));
        return true;
    }

    // Agent a's two cheapest objects by reduced cost c - v (at: the object, -1 for a bound):
    // over the matched objects, its list (the second free entry or the gate) and the runs
    // (their second member as a bound). Before the searches (the only time this is asked),
    // free objects sit at potential 0 and matched ones only drop below it, so an object off
    // a complete list costs at least the gate reduced too: its entries, matched or free, the
    // gate and the runs' matched members decide, without reading every matched object's
    // line (scattered loads, 200,000 of them on random 2500x500).
    TwoCheapest two_cheapest(std::size_t a) {
        TwoCheapest best;
        if (!searching_ && lists_.complete(a)) {
            lists_.each(a, [&](double c, std::int64_t o) {
                best.offer(c - (taken(o) ? v_[static_cast<std::size_t>(o)] : phi_), o);
            });
            best.offer(lists_.gate(a) - phi_, -1);
            for (std::size_t r = 0; r < runs_.size(); ++r) {
                for (std::size_t o = run_first_[r]; o < runs_[r].head; ++o) {
                    best.offer(lay_.at(a, o) - v_[o], static_cast<std::int64_t>(o));
                }
            }
            add_run_heads(a, best);
            if (best.at_first >= 0 || !(best.first < kInf)) return best;
            best = TwoCheapest{};  // the cheapest is off the list: look at every object
        }
        for (std::size_t o : matched_objects_) {
            best.offer(lay_.at(a, o) - v_[o], static_cast<std::int64_t>(o));
        }
        fresh_head(a);
        if (head_object_[a] >= 0) {
            best.offer(head_cost_[a] - phi_, head_object_[a]);
            std::int64_t o;
            const double c = lists_.second_free(a, [this](std::int64_t q) { return taken(q); }, o);
            best.offer(c - phi_, o);
        }
        add_run_heads(a, best);
        return best;
    }

    // Each run's first free member to agent a, and its second as a bound.
    void add_run_heads(std::size_t a, TwoCheapest& best) const {
        for (const Run& r : runs_) {
            if (r.head > r.end) continue;
            best.offer(lay_.at(a, r.head) - phi_, static_cast<std::int64_t>(r.head));
            if (r.head < r.end) best.offer(lay_.at(a, r.head + 1) - phi_, -1);
        }
    }

    // Jonker-Volgenant's augmenting row reduction, in passes over the free agents: each
    // takes its cheapest object, whose potential drops so that the agent is tight there at
    // its second cheapest; a displaced agent waits for the next pass. Potentials only drop
    // and the free objects keep theirs, so the rectangular conditions hold throughout.
    // Passes go on while each frees a sixteenth of the agents still free (JV's two passes
    // left 82 of 500 agents to augment on random 2500x500 problems, ten passes 4), and stop
    // at the first after the second that does not (PFNM's own problems: after two).
    void row_reduction(std::vector<std::size_t>& free_agents) {
        for (int pass = 0; pass < kMaxReductionPasses; ++pass) {
            const std::size_t before = free_agents.size();
            std::size_t kept = 0;
            for (std::size_t k = 0; k < free_agents.size(); ++k) {
                const std::size_t a = free_agents[k];
                const TwoCheapest best = two_cheapest(a);
                if (!(best.first < kInf)) {
                    free_agents[kept++] = a;
                    continue;
                }
                std::int64_t o = best.at_first;
                double ua = best.first;
                if (best.first < best.second) {
                    if (best.second < kInf) ua = best.second;
                } else if (y_[static_cast<std::size_t>(o)] >= 0 && best.at_second >= 0) {
                    o = best.at_second;  // a tie: take the other one, free if possible
                }
                const auto obj = static_cast<std::size_t>(o);
                const std::int64_t holder = y_[obj];
                x_[a] = o;
                u_[a] = ua;
                if (holder >= 0) {
                    y_[obj] = static_cast<std::int64_t>(a);
                    x_[static_cast<std::size_t>(holder)] = -1;
                    free_agents[kept++] = static_cast<std::size_t>(holder);
                } else {
                    matched(obj, a);
                }
                v_[obj] = lay_.at(a, obj) - ua;
            }
            free_agents.resize(kept);
            if (reduction_stalled(pass, before, kept, 16)) return;
        }
    }

    // Whether an agent reached at its cost to a run's head, from, and matched to object o
    // of the same run, has nothing to relax: when both lines are the run's first line plus a
    // constant (PFNM's slots: a cost per agent plus a penalty per slot), taking o costs every
    // agent exactly what taking the head directly does, which its distance already allows
    // for. (Tied integer costs walked 34 such steps a search on 600x500.)
    bool slot_to_slot(std::int64_t from, std::size_t o) {
        const std::size_t r = run_of_[o];
        return r != 0 && from == static_cast<std::int64_t>(runs_[r - 1].head) &&
               shifted(o) && shifted(static_cast<std::size_t>(from));
    }

    // Whether object o (in a run) is its run's first line plus a constant, checked once.
    bool shifted(std::size_t o) {
        if (shifted_[o] < 0) {
            const std::size_t first = run_first_[run_of_[o] - 1];
            shifted_[o] = shifted_line(lay_.object_line(first), lay_.object_line(o), n_) ? 1 : 0;
        }
        return shifted_[o] == 1;
    }

    // One shortest augmenting path, from all free objects at once (their common potential
    // phi_) to the nearest free agent, over agents only (see rectangular.hpp).
    bool augment() {
        AugmentSearch& s = search_;
        const double tolerance =
            kTiedUlps * std::numeric_limits<double>::epsilon() * std::max(scale_, std::abs(phi_));
        cheapest_free(s.d.data(), s.pred.data());
        double best_free;
        double best = s.start(phi_, u_.data(), n_, best_free);
        std::size_t sink;
        for (;;) {
            if (!(best < kInf)) return false;
            // A free agent within rounding of the nearest agent ends the search.
            const bool ends = best_free <= best + tolerance;
            std::size_t a = s.pick(ends ? best_free : best, ends, n_);
            // Agents that only swap slots relax nothing; the others tied with them are closed
            // in the same pass, up to the first that relaxes or ends the search.
            while (a < n_ && x_[a] >= 0 &&
                   slot_to_slot(s.pred[a], static_cast<std::size_t>(x_[a]))) {
                a = s.pick_tied_after(best, a + 1, n_);
            }
            if (a == n_) {
                best = s.smallest_open(n_, best_free);
                continue;
            }
            if (x_[a] < 0) {
                sink = a;
                best = s.d[a];
                break;
            }
            const auto o = static_cast<std::size_t>(x_[a]);
            best = s.relax(lay_.object_line(o), v_[o] - s.d[a], x_[a], u_.data(), n_, best_free);
        }
        const double delta = best;
        for (std::size_t a : s.finished) {
            u_[a] += s.d[a] - delta;
            if (x_[a] >= 0) v_[static_cast<std::size_t>(x_[a])] += delta - s.d[a];
        }
        phi_ += delta;
        for (std::size_t a = sink;;) {
            const auto o = static_cast<std::size_t>(s.pred[a]);
            const std::int64_t holder = y_[o];
            x_[a] = static_cast<std::int64_t>(o);
            if (holder < 0) {
                matched(o, a);
                break;
            }
            y_[o] = static_cast<std::int64_t>(a);
            a = static_cast<std::size_t>(holder);
        }
        return true;
    }

    Layout<T> lay_;
    std::size_t n_, m_;
    std::vector<Run> runs_;
    std::vector<std::size_t> run_of_;  // 1 + run index, 0 outside runs
    std::vector<std::size_t> run_first_;  // each run's first member
    std::vector<signed char> shifted_;    // shifted(o): -1 not checked yet, 0 no, 1 yes
    Lists lists_;
    std::vector<double> head_cost_;
    std::vector<std::int64_t> head_object_;
    std::vector<double> u_, v_;  // agents; objects (v_ meaningful once matched)
    double phi_ = 0.0;           // the potential every free object shares
    bool searching_ = false;     // augmenting: heads are settled as their objects are taken
    double scale_ = 0.0;         // the largest |cost| that is an agent's cheapest
    std::vector<std::int64_t> x_, y_;
    std::vector<std::size_t> matched_objects_;  // in the order they were first matched
    AugmentSearch search_;
};

}  // namespace

template <class T>
Status solve_tall(const T* cost, std::size_t nr, std::size_t nc, std::vector<Run> runs,
                  std::int64_t* col_of_row, double* u, double* v) {
    ShortSideSolver<T> solver(Layout<T>{cost, nc, nr}, std::move(runs));
    const Status s = solver.solve();
    if (s == Status::ok) solver.write(col_of_row, u, v);
    return s;
}

template std::vector<Run> dominated_runs<float>(const float*, std::size_t, std::size_t);
template std::vector<Run> dominated_runs<double>(const double*, std::size_t, std::size_t);
template Status solve_tall<float>(const float*, std::size_t, std::size_t, std::vector<Run>,
                                  std::int64_t*, double*, double*);
template Status solve_tall<double>(const double*, std::size_t, std::size_t, std::vector<Run>,
                                   std::int64_t*, double*, double*);

}  // namespace fusekit
