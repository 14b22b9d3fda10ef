/* Fuzz target for the artifact's .npy parser (untrusted files from `run --input`).
 *
 * Built with -fsanitize=address,undefined. As a libFuzzer target (clang -fsanitize=fuzzer
 * -DEP_LIBFUZZER) it is coverage-guided; without libFuzzer, main() below is a bounded
 * mutational driver: seeds from argv, N mutations each (deterministic PRNG). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ep_runtime.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ep_tensor t;
    ep_status st = {0, ""};
    if (ep_npy_parse(data, size, &t, &st) == EP_OK) {
        /* touch every byte the parser claims to own */
        volatile unsigned char acc = 0;
        for (size_t i = 0; i < t.nbytes; i++) acc ^= ((unsigned char *)t.data)[i];
        (void)acc;
        /* and every element through the one accessor pair (float16 included; UBSan checks the casts) */
        size_t n = t.nbytes / ep_dtype_size(t.dtype);
        volatile double sum = 0;
        for (size_t i = 0; i < n && i < 4096; i++) {
            double v = ep_tensor_get(&t, i);
            sum += v;
            ep_tensor_set(&t, i, v * 1e6);
        }
        (void)sum;
        ep_tensor_free(&t);
    }
    return 0;
}

#ifndef EP_LIBFUZZER
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t next_rand(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static const char *const TOKENS[] = {"'descr'", "'<f4'", "'<i8'", "'|u1'", "'<f2'", "'|b1'", "'fortran_order'", "True", "False",
                                     "'shape'", "(", ")", ",", "99999999999999999999", "-1", "0", "L", "{", "}"};

static size_t mutate(uint8_t *buf, size_t len, size_t cap) {
    int n = 1 + (int)(next_rand() % 4);
    for (int k = 0; k < n; k++) {
        uint64_t r = next_rand();
        switch (r % 6) {
        case 0: if (len) buf[r / 8 % len] ^= (uint8_t)(1u << (r / 3 % 8)); break;      /* bit flip */
        case 1: if (len) buf[r / 8 % len] = (uint8_t)(r >> 24); break;                 /* random byte */
        case 2: if (len) len = (size_t)(r / 8 % (len + 1)); break;                     /* truncate */
        case 3: if (len > 9) { buf[8] = (uint8_t)(r >> 16); buf[9] = (uint8_t)(r >> 32); } break; /* header len */
        case 4: {                                                                      /* splice a token */
            const char *t = TOKENS[r / 8 % (sizeof TOKENS / sizeof TOKENS[0])];
            size_t tl = strlen(t), at = len ? r / 64 % len : 0;
            if (at + tl < cap) { memcpy(buf + at, t, tl); if (at + tl > len) len = at + tl; }
            break;
        }
        default: if (len + 16 < cap) { memset(buf + len, (int)(r >> 8) & 0xff, 16); len += 16; } break; /* grow */
        }
    }
    return len;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s ITERATIONS SEED_FILE...\n", argv[0]);
        return 2;
    }
    long iters = strtol(argv[1], NULL, 10);
    size_t cap = 1 << 20;
    uint8_t *seed = malloc(cap), *buf = malloc(cap);
    long total = 0;
    for (int s = 2; s < argc; s++) {
        FILE *f = fopen(argv[s], "rb");
        if (!f) { perror(argv[s]); return 2; }
        size_t len = fread(seed, 1, cap / 2, f);
        fclose(f);
        LLVMFuzzerTestOneInput(seed, len);
        for (long i = 0; i < iters; i++) {
            memcpy(buf, seed, len);
            size_t m = mutate(buf, len, cap);
            /* exact-size heap copy so ASan flags any read past the end */
            uint8_t *exact = malloc(m ? m : 1);
            memcpy(exact, buf, m);
            LLVMFuzzerTestOneInput(exact, m);
            free(exact);
            total++;
        }
    }
    printf("fuzzed %ld inputs\n", total);
    free(seed);
    free(buf);
    return 0;
}
#endif
