/* Pools for ncnn's blobs and workspace (issue 10 item 5): ArenaPool below is the engine's default
 * (pool=arena); the best-fit pool stays as a measuring switch (pool=best<N>) and as the fallback where
 * the arena's address space cannot be reserved.
 *
 * The best-fit pool:
 * ncnn's PoolAllocator hands out the first cached buffer that is large enough (the per-net pools it
 * makes for an extractor accept any larger one). A small request then takes a large buffer, the
 * next large request misses and mallocs again, and the pool keeps growing run after run:
 * ppocr_v4_det peaked at 59 MB with it against 30.5 MB with plain malloc (which is 4x slower here:
 * musl maps and unmaps every large buffer, so each run pays the page faults again). This pool
 * reuses the smallest cached buffer that fits and is at most twice the request, so a run after the
 * first reuses the same buffers for the same requests, with no page faults. */
#include <sys/mman.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <new>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ncnn/allocator.h"
#include "ncnn/c_api.h"
#include "ncnn/platform.h"

namespace {

class BestFitPool : public ncnn::Allocator {
public:
    explicit BestFitPool(unsigned slack_pct) : slack_pct_(slack_pct) {}
    ~BestFitPool() override {
        for (auto &kv : free_) ncnn::fastFree(kv.second);
        /* buffers still lent out belong to Mats that outlive the pool: the net is destroyed
         * first (ncnn_close), so there are none; leaking beats freeing memory in use */
    }
    void *fastMalloc(size_t size) override {
        lock_.lock();
        auto it = free_.lower_bound(size);
        if (it != free_.end() && it->first - size <= size / 100 * slack_pct_) {
            void *p = it->second;
            lent_[p] = it->first;
            free_.erase(it);
            lock_.unlock();
            return p;
        }
        lock_.unlock();
        void *p = ncnn::fastMalloc(size);
        if (!p) return p;
        lock_.lock();
        lent_[p] = size;
        lock_.unlock();
        return p;
    }
    void fastFree(void *p) override {
        lock_.lock();
        auto it = lent_.find(p);
        if (it == lent_.end()) {  /* not ours (cannot happen with ncnn): give it back as it came */
            lock_.unlock();
            ncnn::fastFree(p);
            return;
        }
        /* before the buffers of equal size: lower_bound finds the one freed last, still in cache */
        free_.emplace_hint(free_.lower_bound(it->second), it->second, p);
        lent_.erase(it);
        lock_.unlock();
    }

private:
    unsigned slack_pct_;  /* a cached buffer serves a request it exceeds by at most this share */
    ncnn::Mutex lock_;
    std::multimap<size_t, void *> free_;  /* cached buffers by size */
    std::unordered_map<void *, size_t> lent_;
};

/* An address-ordered first-fit heap in one reserved stretch of address space (the engine's default).
 * The best-fit pool keeps every buffer it ever lent, so a run holds about twice the tensors alive at
 * its worst moment (nudenet_320n: 8.4 MB against a live peak of ~4.5 MB): a request that no cached
 * buffer fits gets a new one while smaller free ones sit idle. Here freed blocks merge with their
 * neighbours and a request takes the lowest free block that fits, so the touched part of the arena
 * stays near the live peak. Pages once touched stay mapped, so a run after the first faults no page in
 * (that is what made plain malloc 1.5x slower). The arena is reserved, not committed
 * (MAP_NORESERVE): only touched pages count. Requests past its end fall back to ncnn::fastMalloc.
 *
 * First fit still touches more than the most a run holds at once where a long-lived block splits a
 * hole (YOLO11s-seg: 35.1 MB touched for 31.1 MB held). A run's requests come in the same order with
 * the same sizes every time, so the build records them (EDGEPACK_NCNN_ARENA_LOG) and plans an offset
 * for each (edgepack/backends/ncnn/arena_plan.py); the arena follows the plan while the requests match
 * it, each placement only where its bytes are free, and falls back to first fit for the rest of the run
 * at the first request that differs (another thread count or CPU can ask for other sizes). */
class ArenaPool final : public ncnn::Allocator {
public:
    ArenaPool(char *base, size_t cap) : base_(base), cap_(cap), top_(0) {}
    ~ArenaPool() override { munmap(base_, cap_); }
    void *fastMalloc(size_t size) override {
        /* ncnn::fastMalloc's contract: NCNN_MALLOC_ALIGN-aligned, NCNN_MALLOC_OVERREAD readable past the end */
        size_t need = (size + NCNN_MALLOC_OVERREAD + NCNN_MALLOC_ALIGN - 1) / NCNN_MALLOC_ALIGN * NCNN_MALLOC_ALIGN;
        if (need < size) return nullptr;
        lock_.lock();
        size_t idx = next_++;
        size_t at = SIZE_MAX;
        if (following_) {
            if (idx < plan_.size() && plan_[idx].first == need)
                at = take_at(plan_[idx].second, need);
            else
                following_ = false;
        }
        if (at == SIZE_MAX) at = first_fit(need);
        if (at == SIZE_MAX) {
            lock_.unlock();
            return ncnn::fastMalloc(size);  /* past the arena: ncnn's own, freed the same way */
        }
        lent_[at] = Lent{need, idx};
        live_ += need;
        if (live_ > live_peak_) live_peak_ = live_;
        if (log_) fprintf(log_, "A %zu %zu %zu\n", idx, need, at);
        lock_.unlock();
        return base_ + at;
    }
    void fastFree(void *ptr) override {
        if (!owns(ptr)) {
            ncnn::fastFree(ptr);
            return;
        }
        lock_.lock();
        auto it = lent_.find(static_cast<size_t>(static_cast<char *>(ptr) - base_));
        if (it != lent_.end()) {  /* not lent (cannot happen with ncnn): ignore rather than corrupt */
            size_t at = it->first, size = it->second.size;
            if (log_) fprintf(log_, "F %zu\n", it->second.idx);
            lent_.erase(it);
            live_ -= size;
            give_back(at, size);
        }
        lock_.unlock();
    }

    /* A run begins: requests are counted from 0 again, and the plan (if any) is followed afresh. */
    void run_begin() {
        lock_.lock();
        next_ = 0;
        following_ = !plan_.empty();
        if (log_) fputs("R\n", log_);
        lock_.unlock();
    }
    /* Each request's (bytes, offset) by its place in a run; false (and no plan) if one lies outside
     * the arena or is not aligned as the arena aligns. */
    bool set_plan(std::vector<std::pair<size_t, size_t>> plan) {
        for (const auto &p : plan)
            if (p.first % NCNN_MALLOC_ALIGN || p.second % NCNN_MALLOC_ALIGN || p.second > cap_ || p.first > cap_ - p.second)
                return false;
        lock_.lock();
        plan_ = std::move(plan);
        lock_.unlock();
        return true;
    }
    /* every request and free from now on, by its place in the run: "A index bytes offset", "F index", and
     * "R" where a run begins (the build's plan is made from these) */
    void set_log(FILE *log) { log_ = log; }

    bool owns(const void *p) const { return p >= base_ && p < base_ + cap_; }
    /* for tests/fuzz/arena_pool_stress.cc */
    const char *base() const { return base_; }
    size_t free_blocks() const { return free_.size(); }
    size_t lent_blocks() const { return lent_.size(); }
    size_t top() const { return top_; }
    /* bytes lent now and at most so far: against top(), how much of the touched arena fragmentation
     * costs (EDGEPACK_NCNN_TRACE) */
    size_t live() const { return live_; }
    size_t live_peak() const { return live_peak_; }

private:
    struct Lent {
        size_t size, idx;  /* bytes; the request's place in its run */
    };

    /* The lowest free block that fits (growing the arena when none does); SIZE_MAX when the arena is full. */
    size_t first_fit(size_t need) {
        size_t at = SIZE_MAX;
        for (auto it = free_.begin(); it != free_.end(); ++it) {
            if (it->second >= need) {
                at = it->first;
                size_t rest = it->second - need;
                free_.erase(it);
                if (rest) free_.emplace(at + need, rest);
                break;
            }
        }
        if (at == SIZE_MAX) {
            /* grow the arena, from the free block at its end if there is one */
            size_t start = top_;
            if (!free_.empty()) {
                auto last = std::prev(free_.end());
                if (last->first + last->second == top_) {
                    start = last->first;
                    free_.erase(last);
                }
            }
            if (need <= cap_ - start) {
                at = start;
                top_ = start + need;
            } else if (start != top_) {
                free_.emplace(start, top_ - start);  /* no room: put the tail back */
            }
        }
        return at;
    }

    /* [at, at + need) taken where all of it is free: inside one free block, or past the touched part
     * (growing it); SIZE_MAX, and nothing taken, otherwise. */
    size_t take_at(size_t at, size_t need) {
        if (at > cap_ || need > cap_ - at) return SIZE_MAX;
        size_t end = at + need;
        if (at >= top_) {
            if (at > top_) give_back(top_, at - top_);  /* the gap below it: free, merged with a free tail */
            top_ = end;
            return at;
        }
        auto it = free_.upper_bound(at);
        if (it == free_.begin()) return SIZE_MAX;
        --it;
        size_t start = it->first, stop = it->first + it->second;
        if (stop < end) {
            if (stop != top_) return SIZE_MAX;  /* runs into a lent block */
            top_ = stop = end;                  /* the free tail, grown */
        }
        free_.erase(it);
        if (at > start) free_.emplace(start, at - start);
        if (stop > end) free_.emplace(end, stop - end);
        return at;
    }

    /* [at, at + size) free again, merged with its free neighbours */
    void give_back(size_t at, size_t size) {
        auto next = free_.lower_bound(at);
        if (next != free_.end() && at + size == next->first) {
            size += next->second;
            next = free_.erase(next);
        }
        if (next != free_.begin()) {
            auto prev = std::prev(next);
            if (prev->first + prev->second == at) {
                at = prev->first;
                size += prev->second;
                free_.erase(prev);
            }
        }
        free_.emplace(at, size);
    }

    char *base_;
    size_t cap_, top_;        /* reserved bytes; end of the part ever handed out */
    size_t live_ = 0, live_peak_ = 0;
    ncnn::Mutex lock_;
    std::map<size_t, size_t> free_;  /* offset -> bytes, merged with neighbours */
    std::map<size_t, Lent> lent_;    /* offset -> the block */
    std::vector<std::pair<size_t, size_t>> plan_;  /* (bytes, offset) of each request of a run */
    size_t next_ = 0;         /* the next request's place in the run */
    bool following_ = false;  /* every request of this run so far matched the plan */
    FILE *log_ = nullptr;
};

ncnn::Allocator *of(ncnn_allocator_t a) { return static_cast<ncnn::Allocator *>(a->pthis); }
void *c_malloc(ncnn_allocator_t a, size_t size) { return of(a)->fastMalloc(size); }
void c_free(ncnn_allocator_t a, void *p) { of(a)->fastFree(p); }
/* an arena's own entry point, so ep_ncnn_arena_stats can tell an arena from other pools (no RTTI) */
void *c_arena_malloc(ncnn_allocator_t a, size_t size) { return static_cast<ArenaPool *>(of(a))->fastMalloc(size); }

}  // namespace

/* An ncnn_allocator_t over a BestFitPool; ncnn_allocator_destroy frees it (it deletes pthis through
 * ncnn::Allocator's virtual destructor and frees the struct). NULL when out of memory. */
extern "C" ncnn_allocator_t ep_ncnn_best_fit_pool_create(unsigned slack_pct) {
    ncnn_allocator_t a = static_cast<ncnn_allocator_t>(malloc(sizeof *a));
    if (!a) return nullptr;
    BestFitPool *pool = new (std::nothrow) BestFitPool(slack_pct);
    if (!pool) {
        free(a);
        return nullptr;
    }
    a->pthis = static_cast<ncnn::Allocator *>(pool);
    a->fast_malloc = c_malloc;
    a->fast_free = c_free;
    return a;
}

/* An arena's touched bytes, lent bytes and most lent bytes so far; -1 when `a` is not an arena. */
extern "C" int ep_ncnn_arena_stats(ncnn_allocator_t a, size_t *touched, size_t *live, size_t *live_peak) {
    if (!a || a->fast_malloc != c_arena_malloc) return -1;
    const ArenaPool *arena = static_cast<const ArenaPool *>(of(a));
    *touched = arena->top();
    *live = arena->live();
    *live_peak = arena->live_peak();
    return 0;
}

/* A run begins (the plan is followed from its first request); nothing when `a` is not an arena. */
extern "C" void ep_ncnn_arena_run_begin(ncnn_allocator_t a) {
    if (a && a->fast_malloc == c_arena_malloc) static_cast<ArenaPool *>(of(a))->run_begin();
}

/* The arena plan blob (edgepack/backends/ncnn/arena_plan.py), little-endian: "EPAPLAN1", u64 plan count,
 * then per plan u64 threads, u64 request count and per request u64 bytes, u64 offset. The plan made at
 * `threads` is taken (a run on another thread count asks for other workspace sizes); 0 when taken or
 * when there is none for `threads`, -1 when the blob is malformed (no plan is set) or `a` is not an arena. */
extern "C" int ep_ncnn_arena_set_plan(ncnn_allocator_t a, const unsigned char *blob, size_t n, int threads) {
    if (!a || a->fast_malloc != c_arena_malloc || n < 16 || memcmp(blob, "EPAPLAN1", 8) != 0) return -1;
    auto u64 = [](const unsigned char *p) {
        uint64_t v = 0;
        for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
        return v;
    };
    uint64_t plans = u64(blob + 8);
    size_t at = 16;
    std::vector<std::pair<size_t, size_t>> chosen;
    for (uint64_t k = 0; k < plans; k++) {
        if (n - at < 16) return -1;
        uint64_t made_at = u64(blob + at), count = u64(blob + at + 8);
        at += 16;
        if (count > (n - at) / 16) return -1;
        for (uint64_t i = 0; i < count; i++, at += 16) {
            uint64_t bytes = u64(blob + at), offset = u64(blob + at + 8);
            if (bytes > SIZE_MAX || offset > SIZE_MAX) return -1;
            if (made_at == static_cast<uint64_t>(threads)) chosen.emplace_back(static_cast<size_t>(bytes), static_cast<size_t>(offset));
        }
    }
    if (at != n) return -1;
    return static_cast<ArenaPool *>(of(a))->set_plan(std::move(chosen)) ? 0 : -1;
}

/* The arena logs its requests to `log` (EDGEPACK_NCNN_ARENA_LOG); nothing when `a` is not an arena. */
extern "C" void ep_ncnn_arena_log(ncnn_allocator_t a, FILE *log) {
    if (a && a->fast_malloc == c_arena_malloc) static_cast<ArenaPool *>(of(a))->set_log(log);
}

/* An ncnn_allocator_t over an ArenaPool reserving `reserve` bytes of address space; NULL when that
 * cannot be reserved (then the caller keeps the best-fit pool). */
extern "C" ncnn_allocator_t ep_ncnn_arena_pool_create(size_t reserve) {
    void *base = mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) return nullptr;
    ncnn_allocator_t a = static_cast<ncnn_allocator_t>(malloc(sizeof *a));
    ArenaPool *pool = a ? new (std::nothrow) ArenaPool(static_cast<char *>(base), reserve) : nullptr;
    if (!pool) {
        free(a);
        munmap(base, reserve);
        return nullptr;
    }
    a->pthis = static_cast<ncnn::Allocator *>(pool);
    a->fast_malloc = c_arena_malloc;
    a->fast_free = c_free;
    return a;
}
