/* Fuzz target for the artifact's image path behind `serve` and `run`: our strict PNG/JPEG/PNM
 * checks (runtimes/common/ep_image.c) and then stb_image's decoder itself (Debian libstb-dev).
 *
 * Built with -fsanitize=address,undefined. As a libFuzzer target (clang -fsanitize=fuzzer
 * -DEP_LIBFUZZER) it is coverage-guided; without libFuzzer, main() is a bounded mutational driver:
 * seeds from argv, mutated with a deterministic PRNG (EP_FUZZ_SEED changes the stream), for N
 * inputs per seed or, written "30s", for that many seconds in all. EP_FUZZ_CRASH_DIR: where the
 * input that crashed is written before the process dies. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ep_server.h"

#include "fuzz_driver.h"

static long decoded, refused;

static void report(void) { printf("decoded %ld, refused %ld\n", decoded, refused); }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static int limited;
    if (!limited) { /* small enough to stay fast under ASan, large enough for every code path */
        ep_image_set_max_pixels(1u << 16);
        atexit(report);
        limited = 1;
    }
    ep_status st = {0, ""};
    int w, h;
    int checked = ep_image_check(data, size, &w, &h, &st) == EP_OK;
    for (int channels = 1; channels <= 3; channels += 2) {
        ep_tensor t;
        int rc = ep_image_decode(data, size, channels, &t, &st);
        if (rc == EP_OK) {
            /* a decoded image passed the check, has the checked size, and owns every byte it claims */
            if (!checked || t.ndim != 3 || t.shape[0] != h || t.shape[1] != w || t.shape[2] != channels ||
                t.nbytes != (size_t)w * (size_t)h * (size_t)channels)
                fuzz_fail("decoded image disagrees with its checked header");
            volatile unsigned acc = 0;
            for (size_t i = 0; i < t.nbytes; i++) acc += ((unsigned char *)t.data)[i];
            (void)acc;
            ep_tensor_free(&t);
            decoded++;
        } else if (!st.message[0] || rc != EP_ERR_INPUT) {
            fuzz_fail("a refused image must say why, as an input error");
        } else {
            refused++;
        }
    }
    return 0;
}

#ifndef EP_LIBFUZZER
static const char *const TOKENS[] = {"IHDR", "IDAT", "IEND", "PLTE", "tRNS", "\x00\x00\x00\x0d", "\xff\xff\xff\xff",
                                     "\x10", "\x08", "\x01", "\xff\xd9", "\xff\xda", "\xff\xc0", "\xff\xc2",
                                     "\xff\xc4", "\xff\xdb", "\xff\xdd", "\xff\xd0", "\xff\x00", "\xff\xff",
                                     "P5\n", "P6\n", "65535", "255", "256", "0", "8192", "99999", " ", "\n", "#x\n",
                                     "\x00\x00"};

int main(int argc, char **argv) {
    return fuzz_main(argc, argv, TOKENS, sizeof TOKENS / sizeof TOKENS[0], 1 << 20);
}
#endif
