/* The mutational driver shared by the fuzz targets that have no libFuzzer to run them (gcc + ASan).
 *
 *   FUZZER ITERATIONS SEED_FILE...   ITERATIONS mutated inputs per seed, or "30s": 30 seconds in all
 *   EP_FUZZ_SEED=n                   another deterministic mutation stream (bench/fuzz_long.py)
 *   EP_FUZZ_CRASH_DIR=dir            the input being run is written there when the process dies
 * Prints "fuzzed N inputs" at the end; any sanitizer report or fuzz_fail() ends it non-zero. */
#ifndef EP_FUZZ_DRIVER_H
#define EP_FUZZ_DRIVER_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const uint8_t *fuzz_cur;
static size_t fuzz_cur_len;

static void fuzz_save_current(void) {
    const char *dir = getenv("EP_FUZZ_CRASH_DIR");
    if (!dir || !fuzz_cur) return;
    char path[4096];
    snprintf(path, sizeof path, "%s/crash-%ld.bin", dir, (long)time(NULL));
    FILE *f = fopen(path, "wb");
    if (!f) return;
    fwrite(fuzz_cur, 1, fuzz_cur_len, f);
    fclose(f);
    fprintf(stderr, "crashing input saved to %s\n", path);
}

static void fuzz_fail(const char *why) {
    fprintf(stderr, "fuzz invariant broken: %s\n", why);
    fuzz_save_current();
    abort();
}

#ifndef EP_LIBFUZZER
#if defined(__has_include)
#if __has_include(<sanitizer/common_interface_defs.h>)
#include <sanitizer/common_interface_defs.h>
#define EP_HAVE_SANITIZER_CALLBACK 1
#endif
#endif

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;
static uint64_t next_rand(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static size_t mutate(uint8_t *buf, size_t len, size_t cap, const char *const *tokens, size_t ntok) {
    int n = 1 + (int)(next_rand() % 4);
    for (int k = 0; k < n; k++) {
        uint64_t r = next_rand();
        switch (r % 7) {
        case 0: if (len) buf[r / 8 % len] ^= (uint8_t)(1u << (r / 3 % 8)); break;
        case 1: if (len) buf[r / 8 % len] = (uint8_t)(r >> 24); break;
        case 2: if (len) len = (size_t)(r / 8 % (len + 1)); break; /* truncate */
        case 3: { /* duplicate a chunk (repeated segments, long lines, deep nesting) */
            if (!len) break;
            size_t at = r / 8 % len, cl = 1 + r / 4096 % 64;
            if (at + cl > len) cl = len - at;
            if (len + cl < cap) { memmove(buf + at + cl, buf + at, len - at); len += cl; }
            break;
        }
        case 4: { /* overwrite with a format token */
            const char *t = tokens[r / 8 % ntok];
            size_t tl = strlen(t) ? strlen(t) : 1, at = len ? r / 64 % len : 0;
            if (at + tl < cap) { memcpy(buf + at, t, tl); if (at + tl > len) len = at + tl; }
            break;
        }
        case 5: if (len >= 2) { /* a big-endian length/size field: interesting values */
            static const uint16_t v[] = {0, 1, 2, 0x7fff, 0x8000, 0xffff, 8192, 8193};
            size_t at = r / 8 % (len - 1);
            uint16_t x = v[r / 65536 % 8];
            buf[at] = (uint8_t)(x >> 8);
            buf[at + 1] = (uint8_t)x;
            break;
        }
        default: if (len + 16 < cap) { memset(buf + len, (int)(r >> 8) & 0xff, 16); len += 16; } break;
        }
    }
    return len;
}

static double fuzz_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static int fuzz_main(int argc, char **argv, const char *const *tokens, size_t ntok, size_t cap) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s ITERATIONS|SECONDSs SEED_FILE...\n", argv[0]);
        return 2;
    }
    const char *seed_env = getenv("EP_FUZZ_SEED");
    if (seed_env) rng_state ^= strtoull(seed_env, NULL, 10) * 0x9E3779B97F4A7C15ull + 1;
#ifdef EP_HAVE_SANITIZER_CALLBACK
    __sanitizer_set_death_callback(fuzz_save_current);
#endif
    char *end;
    double amount = strtod(argv[1], &end);
    int timed = *end == 's';
    int nseeds = argc - 2;
    uint8_t **seeds = calloc((size_t)nseeds, sizeof *seeds);
    size_t *lens = calloc((size_t)nseeds, sizeof *lens);
    uint8_t *buf = malloc(cap);
    if (!seeds || !lens || !buf) return 2;
    for (int s = 0; s < nseeds; s++) {
        FILE *f = fopen(argv[s + 2], "rb");
        if (!f) { perror(argv[s + 2]); return 2; }
        seeds[s] = malloc(cap / 2);
        lens[s] = fread(seeds[s], 1, cap / 2, f);
        fclose(f);
        fuzz_cur = seeds[s];
        fuzz_cur_len = lens[s];
        LLVMFuzzerTestOneInput(seeds[s], lens[s]);
    }
    long total = 0;
    double t_end = fuzz_now() + amount;
    for (long i = 0;; i++) {
        if (timed ? (i % 64 == 0 && fuzz_now() >= t_end) : i >= (long)amount * nseeds) break;
        int s = (int)(i % nseeds);
        memcpy(buf, seeds[s], lens[s]);
        size_t m = mutate(buf, lens[s], cap, tokens, ntok);
        for (int rep = 0; rep < (int)(next_rand() % 3); rep++) m = mutate(buf, m, cap, tokens, ntok);
        uint8_t *exact = malloc(m ? m : 1); /* exact-size copy: ASan flags any read past the end */
        memcpy(exact, buf, m);
        fuzz_cur = exact;
        fuzz_cur_len = m;
        LLVMFuzzerTestOneInput(exact, m);
        fuzz_cur = NULL;
        free(exact);
        total++;
    }
    printf("fuzzed %ld inputs\n", total);
    for (int s = 0; s < nseeds; s++) free(seeds[s]);
    free(seeds);
    free(lens);
    free(buf);
    return 0;
}
#endif
#endif
