/* Status messages, tensors, timing and small helpers for the edgepack runtime. */
#define _GNU_SOURCE
#include "ep_runtime.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int ep_fail(ep_status *st, int code, const char *fmt, ...) {
    if (st) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(st->message, sizeof st->message, fmt, ap);
        va_end(ap);
        st->code = code;
    }
    return code;
}

static const char *const DTYPE_NAMES[EP_DTYPE_COUNT] = {"float32", "float64", "int32", "int64",
                                                        "uint8",   "int8",    "bool",  "float16"};
static const size_t DTYPE_SIZES[EP_DTYPE_COUNT] = {4, 8, 4, 8, 1, 1, 1, 2};

const char *ep_dtype_name(ep_dtype t) { return (unsigned)t < EP_DTYPE_COUNT ? DTYPE_NAMES[t] : "?"; }
size_t ep_dtype_size(ep_dtype t) { return (unsigned)t < EP_DTYPE_COUNT ? DTYPE_SIZES[t] : 0; }

int64_t ep_shape_count(const int64_t *shape, int ndim) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return -1;
        if (shape[i] != 0 && n > INT64_MAX / shape[i]) return -1;
        n *= shape[i];
    }
    return n;
}

int ep_tensor_alloc(ep_tensor *t, ep_dtype dtype, int ndim, const int64_t *shape, ep_status *st) {
    memset(t, 0, sizeof *t);
    if (ndim < 0 || ndim > EP_MAX_DIMS) return ep_fail(st, EP_ERR_INPUT, "too many dimensions (%d)", ndim);
    int64_t count = ep_shape_count(shape, ndim);
    size_t esz = ep_dtype_size(dtype);
    if (count < 0 || esz == 0 || (uint64_t)count > SIZE_MAX / esz / 2)
        return ep_fail(st, EP_ERR_INPUT, "tensor too large");
    t->dtype = dtype;
    t->ndim = ndim;
    memcpy(t->shape, shape, sizeof(int64_t) * (size_t)ndim);
    t->nbytes = (size_t)count * esz;
    t->data = calloc(t->nbytes ? t->nbytes : 1, 1);
    if (!t->data) return ep_fail(st, EP_ERR_NOMEM, "out of memory allocating %zu bytes", t->nbytes);
    t->owned = 1;
    return EP_OK;
}

void ep_tensor_free(ep_tensor *t) {
    if (t && t->owned) free(t->data);
    if (t) memset(t, 0, sizeof *t);
}

ep_tensor *ep_tensor_array(int n) { return calloc(n > 0 ? (size_t)n : 1, sizeof(ep_tensor)); }

void ep_tensor_array_free(ep_tensor *t, int n) {
    if (!t) return;
    for (int i = 0; i < n; i++) ep_tensor_free(&t[i]);
    free(t);
}

float ep_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0) {
        float f = (float)man * 5.9604644775390625e-8f; /* subnormal (or zero): man * 2^-24, exact in float */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13); /* inf, or NaN keeping its payload */
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Straight from the double's bits (not via float, which would round twice); the same steps as
 * numpy's npy_doublebits_to_halfbits, so results match numpy bit for bit. */
uint16_t ep_double_to_half(double d) {
    uint64_t b;
    memcpy(&b, &d, sizeof b);
    uint16_t sign = (uint16_t)((b >> 48) & 0x8000u);
    uint64_t exp = b & 0x7ff0000000000000ull, sig = b & 0x000fffffffffffffull;
    if (exp >= 0x40f0000000000000ull) { /* >= 65536, inf or NaN */
        if (exp == 0x7ff0000000000000ull && sig) {
            uint16_t r = (uint16_t)(0x7c00u + (sig >> 42));
            if (r == 0x7c00u) r++; /* keep it a NaN when the top payload bits are zero */
            return (uint16_t)(sign + r);
        }
        return (uint16_t)(sign | 0x7c00u);
    }
    if (exp <= 0x3f00000000000000ull) { /* below 2^-14: subnormal half or zero */
        if (exp < 0x3e60000000000000ull) return sign;
        unsigned e = (unsigned)(exp >> 52);
        sig = (0x0010000000000000ull + sig) << (e - 998);
        if ((sig & 0x003fffffffffffffull) != 0x0010000000000000ull) sig += 0x0010000000000000ull;
        return (uint16_t)(sign + (uint16_t)(sig >> 53));
    }
    uint16_t hexp = (uint16_t)((exp - 0x3f00000000000000ull) >> 42);
    if ((sig & 0x000007ffffffffffull) != 0x0000020000000000ull) sig += 0x0000020000000000ull;
    /* a carry out of the significand bumps the exponent, up to inf: both correct */
    return (uint16_t)(sign + hexp + (uint16_t)(sig >> 42));
}

double ep_tensor_get(const ep_tensor *t, size_t i) {
    switch (t->dtype) {
    case EP_F32: return ((const float *)t->data)[i];
    case EP_F64: return ((const double *)t->data)[i];
    case EP_F16: return ep_half_to_float(((const uint16_t *)t->data)[i]);
    case EP_I32: return ((const int32_t *)t->data)[i];
    case EP_I64: return (double)((const int64_t *)t->data)[i];
    case EP_U8: return ((const uint8_t *)t->data)[i];
    case EP_I8: return ((const int8_t *)t->data)[i];
    case EP_BOOL: return ((const uint8_t *)t->data)[i] != 0;
    default: return NAN;
    }
}

/* v clamped into [lo, hi] and truncated toward zero; NaN -> 0 (casting those directly is undefined). */
static double clamp_int(double v, double lo, double hi) {
    if (isnan(v)) return 0;
    if (v < lo) return lo;
    if (v > hi) return hi;
    return trunc(v);
}

void ep_tensor_set(ep_tensor *t, size_t i, double v) {
    switch (t->dtype) {
    case EP_F32: ((float *)t->data)[i] = (float)v; break;
    case EP_F64: ((double *)t->data)[i] = v; break;
    case EP_F16: ((uint16_t *)t->data)[i] = ep_double_to_half(v); break;
    case EP_I32: ((int32_t *)t->data)[i] = (int32_t)clamp_int(v, INT32_MIN, INT32_MAX); break;
    case EP_I64: /* 2^63 is the first double above INT64_MAX */
        ((int64_t *)t->data)[i] = v >= 0x1p63 ? INT64_MAX : (int64_t)clamp_int(v, -0x1p63, 0x1p63);
        break;
    case EP_U8: ((uint8_t *)t->data)[i] = (uint8_t)clamp_int(v, 0, 255); break;
    case EP_I8: ((int8_t *)t->data)[i] = (int8_t)clamp_int(v, -128, 127); break;
    case EP_BOOL: ((uint8_t *)t->data)[i] = v != 0 && !isnan(v); break;
    default: break;
    }
}

static int check_io(const char *what, int i, const ep_io_spec *s, ep_status *st) {
    if (!s->name) return ep_fail(st, EP_ERR_MODEL, "embedded model spec damaged: %s %d has no name", what, i);
    if ((unsigned)s->dtype >= EP_DTYPE_COUNT || s->ndim < 0 || s->ndim > EP_MAX_DIMS)
        return ep_fail(st, EP_ERR_MODEL, "embedded model spec damaged: %s %d has dtype %d, rank %d", what, i,
                       (int)s->dtype, s->ndim);
    int64_t count = ep_shape_count(s->shape, s->ndim);
    if (count < 0 || (uint64_t)count > SIZE_MAX / 2 / ep_dtype_size(s->dtype))
        return ep_fail(st, EP_ERR_MODEL, "embedded model spec damaged: %s %d has an impossible shape", what, i);
    return EP_OK;
}

int ep_spec_check(const ep_model_spec *spec, ep_status *st) {
    if (spec->n_inputs < 0 || spec->n_inputs > EP_MAX_IO || spec->n_outputs < 1 || spec->n_outputs > EP_MAX_IO ||
        (spec->n_inputs && (!spec->inputs || !spec->golden_inputs)) || !spec->outputs || !spec->golden_outputs)
        return ep_fail(st, EP_ERR_MODEL, "embedded model spec damaged: %d inputs, %d outputs (allowed: 0..%d, 1..%d)",
                       spec->n_inputs, spec->n_outputs, EP_MAX_IO, EP_MAX_IO);
    if (spec->n_options < 0 || (spec->n_options && !spec->options) || spec->n_model_blobs < 0 ||
        (spec->n_model_blobs && !spec->model_blobs))
        return ep_fail(st, EP_ERR_MODEL, "embedded model spec damaged: %d options, %d model blobs", spec->n_options,
                       spec->n_model_blobs);
    for (int i = 0; i < spec->n_inputs; i++) {
        int rc = check_io("input", i, &spec->inputs[i], st);
        if (rc) return rc;
    }
    for (int i = 0; i < spec->n_outputs; i++) {
        int rc = check_io("output", i, &spec->outputs[i], st);
        if (rc) return rc;
    }
    for (int i = 0; i < spec->n_options; i++)
        if (!spec->options[i].key || !spec->options[i].value)
            return ep_fail(st, EP_ERR_MODEL, "embedded model spec damaged: option %d is empty", i);
    return EP_OK;
}

int ep_outfile_open(ep_outfile *o, const char *path, ep_status *st) {
    memset(o, 0, sizeof *o);
    const char *slash = strrchr(path, '/');
    size_t dl = slash ? (size_t)(slash - path) + 1 : 0;
    o->path = strdup(path);
    o->tmp = malloc(dl + sizeof ".edgepack-XXXXXX"); /* a short hidden name: fits however long path's name is */
    if (!o->path || !o->tmp) {
        ep_outfile_abort(o);
        return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    }
    memcpy(o->tmp, path, dl);
    memcpy(o->tmp + dl, ".edgepack-XXXXXX", sizeof ".edgepack-XXXXXX");
    int fd = mkstemp(o->tmp);
    if (fd < 0) {
        int err = errno;
        free(o->tmp);
        o->tmp = NULL;
        ep_outfile_abort(o);
        return ep_fail(st, EP_ERR_IO, "%s: cannot write (%s)", path, strerror(err));
    }
    mode_t mask = umask(0); /* the mode a plain fopen() would have given, not mkstemp's 0600 */
    umask(mask);
    if (fchmod(fd, 0666 & ~mask) != 0) { /* harmless: the file stays private */ }
    o->f = fdopen(fd, "wb");
    if (!o->f) {
        close(fd);
        ep_outfile_abort(o);
        return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    }
    return EP_OK;
}

int ep_outfile_commit(ep_outfile *o, ep_status *st) {
    int ok = o->f && fflush(o->f) == 0 && !ferror(o->f);
    ok = o->f && fclose(o->f) == 0 && ok;
    o->f = NULL;
    int err = errno;
    if (ok && rename(o->tmp, o->path) != 0) {
        ok = 0;
        err = errno;
    }
    if (!ok) {
        ep_fail(st, EP_ERR_IO, "%s: write failed (%s)", o->path, strerror(err));
        ep_outfile_abort(o);
        return EP_ERR_IO;
    }
    free(o->tmp);
    free(o->path);
    memset(o, 0, sizeof *o);
    return EP_OK;
}

void ep_outfile_abort(ep_outfile *o) {
    if (o->f) fclose(o->f);
    if (o->tmp) unlink(o->tmp);
    free(o->tmp);
    free(o->path);
    memset(o, 0, sizeof *o);
}

int ep_same_file(const char *a, const char *b) {
    struct stat x, y;
    return stat(a, &x) == 0 && stat(b, &y) == 0 && x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}

void ep_shape_str(const int64_t *shape, int ndim, char *buf, size_t len) {
    size_t used = 0;
    buf[0] = 0;
    used += (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < ndim && used < len; i++)
        used += (size_t)snprintf(buf + used, len - used, i ? ",%lld" : "%lld", (long long)shape[i]);
    if (used < len) snprintf(buf + used, len - used, "]");
}

const char *ep_option_get(const ep_model_spec *spec, const char *key, const char *fallback) {
    for (int i = 0; i < spec->n_options; i++)
        if (strcmp(spec->options[i].key, key) == 0) return spec->options[i].value;
    return fallback;
}

long long ep_option_ids(const ep_model_spec *spec, const char *prefix, int i) {
    char key[64];
    snprintf(key, sizeof key, "%s.%d", prefix, i);
    const char *v = ep_option_get(spec, key, "0");
    char *end = NULL;
    long long rows = strtoll(v, &end, 10);
    return end && *end == '\0' && rows > 0 && rows <= INT32_MAX ? rows : 0;
}

int ep_check_ids(const ep_io_spec *s, const ep_tensor *in, long long rows, ep_status *st) {
    if (rows <= 0 || (in->dtype != EP_I64 && in->dtype != EP_I32)) return EP_OK;
    size_t n = in->nbytes / ep_dtype_size(in->dtype);
    for (size_t k = 0; k < n; k++) {
        long long v = in->dtype == EP_I64 ? (long long)((const int64_t *)in->data)[k]
                                          : (long long)((const int32_t *)in->data)[k];
        if (v < -rows || v >= rows)
            return ep_fail(st, EP_ERR_INPUT, "input %s: id %lld (element %zu) is outside the embedding table's %lld rows",
                           s->name, v, k, rows);
    }
    return EP_OK;
}

int ep_read_file(const char *path, size_t max_bytes, unsigned char **data, size_t *len, ep_status *st) {
    *data = NULL;
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return ep_fail(st, EP_ERR_IO, "%s: %s", path, strerror(errno));
    size_t cap = 1 << 16, used = 0;
    unsigned char *buf = malloc(cap);
    if (!buf) {
        fclose(f);
        return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    }
    for (;;) {
        if (used == cap) {
            if (cap >= max_bytes) {
                free(buf);
                fclose(f);
                return ep_fail(st, EP_ERR_INPUT, "%s: larger than the %zu byte limit", path, max_bytes);
            }
            size_t ncap = cap * 2 > max_bytes ? max_bytes : cap * 2;
            unsigned char *nb = realloc(buf, ncap);
            if (!nb) {
                free(buf);
                fclose(f);
                return ep_fail(st, EP_ERR_NOMEM, "out of memory");
            }
            buf = nb;
            cap = ncap;
        }
        size_t n = fread(buf + used, 1, cap - used, f);
        used += n;
        if (n == 0) break;
    }
    int err = ferror(f);
    fclose(f);
    if (err) {
        free(buf);
        return ep_fail(st, EP_ERR_IO, "%s: read error", path);
    }
    *data = buf;
    *len = used;
    return EP_OK;
}

int ep_check_input(const ep_io_spec *spec, const ep_tensor *t, ep_status *st) {
    char want[128], got[128];
    ep_shape_str(spec->shape, spec->ndim, want, sizeof want);
    ep_shape_str(t->shape, t->ndim, got, sizeof got);
    if (t->dtype != spec->dtype)
        return ep_fail(st, EP_ERR_INPUT, "input %.200s: dtype %s, the model needs %s (shape %s)", spec->name,
                       ep_dtype_name(t->dtype), ep_dtype_name(spec->dtype), want);
    int same = t->ndim == spec->ndim;
    for (int i = 0; same && i < t->ndim; i++) same = t->shape[i] == spec->shape[i];
    if (!same)
        return ep_fail(st, EP_ERR_INPUT, "input %.200s: shape %s, the model needs %s", spec->name, got, want);
    return EP_OK;
}

int ep_alloc_outputs(const ep_model_spec *spec, ep_tensor *outputs, ep_status *st) {
    for (int i = 0; i < spec->n_outputs; i++) {
        const ep_io_spec *o = &spec->outputs[i];
        int rc = ep_tensor_alloc(&outputs[i], o->dtype, o->ndim, o->shape, st);
        if (rc) {
            for (int j = 0; j < i; j++) ep_tensor_free(&outputs[j]);
            return rc;
        }
    }
    return EP_OK;
}

double ep_max_abs_diff(const ep_tensor *a, const ep_tensor *b) {
    if (a->ndim != b->ndim) return INFINITY;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return INFINITY;
    size_t n = (size_t)ep_shape_count(a->shape, a->ndim);
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs(ep_tensor_get(a, i) - ep_tensor_get(b, i));
        if (isnan(d)) return INFINITY;
        if (d > m) m = d;
    }
    return m;
}

double ep_max_abs(const ep_tensor *t) {
    size_t n = (size_t)ep_shape_count(t->shape, t->ndim);
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double v = fabs(ep_tensor_get(t, i));
        if (v > m) m = v;
    }
    return m;
}

double ep_cosine(const ep_tensor *a, const ep_tensor *b) {
    if (a->ndim != b->ndim) return NAN;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return NAN;
    size_t n = (size_t)ep_shape_count(a->shape, a->ndim);
    double dot = 0, na = 0, nb = 0;
    for (size_t i = 0; i < n; i++) {
        double x = ep_tensor_get(a, i), y = ep_tensor_get(b, i);
        if (!isfinite(x) || !isfinite(y)) continue;
        dot += x * y;
        na += x * x;
        nb += y * y;
    }
    if (na == 0 || nb == 0) return na == nb ? 1.0 : 0.0;
    return dot / (sqrt(na) * sqrt(nb));
}

double ep_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* The default thread count's cap, written into the finished executable by the build after it timed
 * the artifact at 1..N threads (edgepack/thread_policy.py finds the marker and rewrites the three
 * digits; 000 = no cap). Tiny models run slower on more threads: waking them costs more than the
 * work they share. volatile: no compiler may fold the unpatched digits into the code. */
volatile const char ep_thread_cap_slot[] = "edgepack-default-threads-cap:000";

int ep_default_threads_cap(void) {
    size_t n = sizeof ep_thread_cap_slot - 1, cap = 0;
    for (size_t i = n - 3; i < n; i++) {
        char c = ep_thread_cap_slot[i];
        if (c < '0' || c > '9') return 0; /* never patched into anything but digits; treat as no cap */
        cap = cap * 10 + (size_t)(c - '0');
    }
    return (int)cap;
}

/* Free cores: online CPUs minus the busy ones (ncnn's OpenMP collapses when its threads outnumber
 * free cores), at least 1, at most the measured cap. Busy: the 1-minute load average, but no more
 * than the threads runnable right now besides this one (/proc/loadavg's "R/T" field counts the
 * reader): the average alone remembers this artifact's own earlier runs, so a loop of runs (or a
 * benchmark) on an idle machine would make the next one single-threaded. */
int ep_default_threads(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    double load = 0;
    long running = -1, total = 0;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        double l5, l15;
        int got = fscanf(f, "%lf %lf %lf %ld/%ld", &load, &l5, &l15, &running, &total);
        if (got < 1) load = 0;
        if (got < 4) running = -1;
        fclose(f);
    }
    long busy = (long)(load + 0.5);
    if (running >= 1 && busy > running - 1) busy = running - 1;
    long free_cores = n - busy;
    if (free_cores < 1) free_cores = 1;
    int cap = ep_default_threads_cap();
    if (cap > 0 && free_cores > cap) free_cores = cap;
    return (int)free_cores;
}

void ep_json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        switch (*p) {
        case '"': fputs("\\\"", f); break;
        case '\\': fputs("\\\\", f); break;
        case '\n': fputs("\\n", f); break;
        case '\r': fputs("\\r", f); break;
        case '\t': fputs("\\t", f); break;
        default:
            if (*p < 0x20) fprintf(f, "\\u%04x", *p);
            else fputc(*p, f);
        }
    }
    fputc('"', f);
}
