/* edgepack artifact runtime: the parts shared by every backend.
 *
 * Library code here never calls exit(): every function returns an ep_code and fills an
 * ep_status with a one-line message. ep_main.c holds main() so tests can link the rest.
 */
#ifndef EP_RUNTIME_H
#define EP_RUNTIME_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EP_MAX_DIMS 8
/* Sanity bound on a spec's input/output count, checked in ep_engine_open (ep_spec_check):
 * everything indexed by these counts is heap-allocated from them, this only catches damage. */
#define EP_MAX_IO 65536

typedef enum {
    EP_OK = 0,
    EP_ERR_USAGE = 2,    /* bad command line */
    EP_ERR_INPUT = 3,    /* bad input file / shape / dtype */
    EP_ERR_MODEL = 4,    /* the embedded model failed to load or run */
    EP_ERR_IO = 5,       /* reading or writing a file failed */
    EP_ERR_NOMEM = 6,
} ep_code;

typedef struct {
    int code;
    char message[512];
} ep_status;

/* 1 when running under qemu-user (why: a short reason), else 0: see ep_emulation.c */
int ep_emulated(char *why, size_t n);

int ep_fail(ep_status *st, int code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

typedef enum { EP_F32 = 0, EP_F64, EP_I32, EP_I64, EP_U8, EP_I8, EP_BOOL, EP_F16, EP_DTYPE_COUNT } ep_dtype;

const char *ep_dtype_name(ep_dtype t);
size_t ep_dtype_size(ep_dtype t);

typedef struct {
    ep_dtype dtype;
    int ndim;
    int64_t shape[EP_MAX_DIMS];
    void *data;      /* owned when owned != 0 */
    size_t nbytes;
    int owned;
} ep_tensor;

int64_t ep_shape_count(const int64_t *shape, int ndim);
int ep_tensor_alloc(ep_tensor *t, ep_dtype dtype, int ndim, const int64_t *shape, ep_status *st);
void ep_tensor_free(ep_tensor *t);
void ep_shape_str(const int64_t *shape, int ndim, char *buf, size_t len);
/* n zeroed tensors on the heap (never a fixed array: n comes from the model); NULL when out of memory. */
ep_tensor *ep_tensor_array(int n);
/* Frees the tensors' data and the array itself. */
void ep_tensor_array_free(ep_tensor *t, int n);

/* The one accessor pair for every dtype (float16 included): element i as a double, and set from a
 * double (integers saturate and truncate toward zero, NaN -> 0, bool: v != 0). */
double ep_tensor_get(const ep_tensor *t, size_t i);
void ep_tensor_set(ep_tensor *t, size_t i, double v);
/* IEEE 754 binary16 <-> binary32/64, round-to-nearest-even, bit-exact with numpy's astype. */
float ep_half_to_float(uint16_t h);
uint16_t ep_double_to_half(double d);

/* ---- what the build embedded ------------------------------------------------------------ */
typedef struct {
    const unsigned char *data;
    const uint64_t *size; /* defined next to the data by the generated assembler file */
} ep_blob;

typedef struct {
    const char *name;
    ep_dtype dtype;
    int ndim;
    int64_t shape[EP_MAX_DIMS];
} ep_io_spec;

typedef struct {
    const char *key;
    const char *value;
} ep_option;

typedef struct {
    const char *model_name;
    const char *target;
    const char *backend;
    int n_inputs;
    const ep_io_spec *inputs;
    int n_outputs;
    const ep_io_spec *outputs;
    double atol, rtol;          /* selftest passes when max|a-b| <= atol + rtol*max|ref| */
    double min_cosine;          /* ... and cosine(a, ref) >= min_cosine where ref is not ~0 (the build's policy) */
    int n_options;
    const ep_option *options;   /* backend settings, e.g. ncnn blob names */
    ep_blob manifest_json;
    const ep_blob *golden_inputs;   /* .npy bytes, one per input */
    const ep_blob *golden_outputs;  /* .npy bytes, one per output */
    int n_model_blobs;
    const ep_blob *model_blobs;     /* backend-specific (ncnn: param text, weights) */
    const void *loop_body;          /* a loop segment's ep_loop_body (ep_engine_table.h), else NULL */
} ep_model_spec;

extern const ep_model_spec ep_spec; /* generated per artifact */

const char *ep_option_get(const ep_model_spec *spec, const char *key, const char *fallback);
/* The extent integer input i indexes (option "<prefix>.<i>", a positive integer up to INT32_MAX), 0 for none. */
long long ep_option_ids(const ep_model_spec *spec, const char *prefix, int i);
/* Integer ids against the extent they index, as ONNX's Gather takes them: -rows..rows-1, a negative id
 * counted from the end. Engines whose kernels would read outside the table refuse the input here. */
int ep_check_ids(const ep_io_spec *s, const ep_tensor *in, long long rows, ep_status *st);
static inline size_t ep_blob_size(const ep_blob *b) { return b->size ? (size_t)*b->size : 0; }

/* ---- .npy ------------------------------------------------------------------------------- */
/* Parse an .npy image in memory into a tensor that owns a copy of the data. */
int ep_npy_parse(const unsigned char *buf, size_t len, ep_tensor *out, ep_status *st);
int ep_npy_write_file(const char *path, const ep_tensor *t, ep_status *st);
int ep_read_file(const char *path, size_t max_bytes, unsigned char **data, size_t *len, ep_status *st);

/* ---- the backend engine ----------------------------------------------------------------- */
typedef struct ep_engine ep_engine;
int ep_engine_open(const ep_model_spec *spec, int threads, ep_engine **out, ep_status *st);
/* inputs: spec->n_inputs tensors in spec order, shapes/dtypes already checked.
 * outputs: spec->n_outputs tensors allocated by the caller with the spec's shapes. An output whose
 * length the model computes (a decoder's) comes back with that axis shortened (shape and nbytes);
 * the next run restores the spec's shape first, so the same tensors serve every run. */
int ep_engine_run(ep_engine *e, const ep_tensor *inputs, ep_tensor *outputs, ep_status *st);
void ep_engine_close(ep_engine *e);
const char *ep_engine_describe(void); /* e.g. "ncnn 1.0.20261020" */

/* Every count and shape in the spec is sane (called by each engine's ep_engine_open). */
int ep_spec_check(const ep_model_spec *spec, ep_status *st);

/* ---- files written by the CLI: never half-written, never over an input --------------------- */
/* A temporary file next to `path` (same folder, so the final rename is atomic). */
typedef struct {
    char *path, *tmp;
    FILE *f;
} ep_outfile;
int ep_outfile_open(ep_outfile *o, const char *path, ep_status *st);
int ep_outfile_commit(ep_outfile *o, ep_status *st); /* flush, close, rename over path */
void ep_outfile_abort(ep_outfile *o);                 /* close and remove the temporary file */
/* 1 when both paths name one existing file (symlinks followed, hard links included). */
int ep_same_file(const char *a, const char *b);

/* ---- shared helpers used by the CLI ----------------------------------------------------- */
int ep_check_input(const ep_io_spec *spec, const ep_tensor *t, ep_status *st);
int ep_alloc_outputs(const ep_model_spec *spec, ep_tensor *outputs, ep_status *st);
double ep_max_abs_diff(const ep_tensor *a, const ep_tensor *b);
double ep_max_abs(const ep_tensor *t);
/* Cosine similarity of a and b over the elements where both are finite; NAN for different shapes,
 * 0 where one is all zeros (and the other is not), 1 where both are. */
double ep_cosine(const ep_tensor *a, const ep_tensor *b);
double ep_now_ms(void);
int ep_default_threads(void);
int ep_default_threads_cap(void); /* 0: no cap (every free core) */
void ep_json_string(FILE *f, const char *s);

int ep_cli(int argc, char **argv);

#ifdef __cplusplus
}
#endif
#endif
