/* .npy (format 1.0/2.0/3.0) reader and writer. The reader takes untrusted bytes: every
 * length and offset is checked before use (fuzzed under ASan, see tests/fuzz). */
#include "ep_runtime.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static int dtype_from_descr(const char *d, size_t n, ep_dtype *out) {
    static const struct { const char *descr; ep_dtype t; } table[] = {
        {"<f4", EP_F32}, {"<f8", EP_F64}, {"<i4", EP_I32}, {"<i8", EP_I64}, {"|u1", EP_U8},
        {"<u1", EP_U8},  {"|i1", EP_I8},  {"<i1", EP_I8},  {"|b1", EP_BOOL}, {"<f2", EP_F16},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (n == strlen(table[i].descr) && memcmp(d, table[i].descr, n) == 0) {
            *out = table[i].t;
            return 1;
        }
    return 0;
}

/* Find the value text after 'key': inside the header dict; returns pointer or NULL. */
static const char *find_key(const char *h, size_t n, const char *key) {
    size_t kl = strlen(key);
    for (size_t i = 0; i + kl <= n; i++) {
        if (memcmp(h + i, key, kl) == 0) {
            size_t j = i + kl;
            while (j < n && (h[j] == ' ')) j++;
            if (j < n && h[j] == ':') {
                j++;
                while (j < n && h[j] == ' ') j++;
                return j < n ? h + j : NULL;
            }
        }
    }
    return NULL;
}

int ep_npy_parse(const unsigned char *buf, size_t len, ep_tensor *out, ep_status *st) {
    memset(out, 0, sizeof *out);
    if (len < 10 || memcmp(buf, "\x93NUMPY", 6) != 0)
        return ep_fail(st, EP_ERR_INPUT, "not an .npy file (bad magic)");
    unsigned major = buf[6];
    size_t hlen, hstart;
    if (major == 1) {
        hlen = (size_t)buf[8] | ((size_t)buf[9] << 8);
        hstart = 10;
    } else if (major == 2 || major == 3) {
        if (len < 12) return ep_fail(st, EP_ERR_INPUT, ".npy header truncated");
        hlen = (size_t)buf[8] | ((size_t)buf[9] << 8) | ((size_t)buf[10] << 16) | ((size_t)buf[11] << 24);
        hstart = 12;
    } else {
        return ep_fail(st, EP_ERR_INPUT, "unsupported .npy version %u", major);
    }
    if (hlen > len - hstart || hlen > 65536) return ep_fail(st, EP_ERR_INPUT, ".npy header truncated");
    const char *h = (const char *)buf + hstart;

    const char *d = find_key(h, hlen, "'descr'");
    if (!d || *d != '\'') return ep_fail(st, EP_ERR_INPUT, ".npy header has no descr");
    const char *dend = memchr(d + 1, '\'', hlen - (size_t)(d + 1 - h));
    if (!dend) return ep_fail(st, EP_ERR_INPUT, ".npy header: bad descr");
    ep_dtype dtype;
    if (!dtype_from_descr(d + 1, (size_t)(dend - d - 1), &dtype))
        return ep_fail(st, EP_ERR_INPUT, ".npy dtype '%.*s' is not supported (little-endian numeric only)",
                       (int)(dend - d - 1 > 16 ? 16 : dend - d - 1), d + 1);

    const char *fo = find_key(h, hlen, "'fortran_order'");
    if (!fo) return ep_fail(st, EP_ERR_INPUT, ".npy header has no fortran_order");
    if ((size_t)(h + hlen - fo) >= 4 && memcmp(fo, "True", 4) == 0)
        return ep_fail(st, EP_ERR_INPUT, ".npy in Fortran order is not supported; save a C-contiguous array");

    const char *sh = find_key(h, hlen, "'shape'");
    if (!sh || *sh != '(') return ep_fail(st, EP_ERR_INPUT, ".npy header has no shape");
    int64_t shape[EP_MAX_DIMS];
    int ndim = 0;
    const char *p = sh + 1, *end = h + hlen;
    for (;;) {
        while (p < end && (*p == ' ' || *p == ',')) p++;
        if (p >= end) return ep_fail(st, EP_ERR_INPUT, ".npy header: unterminated shape");
        if (*p == ')') break;
        if (*p < '0' || *p > '9') return ep_fail(st, EP_ERR_INPUT, ".npy header: bad shape");
        int64_t v = 0;
        while (p < end && *p >= '0' && *p <= '9') {
            if (v > (INT64_MAX - 9) / 10) return ep_fail(st, EP_ERR_INPUT, ".npy header: dimension too large");
            v = v * 10 + (*p - '0');
            p++;
        }
        if (p < end && *p == 'L') p++;
        if (ndim == EP_MAX_DIMS) return ep_fail(st, EP_ERR_INPUT, ".npy: more than %d dimensions", EP_MAX_DIMS);
        shape[ndim++] = v;
    }
    int64_t count = ep_shape_count(shape, ndim);
    size_t esz = ep_dtype_size(dtype);
    size_t data_off = hstart + hlen;
    if (count < 0 || (uint64_t)count > (len - data_off) / esz)
        return ep_fail(st, EP_ERR_INPUT, ".npy data truncated: header promises %lld elements, file has %zu bytes",
                       (long long)count, len - data_off);
    int rc = ep_tensor_alloc(out, dtype, ndim, shape, st);
    if (rc) return rc;
    memcpy(out->data, buf + data_off, out->nbytes);
    return EP_OK;
}

static const char *descr_of(ep_dtype t) {
    switch (t) {
    case EP_F32: return "<f4";
    case EP_F64: return "<f8";
    case EP_I32: return "<i4";
    case EP_I64: return "<i8";
    case EP_U8: return "|u1";
    case EP_I8: return "|i1";
    case EP_BOOL: return "|b1";
    case EP_F16: return "<f2";
    default: return NULL;
    }
}

/* Written to a temporary file and renamed: a failed write never leaves a half file at path. */
int ep_npy_write_file(const char *path, const ep_tensor *t, ep_status *st) {
    char header[512]; /* EP_MAX_DIMS dims of <= 20 digits each fit with room to spare */
    if (!descr_of(t->dtype) || t->ndim < 0 || t->ndim > EP_MAX_DIMS)
        return ep_fail(st, EP_ERR_IO, "%s: cannot write a %s tensor of rank %d", path, ep_dtype_name(t->dtype), t->ndim);
    int n = snprintf(header, sizeof header, "{'descr': '%s', 'fortran_order': False, 'shape': (", descr_of(t->dtype));
    for (int i = 0; i < t->ndim; i++)
        n += snprintf(header + n, sizeof header - (size_t)n, "%lld,%s", (long long)t->shape[i],
                      (i + 1 < t->ndim) ? " " : "");
    if (t->ndim > 1) n--; /* numpy writes (1, 3) but (3,) */
    n += snprintf(header + n, sizeof header - (size_t)n, "), }");
    size_t total = 10 + (size_t)n + 1;
    size_t pad = (64 - total % 64) % 64;
    ep_outfile of;
    int rc = ep_outfile_open(&of, path, st);
    if (rc) return rc;
    FILE *f = of.f;
    unsigned short hl = (unsigned short)(n + pad + 1);
    unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)(hl & 0xff), (unsigned char)(hl >> 8)};
    int ok = fwrite(pre, 1, 10, f) == 10 && fwrite(header, 1, (size_t)n, f) == (size_t)n;
    for (size_t i = 0; ok && i < pad; i++) ok = fputc(' ', f) != EOF;
    ok = ok && fputc('\n', f) != EOF;
    ok = ok && fwrite(t->data, 1, t->nbytes, f) == t->nbytes;
    if (!ok) {
        ep_outfile_abort(&of);
        return ep_fail(st, EP_ERR_IO, "%s: write failed", path);
    }
    return ep_outfile_commit(&of, st);
}
