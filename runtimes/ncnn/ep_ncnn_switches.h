/* EDGEPACK_NCNN_OPTIONS parsing, apart from ncnn: the list is outside input (an environment
 * variable), so it is fuzzed under ASan/UBSan (tests/fuzz/ncnn_options_fuzz.c), and the fuzz target
 * must not need libncnn. ep_engine_ncnn.c (apply_switches) applies what this parses.
 *
 * Header-only (static functions) so the engine's source list stays as it is.
 * The list: comma-separated key=value items, each under 64 bytes: winograd, sgemm, packing, fp16,
 * fp16a (fp16 arithmetic, where the CPU has it), bf16 ("1" on, anything else off), pool=best[<N>]
 * (N <= 1000, default 100), local, shared, one, unlocked or none, isa=avx512, avx2 or sse (x86: run
 * as a CPU without the extensions above it), direct=0, 1, 2 or 3 (x86: the direct convolution kernel on
 * no layer, by its break-even, on every layer it can run, by its break-even with fp32 weights). */
#ifndef EP_NCNN_SWITCHES_H
#define EP_NCNN_SWITCHES_H

#include <stdlib.h>
#include <string.h>

#include "ep_runtime.h"

typedef enum {
    EP_NCNN_SW_END = 0, /* the list is used up */
    EP_NCNN_SW_WINOGRAD,
    EP_NCNN_SW_SGEMM,
    EP_NCNN_SW_PACKING,
    EP_NCNN_SW_FP16,
    EP_NCNN_SW_BF16,
    EP_NCNN_SW_POOL,
    EP_NCNN_SW_ISA,
    EP_NCNN_SW_FP16A,
    EP_NCNN_SW_DIRECT,
} ep_ncnn_switch_key;

typedef enum {
    EP_NCNN_POOL_LOCAL = 0, /* ncnn's own per-net pools */
    EP_NCNN_POOL_NONE,      /* plain malloc */
    EP_NCNN_POOL_SHARED,    /* one PoolAllocator each for blobs and workspace */
    EP_NCNN_POOL_ONE,       /* one PoolAllocator for both */
    EP_NCNN_POOL_UNLOCKED,  /* UnlockedPoolAllocators */
    EP_NCNN_POOL_BEST,      /* ep_ncnn_pool.cc's best-fit pool (for both), with slack */
    EP_NCNN_POOL_ARENA,     /* ep_ncnn_pool.cc's first-fit arena (for both) */
} ep_ncnn_pool_kind;

typedef struct {
    ep_ncnn_switch_key key;
    int on;                 /* winograd, sgemm, packing, fp16, fp16a, bf16 */
    ep_ncnn_pool_kind pool; /* pool */
    unsigned slack;         /* pool=best<N>: a cached buffer serves requests down to 1/(1+N%) of its size */
    int isa;                /* isa: 3 avx512 (as detected), 2 avx2 (no AVX-512), 1 sse (no AVX) */
    int direct;             /* direct: 0 none, 1 by break-even, 2 every layer the kernel can run, 3 as 1 in fp32 */
} ep_ncnn_switch;

/* The next item of *list into *sw (key EP_NCNN_SW_END once the list, or a NULL list, is used up);
 * *list moves past it. EP_OK, or EP_ERR_MODEL with the offending item named in st. */
static int ep_ncnn_next_switch(const char **list, ep_ncnn_switch *sw, ep_status *st) {
    const char *p = *list;
    memset(sw, 0, sizeof *sw);
    if (!p || !*p) return EP_OK;
    const char *end = strchr(p, ',');
    size_t n = end ? (size_t)(end - p) : strlen(p);
    char item[64];
    if (n == 0 || n >= sizeof item)
        return ep_fail(st, EP_ERR_MODEL, "EDGEPACK_NCNN_OPTIONS: bad switch list near '%.20s'", p);
    memcpy(item, p, n);
    item[n] = 0;
    *list = end ? end + 1 : NULL;
    char *eq = strchr(item, '=');
    if (!eq) return ep_fail(st, EP_ERR_MODEL, "EDGEPACK_NCNN_OPTIONS: switch '%s' has no '='", item);
    *eq = 0;
    const char *k = item, *v = eq + 1;
    sw->on = strcmp(v, "1") == 0;
    if (strcmp(k, "winograd") == 0) sw->key = EP_NCNN_SW_WINOGRAD;
    else if (strcmp(k, "sgemm") == 0) sw->key = EP_NCNN_SW_SGEMM;
    else if (strcmp(k, "packing") == 0) sw->key = EP_NCNN_SW_PACKING;
    else if (strcmp(k, "fp16") == 0) sw->key = EP_NCNN_SW_FP16;
    else if (strcmp(k, "fp16a") == 0) sw->key = EP_NCNN_SW_FP16A;
    else if (strcmp(k, "bf16") == 0) sw->key = EP_NCNN_SW_BF16;
    else if (strcmp(k, "pool") == 0) {
        sw->key = EP_NCNN_SW_POOL;
        sw->slack = 100;
        if (strcmp(v, "local") == 0) sw->pool = EP_NCNN_POOL_LOCAL;
        else if (strcmp(v, "none") == 0) sw->pool = EP_NCNN_POOL_NONE;
        else if (strcmp(v, "shared") == 0) sw->pool = EP_NCNN_POOL_SHARED;
        else if (strcmp(v, "one") == 0) sw->pool = EP_NCNN_POOL_ONE;
        else if (strcmp(v, "unlocked") == 0) sw->pool = EP_NCNN_POOL_UNLOCKED;
        else if (strcmp(v, "arena") == 0) sw->pool = EP_NCNN_POOL_ARENA;
        else {
            int ok = strncmp(v, "best", 4) == 0;
            if (ok && v[4]) {
                char *end_n;
                unsigned long slack = strtoul(v + 4, &end_n, 10);
                /* digits only: strtoul would take a sign or leading blanks */
                if (v[4] < '0' || v[4] > '9' || *end_n || slack > 1000) ok = 0;
                else sw->slack = (unsigned)slack;
            }
            if (!ok) {
                sw->key = EP_NCNN_SW_END;
                return ep_fail(st, EP_ERR_MODEL,
                               "EDGEPACK_NCNN_OPTIONS: pool=%s: arena, best, local, shared, one, unlocked or none", v);
            }
            sw->pool = EP_NCNN_POOL_BEST;
        }
    } else if (strcmp(k, "isa") == 0) {
        sw->key = EP_NCNN_SW_ISA;
        if (strcmp(v, "avx512") == 0) sw->isa = 3;
        else if (strcmp(v, "avx2") == 0) sw->isa = 2;
        else if (strcmp(v, "sse") == 0) sw->isa = 1;
        else {
            sw->key = EP_NCNN_SW_END;
            return ep_fail(st, EP_ERR_MODEL, "EDGEPACK_NCNN_OPTIONS: isa=%s: avx512, avx2 or sse", v);
        }
    } else if (strcmp(k, "direct") == 0) {
        sw->key = EP_NCNN_SW_DIRECT;
        if (v[0] < '0' || v[0] > '3' || v[1]) {
            sw->key = EP_NCNN_SW_END;
            return ep_fail(st, EP_ERR_MODEL, "EDGEPACK_NCNN_OPTIONS: direct=%s: 0, 1, 2 or 3", v);
        }
        sw->direct = v[0] - '0';
        sw->on = 0;
    } else {
        return ep_fail(st, EP_ERR_MODEL, "EDGEPACK_NCNN_OPTIONS: unknown switch '%s' (winograd, sgemm, "
                       "packing, fp16, fp16a, bf16, pool, isa, direct)", k);
    }
    return EP_OK;
}

#endif
