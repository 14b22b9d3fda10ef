/* Stress driver for the ncnn engine's arena (runtimes/ncnn/ep_ncnn_pool.cc, ArenaPool), built with
 * -fsanitize=address,undefined against libncnn's headers only. A seeded random walk of requests and
 * frees, sizes from 1 byte to past the arena's end (those fall back to malloc): every block must be
 * 64-byte aligned, writable over its size + NCNN_MALLOC_OVERREAD, and keep its own fill until freed
 * (two blocks that overlap overwrite each other's fill). Then the same walk again must get the same
 * addresses (a second run reuses the first run's blocks, which is why it faults no page in), and a
 * walk of frees in another order must leave one merged free block (no leaked bytes).
 * Plans (edgepack/backends/ncnn/arena_plan.py): a fresh arena given the offsets first fit chose must
 * place every request there; one given random offsets must still never overlap two live blocks (a
 * planned place that is not free is refused for first fit); a truncated plan blob is refused.
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

/* one walk; the addresses handed out, in order. past: some requests exceed the arena; sizes: each
 * request's bytes, in order */
std::vector<uintptr_t> walk(ncnn_allocator_t a, size_t steps, uint64_t seed, size_t reserve, bool past = true,
                            std::vector<size_t> *sizes = nullptr) {
    rng_state = seed;
    std::vector<Block> live;
    std::vector<uintptr_t> got;
    for (size_t s = 0; s < steps; s++) {
        uint64_t r = next_random();
        if (live.empty() || r % 5 < 3) {
            size_t n = r % 97 == 0 && past ? reserve + 1 + r % 4096  /* past the arena: malloc */
                       : r % 7 == 0 ? 1 + (r >> 8) % (reserve / 8)   /* large */
                                    : 1 + (r >> 8) % 4096;           /* small */
            unsigned char *p = static_cast<unsigned char *>(a->fast_malloc(a, n));
            if (!p) fail("a request failed", s);
            if (sizes) sizes->push_back(n);
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

void put64(std::vector<unsigned char> &out, uint64_t v) {
    for (int i = 0; i < 8; i++) out.push_back(static_cast<unsigned char>(v >> (8 * i)));
}

/* the plan blob for one thread count: each request's bytes as the arena rounds them, at offsets[i] */
std::vector<unsigned char> plan_blob(const std::vector<size_t> &sizes, const std::vector<size_t> &offsets, int threads) {
    std::vector<unsigned char> out = {'E', 'P', 'A', 'P', 'L', 'A', 'N', '1'};
    put64(out, 1);
    put64(out, static_cast<uint64_t>(threads));
    put64(out, sizes.size());
    for (size_t i = 0; i < sizes.size(); i++) {
        put64(out, (sizes[i] + NCNN_MALLOC_OVERREAD + NCNN_MALLOC_ALIGN - 1) / NCNN_MALLOC_ALIGN * NCNN_MALLOC_ALIGN);
        put64(out, offsets[i]);
    }
    return out;
}

ArenaPool *pool_of(ncnn_allocator_t a) { return static_cast<ArenaPool *>(static_cast<ncnn::Allocator *>(a->pthis)); }

void destroy(ncnn_allocator_t a) {
    delete static_cast<ncnn::Allocator *>(a->pthis);
    free(a);
}

/* walks of steps / 10 requests sized as for `reserve`, in arenas large enough that none falls back to malloc */
void plans(size_t steps, uint64_t seed, size_t reserve) {
    steps /= 10;
    const size_t big = reserve * 32;
    std::vector<size_t> sizes;
    ncnn_allocator_t ff = ep_ncnn_arena_pool_create(big);
    if (!ff) fail("the arena could not be reserved", 0);
    g_peak_seen = 0;
    std::vector<uintptr_t> first = walk(ff, steps, seed, reserve, false, &sizes);
    std::vector<size_t> offsets;
    for (uintptr_t p : first) {
        if (!pool_of(ff)->owns(reinterpret_cast<void *>(p))) fail("a plan walk outgrew its arena", 0);
        offsets.push_back(p - reinterpret_cast<uintptr_t>(pool_of(ff)->base()));
    }

    /* the offsets first fit took, as a plan: followed to the end, the same places */
    ncnn_allocator_t planned = ep_ncnn_arena_pool_create(big);
    std::vector<unsigned char> blob = plan_blob(sizes, offsets, 1);
    if (ep_ncnn_arena_set_plan(planned, blob.data(), blob.size(), 1) != 0) fail("a valid plan was refused", 0);
    ep_ncnn_arena_run_begin(planned);
    g_peak_seen = 0;
    std::vector<uintptr_t> again = walk(planned, steps, seed, reserve, false);
    for (size_t i = 0; i < again.size(); i++)
        if (again[i] - reinterpret_cast<uintptr_t>(pool_of(planned)->base()) != offsets[i])
            fail("a planned request was placed elsewhere", i);
    if (pool_of(planned)->top() != pool_of(ff)->top()) fail("the planned arena grew past the plan", steps);

    /* random offsets: planned places overlap live blocks, and must be refused */
    std::vector<size_t> wild;
    rng_state = seed * 7 + 1;
    for (size_t i = 0; i < sizes.size(); i++) wild.push_back(next_random() % (big / 2) / NCNN_MALLOC_ALIGN * NCNN_MALLOC_ALIGN);
    ncnn_allocator_t random = ep_ncnn_arena_pool_create(big);
    blob = plan_blob(sizes, wild, 1);
    if (ep_ncnn_arena_set_plan(random, blob.data(), blob.size(), 1) != 0) fail("a plan inside the arena was refused", 0);
    ep_ncnn_arena_run_begin(random);
    g_peak_seen = 0;
    walk(random, steps, seed, reserve, false);  /* fills checked: no two live blocks overlap */
    if (pool_of(random)->lent_blocks() != 0) fail("blocks stayed lent after a planned walk", steps);

    /* malformed: truncated, past the arena, a plan for other threads (taken as none) */
    blob = plan_blob(sizes, offsets, 1);
    if (ep_ncnn_arena_set_plan(random, blob.data(), blob.size() - 8, 1) != -1) fail("a truncated plan was taken", 0);
    std::vector<size_t> past(offsets.size(), big);
    std::vector<unsigned char> outside = plan_blob(sizes, past, 1);
    if (ep_ncnn_arena_set_plan(random, outside.data(), outside.size(), 1) != -1) fail("a plan past the arena was taken", 0);
    if (ep_ncnn_arena_set_plan(random, blob.data(), blob.size(), 2) != 0) fail("a plan for 1 thread broke 2", 0);
    destroy(ff);
    destroy(planned);
    destroy(random);
    printf("arena plans: %zu requests followed\n", sizes.size());
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
    plans(steps, seed, reserve);
    return 0;
}
