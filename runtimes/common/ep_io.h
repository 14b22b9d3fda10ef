/* edgepack artifact runtime: raw inputs and answers (issue #5).
 *
 * ep_json.c   a small JSON parser (untrusted request bodies and the embedded manifest)
 * ep_http.c   an HTTP/1.x request-head parser (untrusted; fuzzed under ASan)
 * ep_csv.c    numeric CSV rows for tabular models
 * ep_image.c  PNG/JPEG/PPM decoding (stb_image from Debian's libstb-dev) + resize into the model input
 * ep_predict.c  baked pre/post config from the manifest, input sniffing, the JSON answer
 * ep_serve.c  `serve`: a small single-threaded HTTP server with a try-it page
 * ep_batch.c  `run --input-dir` and CSV in -> CSV/JSONL out
 * All return ep_code with a message; none exits.
 */
#ifndef EP_IO_H
#define EP_IO_H

#include "ep_detect.h"
#include "ep_runtime.h"

/* Code off the inference path (parsers, server, batch) is compiled for size whatever the build's -O. */
#if defined(__clang__)
#define EP_SIZE_OPT_BEGIN _Pragma("clang attribute push(__attribute__((minsize)), apply_to = function)")
#define EP_SIZE_OPT_END _Pragma("clang attribute pop")
#else
#define EP_SIZE_OPT_BEGIN
#define EP_SIZE_OPT_END
#endif

/* ---- JSON ------------------------------------------------------------------------------- */
typedef enum { EP_JNULL, EP_JBOOL, EP_JNUM, EP_JSTR, EP_JARR, EP_JOBJ } ep_jtype;
typedef struct {
    ep_jtype type;
    int child, next;      /* first child / next sibling (-1: none) */
    int n;                /* children */
    double num;           /* JNUM, JBOOL */
    const char *str;      /* JSTR: decoded, NUL-terminated */
    const char *key;      /* member name when the parent is an object */
} ep_jnode;
typedef struct {
    ep_jnode *nodes;
    int n, cap;
    char *strings;
    size_t spos, scap;
} ep_json;

#define EP_JSON_MAX_DEPTH 64
int ep_json_parse(const char *s, size_t len, ep_json *doc, ep_status *st); /* root = node 0 */
void ep_json_free(ep_json *doc);
int ep_json_get(const ep_json *d, int obj, const char *key); /* member index or -1 */
int ep_json_at(const ep_json *d, int arr, int i);

/* ---- HTTP ------------------------------------------------------------------------------- */
#define EP_HTTP_MAX_HEAD 16384
typedef struct {
    char method[16];
    char path[512];
    char content_type[128];
    long long content_length; /* -1 when absent */
    int chunked;
    int expect_continue;
} ep_http_req;
/* > 0: the head is complete and that many bytes long; 0: need more bytes; < 0: -(HTTP status). */
int ep_http_parse(const char *buf, size_t len, ep_http_req *r);

/* ---- CSV -------------------------------------------------------------------------------- */
/* Numeric rows; a first row with a non-number is taken as the header (skipped). *vals is malloc'd. */
int ep_csv_parse(const char *s, size_t len, double **vals, int *rows, int *cols, ep_status *st);

/* ---- images ----------------------------------------------------------------------------- */
int ep_image_sniff(const unsigned char *buf, size_t len); /* 1 when PNG/JPEG/PNM magic */
/* -> uint8 tensor [H, W, channels] */
int ep_image_decode(const unsigned char *buf, size_t len, int channels, ep_tensor *out, ep_status *st);

/* ---- baked pre/post-processing, read from the embedded manifest's "prepost" ------------- */
typedef enum { EP_RESIZE_NONE = 0, EP_RESIZE_BILINEAR = 1, EP_RESIZE_NEAREST = 2 } ep_resize;
typedef struct {
    int has_image, image_input, h, w, c, nchw, float01;
    ep_resize resize;
    int has_post, post_output, topk;
    int n_labels;
    const char **labels;
    ep_json doc; /* owns the strings */
    int has_letterbox, letterbox; /* letterbox: the pad value (0..255) of an aspect-keeping resize */
    int has_detect;               /* detection decoding + NMS over outputs[post_output] (ep_detect.c) */
    ep_det_cfg det;
} ep_prepost;
int ep_prepost_load(const ep_model_spec *spec, ep_prepost *pp, ep_status *st);
void ep_prepost_free(ep_prepost *pp);
/* uint8 HxWxC image -> the model input (resized, float32, raw layout). */
int ep_image_to_input(const ep_tensor *img, const ep_prepost *pp, const ep_io_spec *in, ep_tensor *out,
                      ep_status *st);

/* ---- inputs and answers ----------------------------------------------------------------- */
typedef enum { EP_KIND_AUTO, EP_KIND_NPY, EP_KIND_IMAGE, EP_KIND_JSON, EP_KIND_CSV } ep_kind;
ep_kind ep_sniff(const unsigned char *buf, size_t len);
/* One request/file -> spec->n_inputs tensors (converted to the spec's dtype, shapes checked). */
int ep_inputs_from_bytes(const ep_model_spec *spec, const ep_prepost *pp, const unsigned char *buf, size_t len,
                         ep_kind kind, ep_tensor *inputs, ep_status *st);
/* An already-parsed tensor for one input: the declared shape (or that shape without a leading batch
 * of 1) and the declared dtype, else EP_ERR_INPUT naming the input. pixels != 0: the input takes raw
 * pixels (baked image preprocessing), so uint8 data may be converted to its float dtype. */
int ep_coerce_input(const ep_io_spec *spec, ep_tensor *t, int pixels, ep_status *st);
void ep_write_values_json(FILE *f, const ep_tensor *t);
void ep_write_shape_json(FILE *f, const int64_t *shape, int ndim);
/* {"outputs": {...}, "top": [...]}-style body (no braces): outputs with values + top-k when baked. */
void ep_write_answer(FILE *f, const ep_model_spec *spec, const ep_prepost *pp, const ep_tensor *outputs);
void ep_free_tensors(ep_tensor *t, int n);

/* Per request: what the answer needs beyond the outputs. image_h/image_w: the decoded image's size
 * (0: the input was a tensor), so boxes map back to its pixels; raw: a detector's answer also carries
 * the raw output tensors (a classifier's always does). */
typedef struct {
    int image_h, image_w;
    int raw;
} ep_answer_ctx;
/* ep_inputs_from_bytes that also records the image size in ctx (may be NULL). */
int ep_inputs_from_bytes_ctx(const ep_model_spec *spec, const ep_prepost *pp, const unsigned char *buf, size_t len,
                             ep_kind kind, ep_tensor *inputs, ep_answer_ctx *ctx, ep_status *st);
/* ep_write_answer with a context (NULL: no image, raw tensors included): a detector answers
 * "detections": [{"label", "index", "score", "box": [x1, y1, x2, y2]}], "detect_ms" first. */
void ep_write_answer_ctx(FILE *f, const ep_model_spec *spec, const ep_prepost *pp, const ep_tensor *outputs,
                         const ep_answer_ctx *ctx);

/* CSV rows -> one run per row, written as: */
typedef enum { EP_ROWS_JSON_ARRAY = 0, EP_ROWS_CSV = 1, EP_ROWS_JSONL = 2 } ep_rows_format;
int ep_predict_csv(const ep_model_spec *spec, const ep_prepost *pp, ep_engine *e, const char *text, size_t len,
                   FILE *out, ep_rows_format format, ep_status *st);

/* ---- serve / batch ---------------------------------------------------------------------- */
typedef struct {
    const char *host;
    int port;
    double idle_timeout_s; /* 0: never */
    size_t max_body;
    int threads;
    long max_requests;     /* 0: unlimited (tests) */
} ep_serve_opts;
int ep_serve(const ep_serve_opts *o, ep_status *st);
int ep_run_batch(const char *input_dir, const char *input_csv, const char *output, int threads, ep_status *st);
extern const char ep_page_html[];

#endif
