/* A best-fit buffer pool for ncnn's blobs and workspace (issue 10 item 5).
 *
 * ncnn's PoolAllocator hands out the first cached buffer that is large enough (the per-net pools it
 * makes for an extractor accept any larger one). A small request then takes a large buffer, the
 * next large request misses and mallocs again, and the pool keeps growing run after run:
 * ppocr_v4_det peaked at 59 MB with it against 30.5 MB with plain malloc (which is 4x slower here:
 * musl maps and unmaps every large buffer, so each run pays the page faults again). This pool
 * reuses the smallest cached buffer that fits and is at most twice the request, so a run after the
 * first reuses the same buffers for the same requests, with no page faults. */
#include <cstdlib>
#include <map>
#include <new>
#include <unordered_map>

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

ncnn::Allocator *of(ncnn_allocator_t a) { return static_cast<ncnn::Allocator *>(a->pthis); }
void *c_malloc(ncnn_allocator_t a, size_t size) { return of(a)->fastMalloc(size); }
void c_free(ncnn_allocator_t a, void *p) { of(a)->fastFree(p); }

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
