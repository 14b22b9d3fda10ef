/* Fuzz target for the artifact's untrusted-input parsers behind `serve`: the HTTP request head,
 * JSON bodies and CSV bodies (runtimes/common/ep_http.c, ep_json.c, ep_csv.c).
 *
 * Built with -fsanitize=address,undefined. As a libFuzzer target (clang -fsanitize=fuzzer
 * -DEP_LIBFUZZER) it is coverage-guided; without libFuzzer, main() is a bounded mutational driver:
 * seeds from argv, N mutations each (deterministic PRNG). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ep_io.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ep_http_req r;
    int hl = ep_http_parse((const char *)data, size, &r);
    if (hl > 0) {
        if ((size_t)hl > size || r.method[sizeof r.method - 1] || r.path[sizeof r.path - 1] ||
            r.content_type[sizeof r.content_type - 1])
            abort();
    }
    ep_status st = {0, ""};
    ep_json d;
    if (ep_json_parse((const char *)data, size, &d, &st) == EP_OK) {
        volatile size_t acc = 0; /* walk every node: children, siblings, strings */
        for (int i = 0; i < d.n; i++) {
            if (d.nodes[i].str) acc += strlen(d.nodes[i].str);
            if (d.nodes[i].key) acc += strlen(d.nodes[i].key);
            if (d.nodes[i].type == EP_JARR) acc += (size_t)ep_json_at(&d, i, d.nodes[i].n - 1);
            if (d.nodes[i].type == EP_JOBJ) acc += (size_t)ep_json_get(&d, i, "inputs");
        }
        (void)acc;
        ep_json_free(&d);
    }
    double *vals;
    int rows, cols;
    if (ep_csv_parse((const char *)data, size, &vals, &rows, &cols, &st) == EP_OK) {
        volatile double s = 0;
        for (size_t i = 0; i < (size_t)rows * (size_t)cols; i++) s += vals[i];
        (void)s;
        free(vals);
    }
    return 0;
}

#ifndef EP_LIBFUZZER
static uint64_t rng_state = 0x2545F4914F6CDD1Dull;
static uint64_t next_rand(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static const char *const TOKENS[] = {"\r\n", "\n", "\r\n\r\n", ":", " ", "Content-Length: ", "99999999999999999",
                                     "Transfer-Encoding: chunked\r\n", "Expect: 100-continue\r\n", "HTTP/1.1",
                                     "{", "}", "[", "]", "\"", "\\u", "\\ud83d\\ude00", ",", "1e999", "-0.5e-3",
                                     "null", "true", "\"inputs\":", "\t", ";", "nan", "\x00", "\xff"};

static size_t mutate(uint8_t *buf, size_t len, size_t cap) {
    int n = 1 + (int)(next_rand() % 4);
    for (int k = 0; k < n; k++) {
        uint64_t r = next_rand();
        switch (r % 6) {
        case 0: if (len) buf[r / 8 % len] ^= (uint8_t)(1u << (r / 3 % 8)); break;
        case 1: if (len) buf[r / 8 % len] = (uint8_t)(r >> 24); break;
        case 2: if (len) len = (size_t)(r / 8 % (len + 1)); break;
        case 3: { /* duplicate a chunk (deep nesting, long lines) */
            if (!len) break;
            size_t at = r / 8 % len, cl = 1 + r / 4096 % 64;
            if (at + cl > len) cl = len - at;
            if (len + cl < cap) { memmove(buf + at + cl, buf + at, len - at); len += cl; }
            break;
        }
        case 4: {
            const char *t = TOKENS[r / 8 % (sizeof TOKENS / sizeof TOKENS[0])];
            size_t tl = strlen(t) ? strlen(t) : 1, at = len ? r / 64 % len : 0;
            if (at + tl < cap) { memcpy(buf + at, t, tl); if (at + tl > len) len = at + tl; }
            break;
        }
        default: if (len + 16 < cap) { memset(buf + len, (int)(r >> 8) & 0xff, 16); len += 16; } break;
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
    size_t cap = 1 << 18;
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
            for (int rep = 0; rep < (int)(next_rand() % 3); rep++) m = mutate(buf, m, cap); /* stack mutations */
            uint8_t *exact = malloc(m ? m : 1); /* exact-size copy: ASan flags any read past the end */
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
