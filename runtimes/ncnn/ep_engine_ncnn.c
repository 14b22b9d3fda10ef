/* The ncnn engine (ep_engine_ops_ncnn, see ep_engine_table.h): loads the embedded .param/.bin
 * through ncnn's C API.
 *
 * Options from the spec: ncnn.in.<i> / ncnn.out.<i> (blob names), ncnn.batch_axis.<i>
 * ("0" when the ONNX dim 0 is a batch dim ncnn does not see, "none" otherwise),
 * ncnn.fp32 ("1" forces fp32 storage and arithmetic), ncnn.fp16_arithmetic ("0": fp16 storage only),
 * ncnn.arena_plan (the index of the model blob holding the arena's plan, arena_plan.py).
 * model_blobs[0] is the NUL-terminated param text, model_blobs[1] the weights, model_blobs[2] (optional)
 * the map replaying repeated weights from them (see weight_reader). `--memory lean` builds
 * carry a .param whose large-kernel convolutions have Winograd masked (edgepack/backends/ncnn/memory.py).
 * Measuring aids, off unless set: EDGEPACK_NCNN_OPTIONS (apply_switches), EDGEPACK_NCNN_TRACE=1 (RSS
 * after load and after each run, on stderr).
 */
#define _DEFAULT_SOURCE /* madvise, MADV_DONTNEED */
#include "ep_engine_table.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ep_blob_file.h"     /* the blobs read with pread, not through the mapping */
#include "ep_ncnn_switches.h" /* the EDGEPACK_NCNN_OPTIONS parser, fuzzed apart from ncnn */
#include "ncnn/c_api.h"

ncnn_allocator_t ep_ncnn_best_fit_pool_create(unsigned slack_pct); /* ep_ncnn_pool.cc */
int ep_ncnn_register_layers(ncnn_net_t net);                      /* ep_ncnn_layers.cc */
ncnn_allocator_t ep_ncnn_arena_pool_create(size_t reserve);        /* ep_ncnn_pool.cc */
int ep_ncnn_arena_stats(ncnn_allocator_t a, size_t *touched, size_t *live, size_t *live_peak);
int ep_ncnn_arena_set_plan(ncnn_allocator_t a, const unsigned char *blob, size_t n, int threads);
void ep_ncnn_arena_run_begin(ncnn_allocator_t a);
void ep_ncnn_arena_log(ncnn_allocator_t a, FILE *log);
void ep_ncnn_load_reuse(int on); /* libncnn's src/allocator.cpp (load_reuse_patch.py) */
#if defined(__x86_64__) /* isa_cap_patch.py patches x86_64 builds only */
int ep_ncnn_cap_x86_isa(int level); /* libncnn's src/cpu.cpp (isa_cap_patch.py) */
int ep_ncnn_x86_direct_conv(int mode); /* the same file: which convolutions take the direct kernel */
#endif
/* address space the arena reserves (not memory: only pages touched count); a net whose tensors
 * outgrow it takes the rest from malloc */
#define EP_NCNN_ARENA_RESERVE (sizeof(size_t) >= 8 ? (size_t)8 << 30 : (size_t)512 << 20)

typedef struct {
    const ep_model_spec *spec;
    ncnn_net_t net;
    ncnn_option_t opt;
    ncnn_allocator_t blob_alloc, work_alloc; /* only when an option asks for shared pools */
    int items; /* a batch of this many runs the batch-1 graph once per item (edgepack/batch_items.py) */
    FILE *arena_log; /* EDGEPACK_NCNN_ARENA_LOG: the arena's requests, for the build's plan */
} ncnn_engine;

static const char *ncnn_describe(void) { return "ncnn"; }
static void ncnn_close(void *handle);

/* ncnn sizes its OpenMP-emulation pool from /proc/cpuinfo; where that file is unreadable
 * (seen in qemu-user chroots) the pool has one worker and parallel regions with barriers then
 * compute wrong results. Never ask for more threads than ncnn itself can see. */
static int ncnn_visible_cpus(void) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return 1;
    char line[256];
    int n = 0;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "processor", 9) == 0) n++;
    fclose(f);
    return n > 0 ? n : 1;
}

/* Weights are read through this reader rather than ncnn_net_load_model_memory: ncnn loads and
 * repacks one layer at a time (and, in light mode, drops the layer's unpacked weights), so each page
 * of the embedded .bin is needed only until the reader has moved past it. Handing those pages back
 * as we go keeps the embedded copy out of the peak RSS (issue 10 item 5: peak was ~3x the model's
 * need). Only pages of a read-only, file-backed mapping are handed back: the kernel reads them again
 * from the executable if anything touches them later, so this can never change a weight.
 *
 * A build whose .bin repeats itself (one copy of a weight per layer using it) embeds each repeated
 * stretch once, plus a segment map, model_blobs[2] (edgepack/backends/ncnn/dedup.py): rows of
 * (length, offset into the stored bytes) that replay pnnx's byte stream in order. Without a map the
 * stream is one row over the whole blob. */
#define EP_WMAP_MAGIC "EPWMAP1"  /* 8 bytes with its NUL */
#define EP_WMAP_HEAD 24          /* magic, u64 logical size, u64 row count */

typedef struct {
    const unsigned char *base;   /* the stored bytes */
    size_t size;
    const unsigned char *rows;   /* the map's rows, 16 bytes each; NULL: one row, the whole blob */
    uint64_t nrows, row;         /* row being read */
    size_t row_used;             /* bytes of that row handed out */
    size_t consumed;             /* bytes of the stream handed out */
    uintptr_t frontier;          /* the furthest stored byte read so far */
    uintptr_t released;  /* [released, page of frontier) may go back to the kernel */
    uintptr_t limit;     /* end of the file-backed read-only mapping holding the weights; 0: none */
    const ep_blob_file *file;  /* where reads go first (pread); what it cannot give comes from the mapping */
} weight_reader;

static _Thread_local weight_reader *tl_reader;  /* ncnn's C reader has no slot for our state */

static uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static void row_of(const weight_reader *r, uint64_t i, uint64_t *len, uint64_t *off) {
    if (!r->rows) {
        *len = r->size;
        *off = 0;
        return;
    }
    *len = le64(r->rows + 16 * i);
    *off = le64(r->rows + 16 * i + 8);
}

/* Checks the map against the stored bytes (every row inside them, lengths summing to the stated
 * size) and sets the reader up; returns the stream's length, or (size_t)-1 if the map is malformed. */
static size_t weight_map_open(weight_reader *r, const unsigned char *m, size_t n) {
    if (n < EP_WMAP_HEAD || memcmp(m, EP_WMAP_MAGIC, 8) != 0) return (size_t)-1;
    uint64_t logical = le64(m + 8), nrows = le64(m + 16);
    if (nrows > (n - EP_WMAP_HEAD) / 16 || n - EP_WMAP_HEAD != nrows * 16 || logical > SIZE_MAX) return (size_t)-1;
    r->rows = m + EP_WMAP_HEAD;
    r->nrows = nrows;
    uint64_t total = 0;
    for (uint64_t i = 0; i < nrows; i++) {
        uint64_t len, off;
        row_of(r, i, &len, &off);
        if (off > r->size || len > r->size - off || len > logical - total) return (size_t)-1;
        total += len;
    }
    return total == logical ? (size_t)logical : (size_t)-1;
}

static uintptr_t page_size(void) { return (uintptr_t)sysconf(_SC_PAGESIZE); }

/* Hands back the whole pages of [lo, hi) (batched: only once they reach `at_least` bytes). */
static uintptr_t release_pages(uintptr_t lo, uintptr_t hi, uintptr_t at_least) {
    uintptr_t page = page_size();
    lo = (lo + page - 1) & ~(page - 1);
    hi &= ~(page - 1);
    if (hi <= lo || hi - lo < at_least) return 0;
    madvise((void *)lo, hi - lo, MADV_DONTNEED);
    return hi;
}

/* After stored bytes [p, p + n) were copied out: pages behind the furthest read go back one MiB at a
 * time; a repeat (a stretch read again from behind that point) gives its pages back at once. */
static void release_after(weight_reader *r, const unsigned char *p, size_t n) {
    const uintptr_t chunk = 1u << 20;  /* batches madvise calls */
    if (!r->limit) return;
    uintptr_t lo = (uintptr_t)p, hi = lo + n;
    if (hi > r->frontier) {
        r->frontier = hi;
        uintptr_t upto = release_pages(r->released, hi, chunk);
        if (upto) r->released = upto;
    } else if (hi <= r->released) {
        release_pages(lo, hi, chunk);
    }
}

#define EP_READ_PIECE ((size_t)1 << 20)

static size_t weight_read(ncnn_datareader_t dr, void *buf, size_t size) {
    (void)dr;
    weight_reader *r = tl_reader;
    if (!r) return 0;
    size_t done = 0;
    while (done < size && r->row < r->nrows) {
        uint64_t len, off;
        row_of(r, r->row, &len, &off);
        size_t n = (size_t)(len - r->row_used);
        if (n > size - done) n = size - done;
        /* a large weight is copied a MiB at a time, each piece's pages handed back before the next is
         * read: in one memcpy, all of its source pages were resident beside the copy (ddddocr_old_int8's
         * 16 MiB classifier put both at once into the load's peak) */
        if (n > EP_READ_PIECE) n = EP_READ_PIECE;
        const unsigned char *src = r->base + off + r->row_used;
        if (!ep_blob_file_read(r->file, (unsigned char *)buf + done, src, n)) {
            memcpy((unsigned char *)buf + done, src, n);
            release_after(r, src, n);
        }
        done += n;
        r->row_used += n;
        if (r->row_used == len) {
            r->row++;
            r->row_used = 0;
        }
    }
    r->consumed += done;
    return done;
}

/* Runs ncnn's weight loading over reader r. */
static size_t load_weights_from(ncnn_net_t net, weight_reader *r, const ep_blob_file *file) {
    const uintptr_t data = (uintptr_t)r->base;
    /* the madvise path (weights read through the mapping) only inside the mapping found */
    if (r->size && file->end && data >= file->start && r->size <= file->end - data) r->limit = file->end;
    ncnn_datareader_t dr = ncnn_datareader_create();
    if (!dr) return (size_t)-1;
    dr->read = weight_read;
    tl_reader = r;
    ep_ncnn_load_reuse(1); /* a layer's freed load buffers go to the next layer, not back to the kernel */
    int rc = ncnn_net_load_model_datareader(net, dr);
    ep_ncnn_load_reuse(0);
    tl_reader = NULL;
    ncnn_datareader_destroy(dr);
    /* every read copied its bytes out, so no page of the blob is needed any more */
    if (r->limit) release_pages(data, data + r->size, 1);
    return rc == 0 ? r->consumed : (size_t)-1;
}

/* A blob's bytes copied to the heap from the file (NUL-terminated, for the .param's text); NULL when
 * the file cannot give them (then read the blob where it lies) or out of memory. Free with free(). */
static unsigned char *blob_copy(const ep_blob_file *file, const ep_blob *b) {
    size_t n = ep_blob_size(b);
    unsigned char *copy = n < SIZE_MAX ? malloc(n + 1) : NULL;
    if (copy && !ep_blob_file_read(file, copy, b->data, n)) {
        free(copy);
        return NULL;
    }
    if (copy) copy[n] = 0;
    return copy;
}

/* Loads the weights (through the map, when the build made one) with weight_read; returns the bytes of
 * the stream consumed, or (size_t)-1 on error. *stream is set to the stream's length, (size_t)-1 when
 * the map is malformed. */
static size_t load_weights(ncnn_net_t net, const ep_blob *bin, const ep_blob *map, const ep_blob_file *file,
                           size_t *stream) {
    size_t n = ep_blob_size(bin);
    const unsigned char *data = bin->data;
    uintptr_t page = page_size();
    weight_reader r = {data, n, NULL, 1, 0, 0, 0, (uintptr_t)data, ((uintptr_t)data + page - 1) & ~(page - 1), 0, file};
    if (map) {
        unsigned char *rows = blob_copy(file, map); /* read all through the load: kept off the mapping too */
        *stream = weight_map_open(&r, rows ? rows : map->data, ep_blob_size(map));
        if (*stream == (size_t)-1) {
            free(rows);
            return (size_t)-1;
        }
        size_t used = load_weights_from(net, &r, file);
        free(rows);
        return used;
    }
    *stream = n;
    return load_weights_from(net, &r, file);
}

/* This process's VmRSS, VmHWM and RssFile (the part of VmRSS that maps files) in KiB (for
 * EDGEPACK_NCNN_TRACE). */
static void vm_kb(long *rss, long *hwm, long *file) {
    *rss = *hwm = *file = -1;
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return;
    char line[256];
    while (fgets(line, sizeof line, f)) {
        sscanf(line, "VmRSS: %ld kB", rss);
        sscanf(line, "VmHWM: %ld kB", hwm);
        sscanf(line, "RssFile: %ld kB", file);
    }
    fclose(f);
}

/* EDGEPACK_NCNN_TRACE=1: where the memory goes (issue 10 item 5), one stderr line per stage; with the
 * arena (the default pool), how much of it was touched against the most its tensors held at once. */
static void trace(const ncnn_allocator_t arena, const char *stage) {
    const char *t = getenv("EDGEPACK_NCNN_TRACE");
    if (!t || strcmp(t, "1") != 0) return;
    long rss, hwm, file;
    vm_kb(&rss, &hwm, &file);
    size_t touched, live, peak;
    if (ep_ncnn_arena_stats(arena, &touched, &live, &peak) == 0)
        fprintf(stderr, "ncnn-trace: %s VmRSS=%ld kB VmHWM=%ld kB RssFile=%ld kB arena touched=%zu kB held=%zu kB held-peak=%zu kB\n",
                stage, rss, hwm, file, touched >> 10, live >> 10, peak >> 10);
    else
        fprintf(stderr, "ncnn-trace: %s VmRSS=%ld kB VmHWM=%ld kB RssFile=%ld kB\n", stage, rss, hwm, file);
}

/* ncnn's x86/Arm switches, from a comma-separated "key=value" list: winograd, sgemm, packing,
 * fp16 (storage), fp16a (arithmetic), 0 or 1; pool=arena (ep_ncnn_pool.cc, the engine's default), best<N> (its best-fit pool), local
 * (ncnn's own per-net first-fit pools, ncnn's default), shared (one PoolAllocator
 * each for blobs and workspace), one (a single PoolAllocator for both), unlocked (UnlockedPoolAllocator), none (plain malloc). Read from
 * EDGEPACK_NCNN_OPTIONS, for measuring where time and memory go (bench/bench_memory.py --switches):
 * the build verified the artifact with ncnn's defaults, and these switches change the kernels and so
 * the rounding, so they are a measuring tool, not a way to run an artifact in production.
 * ep_ncnn_switches.h parses the list (apart from ncnn, so it can be fuzzed); this applies it. */
static int apply_switches(ncnn_engine *e, const char *list, ep_status *st) {
    ep_ncnn_switch sw;
    int rc;
    while ((rc = ep_ncnn_next_switch(&list, &sw, st)) == EP_OK && sw.key != EP_NCNN_SW_END) {
        if (sw.key == EP_NCNN_SW_WINOGRAD) ncnn_option_set_use_winograd_convolution(e->opt, sw.on);
        else if (sw.key == EP_NCNN_SW_SGEMM) ncnn_option_set_use_sgemm_convolution(e->opt, sw.on);
        else if (sw.key == EP_NCNN_SW_PACKING) ncnn_option_set_use_packing_layout(e->opt, sw.on);
        else if (sw.key == EP_NCNN_SW_FP16) {
            ncnn_option_set_use_fp16_storage(e->opt, sw.on);
            ncnn_option_set_use_fp16_packed(e->opt, sw.on);
        } else if (sw.key == EP_NCNN_SW_FP16A) {  /* ncnn uses it only where the CPU has fp16 arithmetic */
            ncnn_option_set_use_fp16_arithmetic(e->opt, sw.on);
        } else if (sw.key == EP_NCNN_SW_BF16) {  /* only where libncnn was built with NCNN_BF16 */
            ncnn_option_set_use_bf16_storage(e->opt, sw.on);
            ncnn_option_set_use_bf16_packed(e->opt, sw.on);
        } else if (sw.key == EP_NCNN_SW_ISA) {
#if defined(__x86_64__) /* isa_cap_patch.py patches x86_64 builds only */
            ep_ncnn_cap_x86_isa(sw.isa);  /* before the net exists: layers take their ISA build at creation */
#else
            return ep_fail(st, EP_ERR_MODEL, "EDGEPACK_NCNN_OPTIONS: isa= is for x86 artifacts");
#endif
        } else if (sw.key == EP_NCNN_SW_DIRECT) {
#if defined(__x86_64__)
            ep_ncnn_x86_direct_conv(sw.direct);  /* before the net exists: read at create_pipeline */
#else
            return ep_fail(st, EP_ERR_MODEL, "EDGEPACK_NCNN_OPTIONS: direct= is for x86 artifacts");
#endif
        } else if (sw.key == EP_NCNN_SW_POOL) {
            int shared = sw.pool == EP_NCNN_POOL_SHARED, unlocked = sw.pool == EP_NCNN_POOL_UNLOCKED;
            int arena = sw.pool == EP_NCNN_POOL_ARENA;
            int best = sw.pool == EP_NCNN_POOL_BEST || arena, one = sw.pool == EP_NCNN_POOL_ONE || best;
            ncnn_option_set_use_local_pool_allocator(e->opt, sw.pool == EP_NCNN_POOL_LOCAL);
            if (e->blob_alloc) {  /* a second pool= replaces the first */
                ncnn_option_set_blob_allocator(e->opt, NULL);
                ncnn_option_set_workspace_allocator(e->opt, NULL);
                ncnn_allocator_destroy(e->blob_alloc);
                if (e->work_alloc) ncnn_allocator_destroy(e->work_alloc);
                e->blob_alloc = e->work_alloc = NULL;
            }
            if (shared || unlocked || one) {
                e->blob_alloc = arena ? ep_ncnn_arena_pool_create(EP_NCNN_ARENA_RESERVE) : NULL;
                if (!e->blob_alloc)  /* an arena cannot be reserved under a strict overcommit policy */
                    e->blob_alloc = best       ? ep_ncnn_best_fit_pool_create(arena ? 300 : sw.slack)
                                    : unlocked ? ncnn_allocator_create_unlocked_pool_allocator()
                                               : ncnn_allocator_create_pool_allocator();
                e->work_alloc = one ? NULL : unlocked ? ncnn_allocator_create_unlocked_pool_allocator()
                                                      : ncnn_allocator_create_pool_allocator();
                if (!e->blob_alloc || (!one && !e->work_alloc)) return ep_fail(st, EP_ERR_NOMEM, "out of memory");
                ncnn_option_set_blob_allocator(e->opt, e->blob_alloc);
                ncnn_option_set_workspace_allocator(e->opt, one ? e->blob_alloc : e->work_alloc);
            }
        }
    }
    return rc;
}

static const char *indexed(const ep_model_spec *spec, const char *prefix, int i, const char *fallback) {
    char key[64];
    snprintf(key, sizeof key, "%s.%d", prefix, i);
    return ep_option_get(spec, key, fallback);
}

/* ncnn.items: how many items of a batch the graph (built at batch 1) runs one after another; 1 when
 * absent. 0 when it is malformed or not the leading dim of every input and output: each item is then
 * the k-th 1/items of every buffer. */
static int items_of(const ep_model_spec *spec) {
    const char *v = ep_option_get(spec, "ncnn.items", "1");
    char *end = NULL;
    long n = strtol(v, &end, 10);
    if (!end || *end != '\0' || n < 1 || n > INT32_MAX) return 0;
    for (int i = 0; i < spec->n_inputs + spec->n_outputs && n > 1; i++) {
        const ep_io_spec *s = i < spec->n_inputs ? &spec->inputs[i] : &spec->outputs[i - spec->n_inputs];
        if (s->ndim < 1 || s->shape[0] != n) return 0;
    }
    return (int)n;
}

/* The build's plan for the arena (option ncnn.arena_plan: the blob's index), when the engine runs on the
 * arena; 0 when set or when there is none, -1 when malformed. */
static int set_arena_plan(ncnn_engine *e, const ep_blob_file *file) {
    const char *idx = ep_option_get(e->spec, "ncnn.arena_plan", NULL);
    if (!idx) return 0;
    char *end;
    long i = strtol(idx, &end, 10);
    if (*end || i < 3 || i >= e->spec->n_model_blobs) return -1;
    const ep_blob *b = &e->spec->model_blobs[i];
    unsigned char *copy = blob_copy(file, b);
    const unsigned char *plan = copy ? copy : b->data;
    int rc = 0;
    size_t touched, live, peak;
    if (ep_ncnn_arena_stats(e->blob_alloc, &touched, &live, &peak) == 0)  /* pool= switches may replace it */
        rc = ep_ncnn_arena_set_plan(e->blob_alloc, plan, ep_blob_size(b), ncnn_option_get_num_threads(e->opt));
    free(copy);
    return rc;
}

/* The file holding the model's blobs (.param, weights, map), for reading them with pread. */
static void blob_file_open(ep_blob_file *file, const ep_model_spec *spec) {
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (int i = 0; i < spec->n_model_blobs && i < 3; i++) {
        uintptr_t p = (uintptr_t)spec->model_blobs[i].data;
        size_t n = ep_blob_size(&spec->model_blobs[i]);
        if (!n) continue;
        if (p < lo) lo = p;
        if (p + n > hi) hi = p + n;
    }
    ep_blob_file_open(file, (const void *)lo, hi > lo ? hi - lo : 0);
}

static int ncnn_open(const ep_model_spec *spec, int threads, void **out, ep_status *st) {
    *out = NULL;
    int src = ep_spec_check(spec, st);
    if (src) return src;
    if (spec->n_model_blobs < 2) return ep_fail(st, EP_ERR_MODEL, "artifact holds no ncnn model");
    ncnn_engine *e = calloc(1, sizeof *e);
    if (!e) return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    e->spec = spec;
    e->items = items_of(spec);
    if (e->items < 1) {
        free(e);
        return ep_fail(st, EP_ERR_MODEL, "option ncnn.items is not the leading dim of every input and output "
                                         "(rebuild the artifact)");
    }
    e->opt = ncnn_option_create();
    int visible = ncnn_visible_cpus();
    if (threads < 1) threads = 1;
    if (threads > visible) threads = visible;
    ncnn_option_set_num_threads(e->opt, threads);
    ncnn_option_set_use_vulkan_compute(e->opt, 0);
    if (strcmp(ep_option_get(spec, "ncnn.fp32", "0"), "1") == 0) {
        ncnn_option_set_use_fp16_packed(e->opt, 0);
        ncnn_option_set_use_fp16_storage(e->opt, 0);
        ncnn_option_set_use_fp16_arithmetic(e->opt, 0);
        ncnn_option_set_use_bf16_storage(e->opt, 0);
        ncnn_option_set_use_bf16_packed(e->opt, 0);
    }
    /* The precision ladder's middle rung: fp16 storage, fp32 arithmetic. ncnn switches fp16
     * arithmetic on by itself on every CPU that has it (armv8.2+, AVX512-FP16), so it is off
     * unless the build verified it ("1"), or this option is absent (artifacts built before it). */
    if (strcmp(ep_option_get(spec, "ncnn.fp16_arithmetic", "1"), "0") == 0)
        ncnn_option_set_use_fp16_arithmetic(e->opt, 0);
    /* ep_ncnn_pool.cc's first-fit arena for blobs and workspace instead of ncnn's first-fit local
     * pools: it stops growing after the first run and holds little more than the live tensors
     * (nudenet_320n: `fast` bench peak over 20 runs 49.2 MB with the best-fit pool, 45.4 with the
     * arena, and no slower; `lean` after a run 21.1 -> 19.2 MB; docs/backends.md, Memory) */
    int swrc = apply_switches(e, "pool=arena", st);
    if (!swrc) swrc = apply_switches(e, getenv("EDGEPACK_NCNN_OPTIONS"), st);
    if (swrc) {
        ncnn_close(e);
        return swrc;
    }
    const char *log_path = getenv("EDGEPACK_NCNN_ARENA_LOG");
    if (log_path && *log_path) {
        e->arena_log = fopen(log_path, "w");
        if (!e->arena_log) {
            ncnn_close(e);
            return ep_fail(st, EP_ERR_IO, "EDGEPACK_NCNN_ARENA_LOG: cannot write %s", log_path);
        }
        ep_ncnn_arena_log(e->blob_alloc, e->arena_log);
    }
    trace(e->blob_alloc, "start");
    e->net = ncnn_net_create();
    ncnn_net_set_option(e->net, e->opt);
    if (ep_ncnn_register_layers(e->net) != 0) {
        ncnn_close(e);
        return ep_fail(st, EP_ERR_MODEL, "ncnn refused the engine's own layers");
    }
    const ep_blob *param = &spec->model_blobs[0], *bin = &spec->model_blobs[1];
    /* blob 2: the weight map, or empty where the build made none but a plan follows */
    const ep_blob *map = spec->n_model_blobs > 2 && ep_blob_size(&spec->model_blobs[2]) ? &spec->model_blobs[2] : NULL;
    ep_blob_file file;
    blob_file_open(&file, spec);
    unsigned char *text = blob_copy(&file, param);
    int prc = ncnn_net_load_param_memory(e->net, (const char *)(text ? text : param->data));
    free(text);
    if (prc != 0) {
        ep_blob_file_close(&file);
        ncnn_close(e);
        return ep_fail(st, EP_ERR_MODEL, "ncnn rejected the embedded .param (unknown layer type?)");
    }
    size_t stream = 0;
    size_t used = load_weights(e->net, bin, map, &file, &stream);
    int plan_rc = set_arena_plan(e, &file);  /* judged after the weights: their errors come first */
    ep_blob_file_close(&file);
    if (stream == (size_t)-1) {
        ncnn_close(e);
        return ep_fail(st, EP_ERR_MODEL, "the embedded weight map is malformed (rebuild the artifact)");
    }
    if (used == (size_t)-1) {
        ncnn_close(e);
        return ep_fail(st, EP_ERR_MODEL, "ncnn could not load the embedded weights (.param and .bin disagree?)");
    }
    if (used != stream) {
        ncnn_close(e);
        return ep_fail(st, EP_ERR_MODEL, "ncnn consumed %zu of %zu weight bytes: .param and .bin disagree", used,
                       stream);
    }
    if (plan_rc) {
        ncnn_close(e);
        return ep_fail(st, EP_ERR_MODEL, "the embedded arena plan is malformed (rebuild the artifact)");
    }
    trace(e->blob_alloc, "loaded");
    *out = e;
    return EP_OK;
}

/* ONNX shape without the batch dim -> ncnn w/h/d/c. */
static int to_ncnn_dims(const ep_io_spec *s, int batch_axis, int *w, int *h, int *d, int *c, int *dims) {
    int64_t sh[EP_MAX_DIMS];
    int n = 0;
    for (int i = 0; i < s->ndim; i++)
        if (i != batch_axis) sh[n++] = s->shape[i];
    *w = *h = *d = *c = 1;
    switch (n) {
    case 0: *w = 1; break;
    case 1: *w = (int)sh[0]; break;
    case 2: *h = (int)sh[0]; *w = (int)sh[1]; break;
    case 3: *c = (int)sh[0]; *h = (int)sh[1]; *w = (int)sh[2]; break;
    case 4: *c = (int)sh[0]; *d = (int)sh[1]; *h = (int)sh[2]; *w = (int)sh[3]; break;
    default: return 0;
    }
    *dims = n == 0 ? 1 : n;
    return 1;
}

/* The axis pnnx dropped from input i (its batch axis; the build records "0", or another axis only where
 * it is of size 1: convert.py), -1 for none or for an axis the input does not have. */
static int batch_axis_of(const ep_model_spec *spec, const char *prefix, int i) {
    const char *v = indexed(spec, prefix, i, "none");
    if (v[0] < '0' || v[0] > '9' || v[1] != '\0') return -1;
    int axis = v[0] - '0';
    return axis < spec->inputs[i].ndim ? axis : -1;
}

/* Rows of the embedding table that integer input i indexes (convert.py: ncnn.in_ids.i), 0 for a float
 * input. ncnn's Embed reads its input's 32-bit words as int ids, so such an input enters ncnn as int32. */
static long long id_rows_of(const ep_model_spec *spec, int i) { return ep_option_ids(spec, "ncnn.in_ids", i); }

/* Integer ids -> the int32 words Embed reads. ONNX's Gather counts a negative id from the table's end
 * and refuses one outside it; ncnn's Embed would clamp it to a row instead, so the check is here. */
static int ids_to_words(const ep_io_spec *s, const ep_tensor *in, long long rows, int32_t *dst, size_t n,
                        ep_status *st) {
    int rc = ep_check_ids(s, in, rows, st);
    for (size_t k = 0; k < n && !rc; k++) {
        long long v = in->dtype == EP_I64 ? (long long)((const int64_t *)in->data)[k]
                                          : (long long)((const int32_t *)in->data)[k];
        dst[k] = (int32_t)(v < 0 ? v + rows : v);
    }
    return rc;
}

/* io spec s as one item of the batch sees it: the leading dim 1 where the engine runs items. */
static ep_io_spec item_spec(const ep_io_spec *s, int items) {
    ep_io_spec one = *s;
    if (items > 1) one.shape[0] = 1;
    return one;
}

/* Item k of a batch of `items` (k = 0, items = 1: the whole tensors): inputs read from, and outputs
 * written to, the k-th 1/items of each buffer. */
static int run_item(ncnn_engine *e, const ep_tensor *inputs, ep_tensor *outputs, int k, ep_status *st) {
    const ep_model_spec *spec = e->spec;
    ep_ncnn_arena_run_begin(e->blob_alloc); /* the plan counts requests from each run's first */
    ncnn_extractor_t ex = ncnn_extractor_create(e->net);
    int rc = EP_OK;
    for (int i = 0; i < spec->n_inputs && !rc; i++) {
        const ep_io_spec item = item_spec(&spec->inputs[i], e->items), *s = &item;
        size_t share = inputs[i].nbytes / (size_t)e->items;
        ep_tensor in = inputs[i];
        in.data = (unsigned char *)inputs[i].data + share * (size_t)k;
        in.nbytes = share;
        in.shape[0] = s->shape[0];
        long long rows = id_rows_of(spec, i);
        int ids = rows > 0 && (in.dtype == EP_I64 || in.dtype == EP_I32);
        if (in.dtype != EP_F32 && !ids) {
            rc = ep_fail(st, EP_ERR_INPUT, "input %s: ncnn artifacts take float32%s", s->name,
                         rows > 0 ? " or integer ids" : "");
            break;
        }
        int w, h, d, c, dims;
        if (!to_ncnn_dims(s, batch_axis_of(spec, "ncnn.in_batch", i), &w, &h, &d, &c, &dims)) {
            rc = ep_fail(st, EP_ERR_MODEL, "input %s: rank too high for ncnn", s->name);
            break;
        }
        if (ids && dims != 1) {
            rc = ep_fail(st, EP_ERR_MODEL, "input %s: integer ids enter ncnn as one row only", s->name);
            break;
        }
        /* from the blob pool, not malloc: musl hands a large block back to the kernel on free, so
         * a fresh input Mat cost one page fault per 4 KiB on every run (orientation: ~150 per run,
         * ~4% of its perf profile; docs/benchmarks.md). NULL (malloc) when a switch asked for no pool. */
        ncnn_allocator_t a = e->blob_alloc;
        ncnn_mat_t m = dims == 1 ? ncnn_mat_create_1d(w, a)
                       : dims == 2 ? ncnn_mat_create_2d(w, h, a)
                       : dims == 3 ? ncnn_mat_create_3d(w, h, c, a)
                                   : ncnn_mat_create_4d(w, h, d, c, a);
        const float *src = (const float *)in.data;
        size_t plane = (size_t)w * h * d;
        if (ids) {
            rc = ids_to_words(s, &in, rows, (int32_t *)ncnn_mat_get_data(m), plane, st);
        } else if (dims <= 2) {
            memcpy(ncnn_mat_get_data(m), src, plane * sizeof(float));
        } else {
            for (int ch = 0; ch < c; ch++)
                memcpy(ncnn_mat_get_channel_data(m, ch), src + (size_t)ch * plane, plane * sizeof(float));
        }
        if (!rc && ncnn_extractor_input(ex, indexed(spec, "ncnn.in", i, "in0"), m) != 0)
            rc = ep_fail(st, EP_ERR_MODEL, "ncnn has no input blob %s", indexed(spec, "ncnn.in", i, "in0"));
        ncnn_mat_destroy(m);
    }
    for (int i = 0; i < spec->n_outputs && !rc; i++) {
        const ep_io_spec *s = &spec->outputs[i];
        ncnn_mat_t m = NULL;
        const char *blob = indexed(spec, "ncnn.out", i, "out0");
        if (ncnn_extractor_extract(ex, blob, &m) != 0 || !m) {
            rc = ep_fail(st, EP_ERR_MODEL, "ncnn failed to compute output %s (blob %s)", s->name, blob);
            break;
        }
        int w = ncnn_mat_get_w(m), h = ncnn_mat_get_h(m), d = ncnn_mat_get_d(m), c = ncnn_mat_get_c(m);
        int dims = ncnn_mat_get_dims(m);
        size_t plane = (size_t)w * (dims >= 2 ? h : 1) * (dims >= 4 ? d : 1);
        size_t chans = dims >= 3 ? (size_t)c : 1;
        size_t want = outputs[i].nbytes / (size_t)e->items / sizeof(float);
        if (ncnn_mat_get_elemsize(m) != 4 || ncnn_mat_get_elempack(m) != 1) {
            rc = ep_fail(st, EP_ERR_MODEL, "output %s: unexpected ncnn layout (elemsize %zu, pack %d)", s->name,
                         ncnn_mat_get_elemsize(m), ncnn_mat_get_elempack(m));
        } else if (plane * chans != want) {
            rc = ep_fail(st, EP_ERR_MODEL, "output %s: ncnn produced %zu values, the model promises %zu", s->name,
                         plane * chans, want);
        } else if (outputs[i].dtype != EP_F32) {
            rc = ep_fail(st, EP_ERR_MODEL, "output %s: ncnn artifacts produce float32", s->name);
        } else {
            float *dst = (float *)outputs[i].data + want * (size_t)k;
            if (dims <= 2) {
                memcpy(dst, ncnn_mat_get_data(m), want * sizeof(float));
            } else {
                for (size_t ch = 0; ch < chans; ch++)
                    memcpy(dst + ch * plane, ncnn_mat_get_channel_data(m, (int)ch), plane * sizeof(float));
            }
        }
        ncnn_mat_destroy(m);
    }
    ncnn_extractor_destroy(ex);
    return rc;
}

static int ncnn_run(void *handle, const ep_tensor *inputs, ep_tensor *outputs, ep_status *st) {
    ncnn_engine *e = handle;
    int rc = EP_OK;
    for (int k = 0; k < e->items && !rc; k++) rc = run_item(e, inputs, outputs, k, st);
    trace(e->blob_alloc, "ran");
    return rc;
}

static void ncnn_close(void *handle) {
    ncnn_engine *e = handle;
    if (!e) return;
    if (e->net) ncnn_net_destroy(e->net);
    if (e->opt) ncnn_option_destroy(e->opt);
    if (e->blob_alloc) ncnn_allocator_destroy(e->blob_alloc);
    if (e->work_alloc) ncnn_allocator_destroy(e->work_alloc);
    if (e->arena_log) fclose(e->arena_log);
    free(e);
}

const ep_engine_ops ep_engine_ops_ncnn = {"ncnn", ncnn_open, ncnn_run, ncnn_close, ncnn_describe};
