/* Stress driver for the ncnn engine's arena (runtimes/ncnn/ep_ncnn_pool.cc, ArenaPool), built with
 * -fsanitize=address,undefined against libncnn's headers only. A seeded random walk of requests and
 * frees, sizes from 1 byte to past the arena's end (those fall back to malloc): every block must be
 * 64-byte aligned, writable over its size + NCNN_MALLOC_OVERREAD, and keep its own fill until freed
 * (two blocks that overlap overwrite each other's fill). Then the same walk again must get the same
 * addresses (a second run reuses the first run's blocks, which is why it faults no page in), and a
 * walk of frees in another order must leave one merged free block (no leaked bytes).
 * Usage: arena_pool_stress STEPS SEED */
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ep_ncnn_pool.cc"  /* -I runtimes/ncnn */

/* out of line in libncnn (allocator.cpp), which this driver does not link */
ncnn::Allocator::~Allocator() {}
/* load_reuse_patch.py's switch, also in allocator.cpp: off, as it is whenever no net is loading, so
 * the inline fastMalloc/fastFree the pool falls back to are ncnn's own (the other two are never called) */
namespace ncnn {
int g_ep_load_reuse = 0;
void* ep_reuse_take(size_t) { abort(); }
int ep_reuse_keep(void*) { abort(); }
}

namespace {

struct Block {
    unsigned char *p;
    size_t n;
    unsigned char tag;
};

void fail(const char *what, size_t step) {
    fprintf(stderr, "arena stress: %s at step %zu\n", what, step);
    exit(1);
}

uint64_t rng_state;
uint64_t next_random() {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

size_t g_peak_seen = 0;  /* the most arena bytes lent at once, by this driver's own count */

/* ep_ncnn_arena_stats (EDGEPACK_NCNN_TRACE's figures) against the driver's own count: the bytes lent
 * from the arena (each request rounded as the arena rounds it), their peak, and the touched top */
void check_stats(ncnn_allocator_t a, const std::vector<Block> &live, size_t step) {
    const ArenaPool *pool = static_cast<const ArenaPool *>(static_cast<ncnn::Allocator *>(a->pthis));
    size_t lent = 0;
    for (const Block &b : live)
        if (pool->owns(b.p))
            lent += (b.n + NCNN_MALLOC_OVERREAD + NCNN_MALLOC_ALIGN - 1) / NCNN_MALLOC_ALIGN * NCNN_MALLOC_ALIGN;
    if (lent > g_peak_seen) g_peak_seen = lent;
    size_t touched, held, peak;
    if (ep_ncnn_arena_stats(a, &touched, &held, &peak) != 0) fail("the arena's stats were refused", step);
    if (held != lent) fail("the arena's held bytes disagree with the blocks lent", step);
    if (peak != g_peak_seen) fail("the arena's held peak disagrees with the most lent at once", step);
    if (touched < held) fail("the arena says it holds more than it touched", step);
}

/* one walk; the addresses handed out, in order */
std::vector<uintptr_t> walk(ncnn_allocator_t a, size_t steps, uint64_t seed, size_t reserve) {
    rng_state = seed;
    std::vector<Block> live;
    std::vector<uintptr_t> got;
    for (size_t s = 0; s < steps; s++) {
        uint64_t r = next_random();
        if (live.empty() || r % 5 < 3) {
            size_t n = r % 97 == 0 ? reserve + 1 + r % 4096          /* past the arena: malloc */
                       : r % 7 == 0 ? 1 + (r >> 8) % (reserve / 8)   /* large */
                                    : 1 + (r >> 8) % 4096;           /* small */
            unsigned char *p = static_cast<unsigned char *>(a->fast_malloc(a, n));
            if (!p) fail("a request failed", s);
            if (reinterpret_cast<uintptr_t>(p) % NCNN_MALLOC_ALIGN) fail("a block is not aligned", s);
            unsigned char tag = static_cast<unsigned char>(1 + s % 251);
            memset(p, tag, n + NCNN_MALLOC_OVERREAD);
            live.push_back({p, n, tag});
            got.push_back(reinterpret_cast<uintptr_t>(p));
            check_stats(a, live, s);
        } else {
            size_t i = (r >> 16) % live.size();
            Block b = live[i];
            for (size_t k = 0; k < b.n + NCNN_MALLOC_OVERREAD; k++)
                if (b.p[k] != b.tag) fail("a block was overwritten by another", s);
            a->fast_free(a, b.p);
            live[i] = live.back();
            live.pop_back();
            check_stats(a, live, s);
        }
    }
    for (const Block &b : live) {
        for (size_t k = 0; k < b.n + NCNN_MALLOC_OVERREAD; k++)
            if (b.p[k] != b.tag) fail("a block was overwritten by another", steps);
        a->fast_free(a, b.p);
    }
    return got;
}

}  // namespace

int main(int argc, char **argv) {
    size_t steps = argc > 1 ? strtoul(argv[1], nullptr, 10) : 20000;
    uint64_t seed = argc > 2 ? strtoull(argv[2], nullptr, 10) : 1;
    const size_t reserve = 8u << 20;
    ncnn_allocator_t a = ep_ncnn_arena_pool_create(reserve);
    if (!a) fail("the arena could not be reserved", 0);
    std::vector<uintptr_t> first = walk(a, steps, seed, reserve);
    std::vector<uintptr_t> second = walk(a, steps, seed, reserve);
    ArenaPool *pool = static_cast<ArenaPool *>(static_cast<ncnn::Allocator *>(a->pthis));
    /* blocks past the arena come from malloc, whose addresses may differ */
    size_t in_arena = 0, same = 0;
    for (size_t i = 0; i < first.size() && i < second.size(); i++) {
        if (pool->owns(reinterpret_cast<void *>(first[i]))) {
            in_arena++;
            same += first[i] == second[i];
        }
    }
    if (first.size() != second.size() || same != in_arena) fail("a second walk took other blocks", steps);
    if (pool->free_blocks() != 1 || pool->lent_blocks() != 0) fail("freed blocks did not merge back into one", steps);
    ncnn_allocator_t other = ep_ncnn_best_fit_pool_create(100);
    size_t t, h, pk;
    if (!other || ep_ncnn_arena_stats(other, &t, &h, &pk) != -1) fail("a best-fit pool passed for an arena", steps);
    delete static_cast<ncnn::Allocator *>(other->pthis);
    free(other);
    printf("arena stress: %zu steps, %zu blocks from the arena, %zu past it, top %zu bytes\n", steps, in_arena,
           first.size() - in_arena, pool->top());
    delete static_cast<ncnn::Allocator *>(a->pthis);
    free(a);
    return 0;
}
