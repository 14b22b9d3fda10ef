/* Fuzz target for the artifact's .npy parser (untrusted files from `run --input`).
 *
 * Built with -fsanitize=address,undefined. As a libFuzzer target (clang -fsanitize=fuzzer
 * -DEP_LIBFUZZER) it is coverage-guided; without libFuzzer, the shared bounded mutational driver
 * (fuzz_driver.h) runs it with the .npy header's own tokens. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ep_runtime.h"
#include "fuzz_driver.h"

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
static const char *const TOKENS[] = {"'descr'", "'<f4'", "'<i8'", "'|u1'", "'<f2'", "'|b1'", "'fortran_order'", "True",
                                     "False", "'shape'", "(", ")", ",", "99999999999999999999", "-1", "0", "L", "{",
                                     "}", "\x93NUMPY", "\x01\x00", "\x02\x00", "\xff\xff"};

int main(int argc, char **argv) {
    return fuzz_main(argc, argv, TOKENS, sizeof TOKENS / sizeof TOKENS[0], 1 << 20);
}
#endif
