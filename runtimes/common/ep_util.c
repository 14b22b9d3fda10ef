/* Status messages, tensors, timing and small helpers for the edgepack runtime. */
#define _GNU_SOURCE
#include "ep_runtime.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
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
        return ep_fail(st, EP_ERR_INPUT, "input %s: dtype %s, the model needs %s (shape %s)", spec->name,
                       ep_dtype_name(t->dtype), ep_dtype_name(spec->dtype), want);
    int same = t->ndim == spec->ndim;
    for (int i = 0; same && i < t->ndim; i++) same = t->shape[i] == spec->shape[i];
    if (!same)
        return ep_fail(st, EP_ERR_INPUT, "input %s: shape %s, the model needs %s", spec->name, got, want);
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

static double value_at(const ep_tensor *t, size_t i) {
    switch (t->dtype) {
    case EP_F32: return ((const float *)t->data)[i];
    case EP_F64: return ((const double *)t->data)[i];
    case EP_I32: return ((const int32_t *)t->data)[i];
    case EP_I64: return (double)((const int64_t *)t->data)[i];
    case EP_U8: return ((const uint8_t *)t->data)[i];
    case EP_I8: return ((const int8_t *)t->data)[i];
    case EP_BOOL: return ((const uint8_t *)t->data)[i] != 0;
    default: return NAN;
    }
}

double ep_max_abs_diff(const ep_tensor *a, const ep_tensor *b) {
    if (a->ndim != b->ndim) return INFINITY;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return INFINITY;
    size_t n = (size_t)ep_shape_count(a->shape, a->ndim);
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs(value_at(a, i) - value_at(b, i));
        if (isnan(d)) return INFINITY;
        if (d > m) m = d;
    }
    return m;
}

double ep_max_abs(const ep_tensor *t) {
    size_t n = (size_t)ep_shape_count(t->shape, t->ndim);
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double v = fabs(value_at(t, i));
        if (v > m) m = v;
    }
    return m;
}

double ep_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Free cores: online CPUs minus the 1-minute load average (ncnn's OpenMP collapses when
 * its threads outnumber free cores), at least 1. */
int ep_default_threads(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    double load = 0;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &load) != 1) load = 0;
        fclose(f);
    }
    long busy = (long)(load + 0.5);
    long free_cores = n - busy;
    if (free_cores < 1) free_cores = 1;
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
