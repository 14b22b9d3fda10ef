/* Numeric CSV (comma, semicolon or tab separated) for tabular models; untrusted input. */
#include "ep_io.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

EP_SIZE_OPT_BEGIN

#define EP_CSV_MAX_COLS 65536

/* Parses one field [s, e) as a number; 0 when it is not one. */
static int field_num(const char *s, const char *e, double *out) {
    while (s < e && (*s == ' ' || *s == '"')) s++;
    while (e > s && (e[-1] == ' ' || e[-1] == '"' || e[-1] == '\r')) e--;
    char buf[64];
    size_t n = (size_t)(e - s);
    if (!n || n >= sizeof buf) return 0;
    memcpy(buf, s, n);
    buf[n] = 0;
    char *end;
    errno = 0;
    double v = strtod(buf, &end);
    if (*end || errno == ERANGE) return 0;
    *out = v;
    return 1;
}

int ep_csv_parse(const char *s, size_t len, double **vals, int *rows, int *cols, ep_status *st) {
    *vals = NULL;
    *rows = *cols = 0;
    size_t cap = 0, n = 0;
    double *v = NULL;
    int line = 0, first = 1;
    size_t pos = 0;
    char sep = 0;
    while (pos < len) {
        size_t ls = pos;
        while (pos < len && s[pos] != '\n') pos++;
        size_t le = pos;
        if (pos < len) pos++;
        line++;
        while (le > ls && (s[le - 1] == '\r' || s[le - 1] == ' ')) le--;
        if (le == ls) continue;
        if (!sep) {
            sep = ',';
            for (size_t i = ls; i < le; i++)
                if (s[i] == ',' || s[i] == ';' || s[i] == '\t') {
                    sep = s[i];
                    break;
                }
        }
        int c = 0, numeric = 1;
        size_t row_start = n;
        const char *f = s + ls;
        for (size_t i = ls; i <= le; i++) {
            if (i < le && s[i] != sep) continue;
            double x;
            if (!field_num(f, s + i, &x)) numeric = 0;
            if (n == cap) {
                size_t nc = cap ? cap * 2 : 256;
                if (nc > ((size_t)1 << 28)) {
                    free(v);
                    return ep_fail(st, EP_ERR_INPUT, "CSV too large");
                }
                double *nv = realloc(v, nc * sizeof *nv);
                if (!nv) {
                    free(v);
                    return ep_fail(st, EP_ERR_NOMEM, "out of memory");
                }
                v = nv;
                cap = nc;
            }
            v[n++] = numeric ? x : 0;
            c++;
            f = s + i + 1;
            if (c > EP_CSV_MAX_COLS) {
                free(v);
                return ep_fail(st, EP_ERR_INPUT, "CSV line %d: too many columns", line);
            }
        }
        if (!numeric) {
            n = row_start;
            if (first) { /* header */
                first = 0;
                *cols = c;
                continue;
            }
            free(v);
            return ep_fail(st, EP_ERR_INPUT, "CSV line %d: a field is not a number", line);
        }
        if (*cols && c != *cols) {
            free(v);
            return ep_fail(st, EP_ERR_INPUT, "CSV line %d: %d fields, expected %d", line, c, *cols);
        }
        *cols = c;
        first = 0;
        (*rows)++;
    }
    if (!*rows) {
        free(v);
        return ep_fail(st, EP_ERR_INPUT, "CSV holds no numeric rows");
    }
    *vals = v;
    return EP_OK;
}

EP_SIZE_OPT_END
