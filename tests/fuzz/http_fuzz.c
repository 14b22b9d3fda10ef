/* Fuzz target for the artifact's untrusted-input parsers behind `serve`: the HTTP request head,
 * JSON bodies and CSV bodies (runtimes/common/ep_http.c, ep_json.c, ep_csv.c).
 *
 * Built with -fsanitize=address,undefined. As a libFuzzer target (clang -fsanitize=fuzzer
 * -DEP_LIBFUZZER) it is coverage-guided; without libFuzzer, main() is the bounded mutational driver
 * of fuzz_driver.h (N inputs per seed or "30s", deterministic PRNG). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ep_server.h"

#include "fuzz_driver.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ep_http_req r;
    int hl = ep_http_parse((const char *)data, size, &r);
    if (hl > 0) {
        if ((size_t)hl > size || r.method[sizeof r.method - 1] || r.path[sizeof r.path - 1] ||
            r.content_type[sizeof r.content_type - 1])
            fuzz_fail("request head fields not terminated");
        volatile int keep = ep_http_keep_alive((const char *)data, (size_t)hl);
        (void)keep;
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
static const char *const TOKENS[] = {"\r\n", "\n", "\r\n\r\n", ":", " ", "Content-Length: ", "99999999999999999",
                                     "Transfer-Encoding: chunked\r\n", "Expect: 100-continue\r\n", "HTTP/1.1",
                                     "HTTP/1.0", "Connection: close, keep-alive\r\n", "Connection:\r\n", ",",
                                     "{", "}", "[", "]", "\"", "\\u", "\\ud83d\\ude00", "1e999", "-0.5e-3",
                                     "null", "true", "\"inputs\":", "\t", ";", "nan", "\x00", "\xff"};

int main(int argc, char **argv) {
    return fuzz_main(argc, argv, TOKENS, sizeof TOKENS / sizeof TOKENS[0], 1 << 18);
}
#endif
