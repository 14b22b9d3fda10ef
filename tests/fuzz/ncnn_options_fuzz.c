/* Fuzz target for the ncnn engine's EDGEPACK_NCNN_OPTIONS parser (runtimes/ncnn/ep_ncnn_switches.h):
 * the list comes from the environment, outside input like any file the artifact reads.
 *
 * Built with -fsanitize=address,undefined, without libncnn (the parser is apart from it). As a
 * libFuzzer target (clang -fsanitize=fuzzer -DEP_LIBFUZZER) it is coverage-guided; without
 * libFuzzer the shared bounded mutational driver (fuzz_driver.h) runs it with the list's own tokens,
 * after a table of known lists and what they must parse to (a parser that parses wrongly fails too). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ep_runtime.h"
#include "ep_ncnn_switches.h"
#include "fuzz_driver.h"

/* Parses the NUL-terminated list as the engine does; returns the items parsed, -1 on an error.
 * Checks what must hold for any input: every item moves the cursor forward inside the list, so the
 * loop ends within strlen+1 items; fields stay in their ranges; an error names the variable. */
static int parse_all(const char *list, ep_ncnn_switch *out, int cap) {
    const char *cur = list, *stop = list + strlen(list);
    size_t bound = strlen(list) + 1;
    for (size_t i = 0; i <= bound; i++) {
        ep_ncnn_switch sw;
        ep_status st = {0, ""};
        const char *before = cur;
        int rc = ep_ncnn_next_switch(&cur, &sw, &st);
        if (rc != EP_OK) {
            if (rc != EP_ERR_MODEL || st.code != rc) fuzz_fail("an error with another code than EP_ERR_MODEL");
            if (strncmp(st.message, "EDGEPACK_NCNN_OPTIONS: ", 23) != 0) fuzz_fail("an error not naming the variable");
            if (memchr(st.message, 0, sizeof st.message) == NULL) fuzz_fail("an unterminated message");
            return -1;
        }
        if (sw.key == EP_NCNN_SW_END) return (int)i;
        if (sw.key > EP_NCNN_SW_DIRECT) fuzz_fail("key out of range");
        if (sw.on != 0 && sw.on != 1) fuzz_fail("on is neither 0 nor 1");
        if (sw.key == EP_NCNN_SW_POOL && (sw.pool > EP_NCNN_POOL_ARENA || sw.slack > 1000))
            fuzz_fail("pool kind or slack out of range");
        if (sw.key == EP_NCNN_SW_ISA && (sw.isa < 1 || sw.isa > 3)) fuzz_fail("isa level out of range");
        if (sw.direct < 0 || sw.direct > 3 || (sw.key != EP_NCNN_SW_DIRECT && sw.direct)) fuzz_fail("direct mode out of range");
        if (cur != NULL && (cur <= before || cur > stop)) fuzz_fail("the cursor did not move forward inside the list");
        if ((int)i < cap) out[i] = sw;
    }
    fuzz_fail("more items than characters");
    return -1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *list = malloc(size + 1); /* exact size + NUL: ASan flags any read past it */
    if (!list) return 0;
    memcpy(list, data, size);
    list[size] = 0;
    ep_ncnn_switch sws[4];
    parse_all(list, sws, 4);
    free(list);
    return 0;
}

#ifndef EP_LIBFUZZER
static const char *const TOKENS[] = {"winograd=", "sgemm=", "packing=", "fp16=", "bf16=", "pool=", "best", "best300",
                                     "local", "shared", "one", "unlocked", "none", "arena", "isa=", "avx2", "avx512", "sse", "=1", "=0", ",", ",,", "=",
                                     "1000", "1001", "99999999999999999999", "-1", " 5", "+5"};

/* known lists -> (items or -1 for an error, first item's key, on, pool, slack, isa level) */
static const struct {
    const char *list;
    int items, key, on, pool;
    unsigned slack;
    int isa;
    int direct;
} KNOWN[] = {
    {"", 0, 0, 0, 0, 0},
    {"winograd=0", 1, EP_NCNN_SW_WINOGRAD, 0, 0, 0},
    {"sgemm=1,packing=0", 2, EP_NCNN_SW_SGEMM, 1, 0, 0},
    {"fp16=1", 1, EP_NCNN_SW_FP16, 1, 0, 0},
    {"fp16a=0,fp16=0", 2, EP_NCNN_SW_FP16A, 0, 0, 0},
    {"fp16a=1", 1, EP_NCNN_SW_FP16A, 1, 0, 0},
    {"bf16=1,winograd=0", 2, EP_NCNN_SW_BF16, 1, 0, 0},
    {"pool=best300", 1, EP_NCNN_SW_POOL, 0, EP_NCNN_POOL_BEST, 300},
    {"pool=best", 1, EP_NCNN_SW_POOL, 0, EP_NCNN_POOL_BEST, 100},
    {"pool=best1000", 1, EP_NCNN_SW_POOL, 0, EP_NCNN_POOL_BEST, 1000},
    {"pool=local,pool=unlocked", 2, EP_NCNN_SW_POOL, 0, EP_NCNN_POOL_LOCAL, 100},
    {"pool=none", 1, EP_NCNN_SW_POOL, 0, EP_NCNN_POOL_NONE, 100},
    {"pool=arena", 1, EP_NCNN_SW_POOL, 0, EP_NCNN_POOL_ARENA, 100},
    {"isa=avx2,pool=arena", 2, EP_NCNN_SW_ISA, 0, 0, 0, 2},
    {"isa=sse", 1, EP_NCNN_SW_ISA, 0, 0, 0, 1},
    {"isa=avx512", 1, EP_NCNN_SW_ISA, 0, 0, 0, 3},
    {"isa=avx3", -1, 0, 0, 0, 0},
    {"direct=0", 1, EP_NCNN_SW_DIRECT, 0, 0, 0, 0, 0},
    {"direct=2,isa=avx2", 2, EP_NCNN_SW_DIRECT, 0, 0, 0, 0, 2},
    {"direct=3", 1, EP_NCNN_SW_DIRECT, 0, 0, 0, 0, 3},
    {"direct=4", -1, 0, 0, 0, 0},
    {"direct=12", -1, 0, 0, 0, 0},
    {"direct=", -1, 0, 0, 0, 0},
    {"pool=best1001", -1, 0, 0, 0, 0},
    {"pool=best-5", -1, 0, 0, 0, 0},
    {"pool=best 5", -1, 0, 0, 0, 0},
    {"pool=bestx", -1, 0, 0, 0, 0},
    {"pool=huge", -1, 0, 0, 0, 0},
    {"winograd", -1, 0, 0, 0, 0},
    {"turbo=1", -1, 0, 0, 0, 0},
    {"winograd=1,", 1, EP_NCNN_SW_WINOGRAD, 1, 0, 0}, /* a trailing comma ends the list */
    {"winograd=1,,sgemm=1", -1, 0, 0, 0, 0},
    {",winograd=1", -1, 0, 0, 0, 0},
    {"winograd=000000000000000000000000000000000000000000000000000000000001", -1, 0, 0, 0, 0}, /* >= 64 bytes */
};

int main(int argc, char **argv) {
    for (size_t i = 0; i < sizeof KNOWN / sizeof KNOWN[0]; i++) {
        ep_ncnn_switch sws[4];
        memset(sws, 0, sizeof sws);
        int n = parse_all(KNOWN[i].list, sws, 4);
        int ok = n == KNOWN[i].items;
        if (ok && n > 0)
            ok = (int)sws[0].key == KNOWN[i].key && sws[0].on == KNOWN[i].on &&
                 (sws[0].key != EP_NCNN_SW_POOL || ((int)sws[0].pool == KNOWN[i].pool && sws[0].slack == KNOWN[i].slack)) &&
                 (sws[0].key != EP_NCNN_SW_ISA || sws[0].isa == KNOWN[i].isa) &&
                 (sws[0].key != EP_NCNN_SW_DIRECT || sws[0].direct == KNOWN[i].direct);
        if (!ok) {
            fprintf(stderr, "known list '%s': parsed %d items (key %d on %d pool %d slack %u), expected %d\n",
                    KNOWN[i].list, n, sws[0].key, sws[0].on, sws[0].pool, sws[0].slack, KNOWN[i].items);
            return 1;
        }
    }
    printf("known lists: %zu parsed as expected\n", sizeof KNOWN / sizeof KNOWN[0]);
    return fuzz_main(argc, argv, TOKENS, sizeof TOKENS / sizeof TOKENS[0], 1 << 12);
}
#endif
