/* From raw bytes to model inputs, and from outputs to the JSON answer; shared by run, batch and serve. */
#include "ep_io.h"

#include <stdio.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

EP_SIZE_OPT_BEGIN

static int io_index(const ep_io_spec *ios, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (strcmp(ios[i].name, name) == 0) return i;
    return -1;
}

static double num_or(const ep_json *d, int obj, const char *key, double dflt) {
    int v = ep_json_get(d, obj, key);
    return v >= 0 && (d->nodes[v].type == EP_JNUM || d->nodes[v].type == EP_JBOOL) ? d->nodes[v].num : dflt;
}

/* postprocess.detect of the manifest (edgepack/prepost/graph.py writes it) -> pp->det, checked. */
static int load_detect(const ep_model_spec *spec, ep_prepost *pp, int det, ep_status *st) {
    const ep_json *d = &pp->doc;
    ep_det_cfg *c = &pp->det;
    int fmt = ep_json_get(d, det, "format"), size = ep_json_get(d, det, "input_size");
    int strides = ep_json_get(d, det, "strides");
    if (fmt < 0 || d->nodes[fmt].type != EP_JSTR) return ep_fail(st, EP_ERR_MODEL, "embedded detection settings damaged");
    const char *f = d->nodes[fmt].str;
    c->format = !strcmp(f, "yolov8") ? EP_DET_YOLOV8 : !strcmp(f, "yolov5") ? EP_DET_YOLOV5 : EP_DET_YOLOX;
    if (strcmp(f, "yolov8") && strcmp(f, "yolov5") && strcmp(f, "yolox"))
        return ep_fail(st, EP_ERR_MODEL, "embedded detection format %.40s is not known to this runtime", f);
    c->classes = (int)num_or(d, det, "classes", 0);
    c->anchors = (int)num_or(d, det, "anchors", 0);
    c->channels_first = num_or(d, det, "channels_first", 0) != 0;
    c->grid = num_or(d, det, "grid", 0) != 0;
    c->agnostic = num_or(d, det, "agnostic", 0) != 0;
    c->max_det = (int)num_or(d, det, "max_det", 100);
    c->conf = (float)num_or(d, det, "conf", 0.25);
    c->iou = (float)num_or(d, det, "iou", 0.45);
    if (size >= 0 && d->nodes[size].type == EP_JARR && d->nodes[size].n == 2) {
        c->in_h = (int)d->nodes[ep_json_at(d, size, 0)].num;
        c->in_w = (int)d->nodes[ep_json_at(d, size, 1)].num;
    }
    if (strides >= 0 && d->nodes[strides].type == EP_JARR && d->nodes[strides].n <= EP_DET_MAX_STRIDES)
        for (int k = d->nodes[strides].child; k >= 0; k = d->nodes[k].next) c->strides[c->n_strides++] = (int)d->nodes[k].num;
    int rc = ep_detect_check(c, st);
    if (rc) return rc;
    const ep_io_spec *o = &spec->outputs[pp->post_output];
    int64_t want = (int64_t)c->anchors * (c->classes + (c->format == EP_DET_YOLOV8 ? 4 : 5));
    if (ep_shape_count(o->shape, o->ndim) != want)
        return ep_fail(st, EP_ERR_MODEL, "embedded detection settings do not match output %.200s", o->name);
    pp->has_detect = 1;
    pp->has_post = 0; /* boxes, not top-k (CSV rows and the answer look at has_post) */
    return EP_OK;
}

int ep_prepost_load(const ep_model_spec *spec, ep_prepost *pp, ep_status *st) {
    memset(pp, 0, sizeof *pp);
    const ep_blob *m = &spec->manifest_json;
    if (ep_json_parse((const char *)m->data, ep_blob_size(m), &pp->doc, st))
        return ep_fail(st, EP_ERR_MODEL, "embedded manifest damaged: %s", st->message);
    ep_json *d = &pp->doc;
    int cfg = ep_json_get(d, 0, "prepost");
    if (cfg < 0) return EP_OK;
    int pre = ep_json_get(d, cfg, "preprocess"), post = ep_json_get(d, cfg, "postprocess");
    if (pre >= 0) {
        int in = ep_json_get(d, pre, "input"), size = ep_json_get(d, pre, "size");
        int ch = ep_json_get(d, pre, "channels"), lay = ep_json_get(d, pre, "layout");
        int dt = ep_json_get(d, pre, "dtype"), rs = ep_json_get(d, pre, "resize");
        if (in < 0 || size < 0 || ch < 0 || lay < 0 || dt < 0 || rs < 0 || d->nodes[in].type != EP_JSTR ||
            d->nodes[size].n != 2 || d->nodes[lay].type != EP_JSTR || d->nodes[dt].type != EP_JSTR ||
            d->nodes[rs].type != EP_JSTR)
            return ep_fail(st, EP_ERR_MODEL, "embedded preprocessing settings damaged");
        pp->has_image = 1;
        pp->image_input = io_index(spec->inputs, spec->n_inputs, d->nodes[in].str);
        pp->h = (int)d->nodes[ep_json_at(d, size, 0)].num;
        pp->w = (int)d->nodes[ep_json_at(d, size, 1)].num;
        pp->c = (int)d->nodes[ch].num;
        pp->nchw = strcmp(d->nodes[lay].str, "nchw") == 0;
        pp->float01 = strcmp(d->nodes[dt].str, "float32") == 0;
        const char *r = d->nodes[rs].str;
        pp->resize = strcmp(r, "none") == 0      ? EP_RESIZE_NONE
                     : strcmp(r, "nearest") == 0 ? EP_RESIZE_NEAREST
                                                 : EP_RESIZE_BILINEAR;
        if (pp->image_input < 0 || pp->h <= 0 || pp->w <= 0 || (pp->c != 1 && pp->c != 3))
            return ep_fail(st, EP_ERR_MODEL, "embedded preprocessing settings damaged");
        int lb = ep_json_get(d, pre, "letterbox"); /* absent in artifacts built before it existed */
        if (lb >= 0 && d->nodes[lb].type == EP_JNUM && d->nodes[lb].num >= 0) {
            if (d->nodes[lb].num > 255 || pp->resize == EP_RESIZE_NONE)
                return ep_fail(st, EP_ERR_MODEL, "embedded preprocessing settings damaged (letterbox)");
            pp->has_letterbox = 1;
            pp->letterbox = (int)d->nodes[lb].num;
        }
    }
    if (post >= 0) {
        int out = ep_json_get(d, post, "output"), k = ep_json_get(d, post, "topk");
        int labels = ep_json_get(d, post, "labels");
        pp->has_post = 1;
        pp->post_output = out >= 0 && d->nodes[out].type == EP_JSTR
                              ? io_index(spec->outputs, spec->n_outputs, d->nodes[out].str) : 0;
        if (pp->post_output < 0) pp->post_output = 0;
        pp->topk = k >= 0 ? (int)d->nodes[k].num : 0;
        if (labels >= 0 && d->nodes[labels].type == EP_JARR && d->nodes[labels].n > 0) {
            pp->labels = calloc((size_t)d->nodes[labels].n, sizeof(char *));
            if (!pp->labels) return ep_fail(st, EP_ERR_NOMEM, "out of memory");
            for (int c = d->nodes[labels].child; c >= 0; c = d->nodes[c].next)
                pp->labels[pp->n_labels++] = d->nodes[c].type == EP_JSTR ? d->nodes[c].str : "";
        }
        int det = ep_json_get(d, post, "detect");
        if (det >= 0 && d->nodes[det].type == EP_JOBJ) return load_detect(spec, pp, det, st);
    }
    return EP_OK;
}

void ep_prepost_free(ep_prepost *pp) {
    free(pp->labels);
    ep_json_free(&pp->doc);
    memset(pp, 0, sizeof *pp);
}

int ep_image_sniff(const unsigned char *b, size_t len) {
    if (len >= 8 && memcmp(b, "\x89PNG\r\n\x1a\n", 8) == 0) return 1;
    if (len >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF) return 1;
    if (len >= 3 && b[0] == 'P' && (b[1] == '5' || b[1] == '6') &&
        (b[2] == ' ' || b[2] == '\n' || b[2] == '\r' || b[2] == '\t'))
        return 1;
    return 0;
}

/* uint8 HxWxC -> the model input: edgepack's own resize (half-pixel centres, no antialiasing),
 * the same arithmetic as edgepack/prepost.py:resize_image. Kept at -O2: it runs per request. */
EP_SIZE_OPT_END
int ep_image_to_input(const ep_tensor *img, const ep_prepost *pp, const ep_io_spec *in, ep_tensor *out,
                      ep_status *st) {
    int ih = (int)img->shape[0], iw = (int)img->shape[1], c = (int)img->shape[2];
    int h = pp->h, w = pp->w;
    if (c != pp->c) return ep_fail(st, EP_ERR_INPUT, "image has %d channels, the model takes %d", c, pp->c);
    if ((ih != h || iw != w) && pp->resize == EP_RESIZE_NONE)
        return ep_fail(st, EP_ERR_INPUT, "image is %dx%d, the model takes %dx%d (built with resize=none)", iw, ih, w, h);
    int rc = ep_tensor_alloc(out, EP_F32, in->ndim, in->shape, st);
    if (rc) return rc;
    if ((size_t)h * w * c * sizeof(float) != out->nbytes) {
        ep_tensor_free(out);
        return ep_fail(st, EP_ERR_MODEL, "embedded preprocessing does not match the model input");
    }
    const uint8_t *src = (const uint8_t *)img->data;
    float *dst = (float *)out->data;
    float k = pp->float01 ? 1.0f / 255.0f : 1.0f;
    /* letterbox: the image resized to nh x nw at (top, left), the rest the pad value */
    ep_det_geom g;
    ep_det_geometry(ih, iw, h, w, pp->has_letterbox ? pp->letterbox : -1, &g);
    if (pp->has_letterbox) {
        float pad = (float)pp->letterbox * k;
        for (size_t i = 0; i < (size_t)h * w * c; i++) dst[i] = pad;
    }
    int oh = h, ow = w; /* the input's size, for the layout */
    h = g.nh;
    w = g.nw;
    float sy = (float)((double)ih / h), sx = (float)((double)iw / w);
    for (int y = 0; y < h; y++) {
        int y0, y1;
        float fy;
        if (pp->resize == EP_RESIZE_NEAREST) {
            y0 = y1 = (int)(((double)y + 0.5) * ih / h);
            if (y0 > ih - 1) y0 = y1 = ih - 1;
            fy = 0;
        } else {
            float s = ((float)y + 0.5f) * sy - 0.5f;
            if (s < 0) s = 0;
            y0 = (int)s;
            if (y0 > ih - 1) y0 = ih - 1;
            y1 = y0 + 1 < ih ? y0 + 1 : ih - 1;
            fy = s - (float)y0;
        }
        for (int x = 0; x < w; x++) {
            int x0, x1;
            float fx;
            if (pp->resize == EP_RESIZE_NEAREST) {
                x0 = x1 = (int)(((double)x + 0.5) * iw / w);
                if (x0 > iw - 1) x0 = x1 = iw - 1;
                fx = 0;
            } else {
                float s = ((float)x + 0.5f) * sx - 0.5f;
                if (s < 0) s = 0;
                x0 = (int)s;
                if (x0 > iw - 1) x0 = iw - 1;
                x1 = x0 + 1 < iw ? x0 + 1 : iw - 1;
                fx = s - (float)x0;
            }
            for (int ch = 0; ch < c; ch++) {
                float a = src[((size_t)y0 * iw + x0) * c + ch], b = src[((size_t)y0 * iw + x1) * c + ch];
                float d = src[((size_t)y1 * iw + x0) * c + ch], e = src[((size_t)y1 * iw + x1) * c + ch];
                float top = a * (1 - fx) + b * fx, bot = d * (1 - fx) + e * fx;
                float v = (top * (1 - fy) + bot * fy) * k;
                size_t oy = (size_t)(y + g.top), ox = (size_t)(x + g.left);
                size_t at = pp->nchw ? ((size_t)ch * oh + oy) * ow + ox : (oy * ow + ox) * c + ch;
                dst[at] = v;
            }
        }
    }
    return EP_OK;
}
EP_SIZE_OPT_BEGIN

ep_kind ep_sniff(const unsigned char *b, size_t len) {
    if (len >= 6 && memcmp(b, "\x93NUMPY", 6) == 0) return EP_KIND_NPY;
    if (ep_image_sniff(b, len)) return EP_KIND_IMAGE;
    size_t i = 0;
    while (i < len && (b[i] == ' ' || b[i] == '\n' || b[i] == '\r' || b[i] == '\t')) i++;
    if (i < len && (b[i] == '{' || b[i] == '[')) return EP_KIND_JSON;
    return EP_KIND_CSV;
}

/* The declared shape, or (allowed) the declared shape without its leading batch dim of 1. */
static int shape_matches(const ep_io_spec *spec, const ep_tensor *t) {
    int skip = t->ndim == spec->ndim - 1 && spec->ndim > 0 && spec->shape[0] == 1 ? 1 : 0;
    if (t->ndim + skip != spec->ndim) return 0;
    for (int i = 0; i < t->ndim; i++)
        if (t->shape[i] != spec->shape[i + skip]) return 0;
    return 1;
}

int ep_coerce_input(const ep_io_spec *spec, ep_tensor *t, int pixels, ep_status *st) {
    if (!shape_matches(spec, t)) {
        char a[128], b[128];
        ep_shape_str(t->shape, t->ndim, a, sizeof a);
        ep_shape_str(spec->shape, spec->ndim, b, sizeof b);
        return ep_fail(st, EP_ERR_INPUT, "input %.200s: shape %s, the model needs %s", spec->name, a, b);
    }
    if (t->dtype != spec->dtype) {
        if (!(pixels && t->dtype == EP_U8 && (spec->dtype == EP_F32 || spec->dtype == EP_F16 || spec->dtype == EP_F64)))
            return ep_fail(st, EP_ERR_INPUT, "input %.200s: dtype %s, the model needs %s (convert the data first%s)",
                           spec->name, ep_dtype_name(t->dtype), ep_dtype_name(spec->dtype),
                           pixels ? "; raw pixels may be uint8" : "");
        /* raw uint8 pixels into the float input of baked image preprocessing: exact */
        ep_tensor c;
        int rc = ep_tensor_alloc(&c, spec->dtype, spec->ndim, spec->shape, st);
        if (rc) return rc;
        for (size_t i = 0; i < c.nbytes / ep_dtype_size(c.dtype); i++) ep_tensor_set(&c, i, ep_tensor_get(t, i));
        ep_tensor_free(t);
        *t = c;
    }
    t->ndim = spec->ndim; /* adds the leading batch dim when it was left out */
    memcpy(t->shape, spec->shape, sizeof t->shape);
    return ep_check_input(spec, t, st);
}

/* Nested JSON arrays of numbers -> a tensor of dtype `dt` (shape from the nesting). */
static int json_tensor(const ep_json *d, int node, ep_dtype dt, ep_tensor *out, ep_status *st) {
    int64_t shape[EP_MAX_DIMS];
    int nd = 0;
    int cur = node;
    while (d->nodes[cur].type == EP_JARR) {
        if (nd == EP_MAX_DIMS) return ep_fail(st, EP_ERR_INPUT, "JSON tensor has too many dimensions");
        shape[nd++] = d->nodes[cur].n;
        if (d->nodes[cur].n == 0) break;
        cur = d->nodes[cur].child;
    }
    if (d->nodes[cur].type != EP_JNUM && d->nodes[cur].type != EP_JBOOL && !(nd && shape[nd - 1] == 0))
        return ep_fail(st, EP_ERR_INPUT, "JSON tensor: expected (nested arrays of) numbers");
    int rc = ep_tensor_alloc(out, dt, nd, shape, st);
    if (rc) return rc;
    size_t count = (size_t)ep_shape_count(shape, nd), k = 0;
    /* iterative walk: every array at depth i must have shape[i] members, leaves at depth nd */
    int stack[EP_MAX_DIMS + 1], depth = 0;
    stack[0] = node;
    int pos = node;
    (void)pos;
    int it[EP_MAX_DIMS + 1];
    it[0] = -2;
    while (depth >= 0) {
        int n = stack[depth];
        if (depth == nd) {
            const ep_jnode *leaf = &d->nodes[n];
            if ((leaf->type != EP_JNUM && leaf->type != EP_JBOOL) || k >= count) {
                ep_tensor_free(out);
                return ep_fail(st, EP_ERR_INPUT, "JSON tensor is not rectangular or holds non-numbers");
            }
            ep_tensor_set(out, k++, leaf->num);
            depth--;
            continue;
        }
        if (it[depth] == -2) {
            if (d->nodes[n].type != EP_JARR || d->nodes[n].n != shape[depth]) {
                ep_tensor_free(out);
                return ep_fail(st, EP_ERR_INPUT, "JSON tensor is not rectangular");
            }
            it[depth] = d->nodes[n].child;
        } else {
            it[depth] = d->nodes[it[depth]].next;
        }
        if (it[depth] < 0) {
            it[depth] = -2;
            depth--;
            continue;
        }
        stack[depth + 1] = it[depth];
        it[depth + 1] = -2;
        depth++;
    }
    if (k != count) {
        ep_tensor_free(out);
        return ep_fail(st, EP_ERR_INPUT, "JSON tensor is not rectangular");
    }
    return EP_OK;
}

void ep_free_tensors(ep_tensor *t, int n) {
    for (int i = 0; i < n; i++) ep_tensor_free(&t[i]);
}

/* The callers of the context-free API (run, run --input-dir) decode and answer on one thread, one
 * input at a time: the size of the image this thread decoded last stands in for their context, so
 * their boxes map back to the image too. */
static _Thread_local ep_answer_ctx last_input;

int ep_inputs_from_bytes(const ep_model_spec *spec, const ep_prepost *pp, const unsigned char *buf, size_t len,
                         ep_kind kind, ep_tensor *inputs, ep_status *st) {
    return ep_inputs_from_bytes_ctx(spec, pp, buf, len, kind, inputs, &last_input, st);
}

int ep_inputs_from_bytes_ctx(const ep_model_spec *spec, const ep_prepost *pp, const unsigned char *buf, size_t len,
                             ep_kind kind, ep_tensor *inputs, ep_answer_ctx *ctx, ep_status *st) {
    memset(inputs, 0, sizeof(ep_tensor) * (size_t)spec->n_inputs);
    if (ctx) ctx->image_h = ctx->image_w = 0;
    if (kind == EP_KIND_AUTO) kind = ep_sniff(buf, len);
    int rc = EP_OK;
    if (kind == EP_KIND_NPY || kind == EP_KIND_IMAGE) {
        if (spec->n_inputs != 1)
            return ep_fail(st, EP_ERR_INPUT, "the model has %d inputs: send JSON {\"name\": [...], ...}", spec->n_inputs);
        if (kind == EP_KIND_NPY) {
            rc = ep_npy_parse(buf, len, &inputs[0], st);
        } else {
            if (!pp->has_image)
                return ep_fail(st, EP_ERR_INPUT, "this model takes no images (build it with --preprocess image:...)");
            ep_tensor img;
            rc = ep_image_decode(buf, len, pp->c, &img, st);
            if (rc) return rc;
            rc = ep_image_to_input(&img, pp, &spec->inputs[0], &inputs[0], st);
            if (ctx) {
                ctx->image_h = (int)img.shape[0];
                ctx->image_w = (int)img.shape[1];
            }
            ep_tensor_free(&img);
        }
    } else if (kind == EP_KIND_JSON) {
        ep_json d;
        rc = ep_json_parse((const char *)buf, len, &d, st);
        if (rc) return rc;
        int root = 0;
        int wrapped = ep_json_get(&d, 0, "inputs");
        if (wrapped >= 0) root = wrapped;
        if (d.nodes[root].type == EP_JARR) {
            if (spec->n_inputs != 1)
                rc = ep_fail(st, EP_ERR_INPUT, "the model has %d inputs: send {\"name\": [...], ...}", spec->n_inputs);
            else
                rc = json_tensor(&d, root, spec->inputs[0].dtype, &inputs[0], st);
        } else if (d.nodes[root].type == EP_JOBJ) {
            for (int i = 0; i < spec->n_inputs && !rc; i++) {
                int v = ep_json_get(&d, root, spec->inputs[i].name);
                if (v < 0) rc = ep_fail(st, EP_ERR_INPUT, "JSON lacks input \"%s\"", spec->inputs[i].name);
                else rc = json_tensor(&d, v, spec->inputs[i].dtype, &inputs[i], st);
            }
        } else {
            rc = ep_fail(st, EP_ERR_INPUT, "JSON input must be an array or an object of arrays");
        }
        ep_json_free(&d);
    } else {
        return ep_fail(st, EP_ERR_INPUT, "unrecognised input (expected an image, .npy, JSON or CSV)");
    }
    for (int i = 0; i < spec->n_inputs && !rc; i++)
        rc = ep_coerce_input(&spec->inputs[i], &inputs[i], pp && pp->has_image && pp->image_input == i, st);
    if (rc) ep_free_tensors(inputs, spec->n_inputs);
    return rc;
}

void ep_write_values_json(FILE *f, const ep_tensor *t) {
    size_t n = (size_t)ep_shape_count(t->shape, t->ndim);
    fputc('[', f);
    for (size_t i = 0; i < n; i++) {
        if (i) fputc(',', f);
        double v = ep_tensor_get(t, i);
        if (t->dtype == EP_I64) fprintf(f, "%lld", (long long)((const int64_t *)t->data)[i]); /* exact past 2^53 */
        else if (!isfinite(v)) fputs("null", f);
        else if (t->dtype == EP_F32 || t->dtype == EP_F16) fprintf(f, "%.9g", v);
        else if (t->dtype == EP_F64) fprintf(f, "%.17g", v);
        else fprintf(f, "%.0f", v);
    }
    fputc(']', f);
}

void ep_write_shape_json(FILE *f, const int64_t *shape, int ndim) {
    fputc('[', f);
    for (int i = 0; i < ndim; i++) fprintf(f, i ? ",%lld" : "%lld", (long long)shape[i]);
    fputc(']', f);
}

static void write_top(FILE *f, const ep_prepost *pp, const ep_tensor *scores) {
    size_t n = (size_t)ep_shape_count(scores->shape, scores->ndim);
    int k = pp->topk > 0 ? pp->topk : 5;
    if ((size_t)k > n) k = (int)n;
    int best[1000];
    if (k > 1000) k = 1000;
    for (int j = 0; j < k; j++) { /* k passes of selection: k is small */
        int b = -1;
        for (size_t i = 0; i < n; i++) {
            int used = 0;
            for (int q = 0; q < j; q++) used |= best[q] == (int)i;
            if (used) continue;
            double v = ep_tensor_get(scores, i);
            if (b < 0 || v > ep_tensor_get(scores, (size_t)b) || (isnan(ep_tensor_get(scores, (size_t)b)) && !isnan(v))) b = (int)i;
        }
        best[j] = b;
    }
    fputs("\"top\": [", f);
    for (int j = 0; j < k; j++) {
        double v = ep_tensor_get(scores, (size_t)best[j]);
        fprintf(f, "%s{\"index\": %d, \"label\": ", j ? ", " : "", best[j]);
        if (best[j] < pp->n_labels) ep_json_string(f, pp->labels[best[j]]);
        else fprintf(f, "\"%d\"", best[j]);
        if (isfinite(v)) fprintf(f, ", \"score\": %.9g}", v);
        else fputs(", \"score\": null}", f);
    }
    fputs("], ", f);
}

static void write_num(FILE *f, const char *fmt, float v) {
    if (isfinite(v)) fprintf(f, fmt, (double)v);
    else fputs("null", f);
}

/* "detections": [...], "detect_ms": t -- decode + NMS over the verified output, boxes mapped back to
 * the image's pixels when the input was an image. */
static void write_detections(FILE *f, const ep_prepost *pp, const ep_tensor *t, const ep_answer_ctx *ctx) {
    double t0 = ep_now_ms();
    const ep_det_cfg *c = &pp->det;
    size_t n = (size_t)ep_shape_count(t->shape, t->ndim), wn = ep_detect_work_size(c);
    int cap = c->max_det, nd = 0;
    float *conv = NULL; /* a non-float32 output (TVM may keep fp16/fp64) is converted first */
    const float *vals = (const float *)t->data;
    ep_det_box *work = malloc((wn ? wn : 1) * sizeof *work), *dets = malloc((size_t)cap * sizeof *dets);
    ep_status st = {0, ""};
    int rc = work && dets ? EP_OK : ep_fail(&st, EP_ERR_NOMEM, "out of memory");
    if (!rc && t->dtype != EP_F32) {
        conv = malloc((n ? n : 1) * sizeof *conv);
        if (!conv) rc = ep_fail(&st, EP_ERR_NOMEM, "out of memory");
        for (size_t i = 0; conv && i < n; i++) conv[i] = (float)ep_tensor_get(t, i);
        vals = conv;
    }
    if (!rc) rc = ep_detect(c, vals, n, work, wn, dets, cap, &nd, &st);
    if (!rc && ctx && ctx->image_h > 0) {
        ep_det_geom g;
        ep_det_geometry(ctx->image_h, ctx->image_w, pp->h, pp->w, pp->has_letterbox ? pp->letterbox : -1, &g);
        ep_det_to_image(&g, dets, nd);
    }
    double ms = ep_now_ms() - t0;
    fputs("\"detections\": [", f);
    for (int i = 0; !rc && i < nd; i++) {
        const ep_det_box *b = &dets[i];
        fputs(i ? ", {\"label\": " : "{\"label\": ", f);
        if (b->cls < pp->n_labels) ep_json_string(f, pp->labels[b->cls]);
        else fprintf(f, "\"%d\"", b->cls);
        fprintf(f, ", \"index\": %d, \"score\": ", b->cls);
        write_num(f, "%.6g", b->score);
        float xy[4] = {b->x1, b->y1, b->x2, b->y2};
        for (int k = 0; k < 4; k++) {
            fputs(k ? ", " : ", \"box\": [", f);
            write_num(f, "%.2f", xy[k]);
        }
        fputs("]}", f);
    }
    fprintf(f, "], \"detect_ms\": %.4f", ms);
    if (rc) {
        fputs(", \"detect_error\": ", f);
        ep_json_string(f, st.message);
    }
    free(conv);
    free(work);
    free(dets);
}

void ep_write_answer(FILE *f, const ep_model_spec *spec, const ep_prepost *pp, const ep_tensor *outputs) {
    ep_answer_ctx ctx = last_input; /* raw 0: run --output DIR writes the raw tensors as .npy */
    last_input.image_h = last_input.image_w = 0;
    ep_write_answer_ctx(f, spec, pp, outputs, &ctx);
}

void ep_write_answer_ctx(FILE *f, const ep_model_spec *spec, const ep_prepost *pp, const ep_tensor *outputs,
                         const ep_answer_ctx *ctx) {
    if (pp && pp->has_detect) {
        write_detections(f, pp, &outputs[pp->post_output], ctx);
        if (ctx && !ctx->raw) return;
        fputs(", ", f);
    } else if (pp && pp->has_post) {
        write_top(f, pp, &outputs[pp->post_output]);
    }
    fputs("\"outputs\": {", f);
    for (int i = 0; i < spec->n_outputs; i++) {
        if (i) fputs(", ", f);
        ep_json_string(f, spec->outputs[i].name);
        fprintf(f, ": {\"dtype\": \"%s\", \"shape\": ", ep_dtype_name(outputs[i].dtype));
        ep_write_shape_json(f, outputs[i].shape, outputs[i].ndim);
        fputs(", \"values\": ", f);
        ep_write_values_json(f, &outputs[i]);
        fputc('}', f);
    }
    fputc('}', f);
}

static void write_csv_header(FILE *f, const ep_model_spec *spec, const ep_prepost *pp, const ep_tensor *outputs) {
    fputs("row", f);
    if (pp->has_post) fputs(",label,score", f);
    for (int i = 0; i < spec->n_outputs; i++) {
        size_t n = (size_t)ep_shape_count(outputs[i].shape, outputs[i].ndim);
        for (size_t j = 0; j < n; j++) fprintf(f, ",%s_%zu", spec->outputs[i].name, j);
    }
    fputc('\n', f);
}

int ep_predict_csv(const ep_model_spec *spec, const ep_prepost *pp, ep_engine *e, const char *text, size_t len,
                   FILE *out, ep_rows_format format, ep_status *st) {
    if (spec->n_inputs != 1) return ep_fail(st, EP_ERR_INPUT, "CSV input needs a model with one input");
    double *vals;
    int rows, cols;
    int rc = ep_csv_parse(text, len, &vals, &rows, &cols, st);
    if (rc) return rc;
    const ep_io_spec *in = &spec->inputs[0];
    int64_t per = ep_shape_count(in->shape, in->ndim);
    int per_run_rows = 0; /* rows per model run */
    if (per == cols) per_run_rows = 1;
    else if (per == (int64_t)cols * rows) per_run_rows = rows;
    else {
        free(vals);
        char b[128];
        ep_shape_str(in->shape, in->ndim, b, sizeof b);
        return ep_fail(st, EP_ERR_INPUT, "CSV rows have %d values; input %s takes %s (%lld values per row)", cols,
                       in->name, b, (long long)per);
    }
    ep_tensor inputs[1], *outputs = ep_tensor_array(spec->n_outputs); /* one input: checked above */
    if (!outputs) {
        free(vals);
        return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    }
    /* values per output in the CSV header: a decoder's output has the length its input decides, and a
     * row of another length cannot line up under the header */
    size_t *header_n = calloc((size_t)spec->n_outputs + 1, sizeof *header_n);
    if (!header_n) {
        free(outputs);
        free(vals);
        return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    }
    if (format == EP_ROWS_JSON_ARRAY) fputc('[', out);
    for (int r = 0; r < rows && !rc; r += per_run_rows) {
        rc = ep_tensor_alloc(&inputs[0], in->dtype, in->ndim, in->shape, st);
        if (rc) break;
        for (int64_t j = 0; j < per; j++) ep_tensor_set(&inputs[0], (size_t)j, vals[(size_t)r * cols + (size_t)j]);
        rc = ep_alloc_outputs(spec, outputs, st);
        if (!rc) rc = ep_engine_run(e, inputs, outputs, st);
        if (!rc) {
            for (int i = 0; format == EP_ROWS_CSV && i < spec->n_outputs && !rc; i++) {
                size_t n = (size_t)ep_shape_count(outputs[i].shape, outputs[i].ndim);
                if (r == 0) header_n[i] = n;
                else if (n != header_n[i])
                    rc = ep_fail(st, EP_ERR_USAGE, "output %.200s has %zu values for row %d and %zu for row 0 (its length "
                                 "depends on the input): write JSON lines instead (--output results.jsonl)",
                                 spec->outputs[i].name, n, r, header_n[i]);
            }
            if (rc) {
                /* the row's tensors are freed below */
            } else if (format == EP_ROWS_CSV) {
                if (r == 0) write_csv_header(out, spec, pp, outputs);
                fprintf(out, "%d", r);
                if (pp->has_post) {
                    const ep_tensor *s = &outputs[pp->post_output];
                    size_t n = (size_t)ep_shape_count(s->shape, s->ndim), b = 0;
                    for (size_t i = 1; i < n; i++)
                        if (ep_tensor_get(s, i) > ep_tensor_get(s, b)) b = i;
                    fputc(',', out);
                    if ((int)b < pp->n_labels) ep_json_string(out, pp->labels[b]);
                    else fprintf(out, "%zu", b);
                    fprintf(out, ",%.9g", ep_tensor_get(s, b));
                }
                for (int i = 0; i < spec->n_outputs; i++) {
                    size_t n = (size_t)ep_shape_count(outputs[i].shape, outputs[i].ndim);
                    for (size_t j = 0; j < n; j++) fprintf(out, ",%.9g", ep_tensor_get(&outputs[i], j));
                }
                fputc('\n', out);
            } else {
                fprintf(out, "%s{\"row\": %d, ", r && format == EP_ROWS_JSON_ARRAY ? ", " : "", r);
                ep_write_answer(out, spec, pp, outputs);
                fputs(format == EP_ROWS_JSONL ? "}\n" : "}", out);
            }
        }
        ep_tensor_free(&inputs[0]);
        ep_free_tensors(outputs, spec->n_outputs);
    }
    if (format == EP_ROWS_JSON_ARRAY && !rc) fputc(']', out);
    free(header_n);
    free(outputs);
    free(vals);
    return rc;
}

EP_SIZE_OPT_END
