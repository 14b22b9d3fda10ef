/* Loop segments: an ONNX Loop that decides on data (an autoregressive decoder), stepped here.
 *
 * The build (edgepack/loops.py) compiles the loop's body as a model of its own, with its own segment
 * table (ep_loop_body, spec->loop_body); this engine opens the sequencer over it and runs it once per
 * step while the step count is under the trip count and the condition holds. Body input 0 is the step
 * number (int64), input 1 the condition (bool), the others the carried values; body output 0 is the
 * next condition, the others the carried values the body changes. The wiring is in the options:
 *
 *   loop.max, loop.cond   where the trip count and the first condition come from
 *   loop.in.J             where body input J (J >= 2) gets its first value (an invariant: every value)
 *   loop.next.J           the body output that replaces input J after each step (absent: invariant)
 *   loop.out.R            the body input whose last value is this segment's output R
 *   loop.guard            a body output (bool) true while the fixed lengths the body was compiled
 *                         for hold (edgepack/loop_lengths.py); false: the step fails with an error
 *
 * A source is "iK" (this segment's input K), "bK" (model blob K: the constant's bytes) or "none"
 * (absent: no trip count, a true condition, or a value the body never reads).
 * Changed values live in two buffers each, swapped after every step, so a step never copies them.
 * A loop still going after EP_LOOP_MAX_STEPS steps (no trip count, or a larger one: exporters write
 * INT64_MAX for a "while") stops with an error: bounded.
 */
#include "ep_engine_table.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EP_LOOP_MAX_STEPS (1LL << 24)

enum { SRC_NONE = -1 };

typedef struct {
    const ep_model_spec *spec;  /* the loop segment's */
    const ep_model_spec *body_spec;
    ep_engine *body;
    int n_in, n_out;            /* body inputs and outputs */
    int max_src, cond_src;      /* source codes: SRC_NONE, k >= 0 segment input k, -(b + 2) blob b */
    int guard;                  /* body output checked after each step, or -1 */
    int *src;                   /* per body input (from 2 on) */
    int *next;                  /* per body input: the body output replacing it, or -1 */
    int *out_from;              /* per segment output: the body input it is the last value of */
    ep_tensor *in;              /* the body's inputs: step, condition, then state buffers or views */
    ep_tensor *out;             /* the body's outputs (owned): condition, then the spare buffers */
} loop_engine;

static int parse_src(const char *s, int *code) {
    if (!s || strcmp(s, "none") == 0) {
        *code = SRC_NONE;
        return 0;
    }
    char *end = NULL;
    long v = (s[0] == 'i' || s[0] == 'b') ? strtol(s + 1, &end, 10) : -1;
    if (!end || *end || v < 0 || v > EP_MAX_IO) return -1;
    *code = s[0] == 'i' ? (int)v : -(int)v - 2;
    return 0;
}

static int parse_index(const char *s, int lo, int hi, int *v) {
    char *end = NULL;
    long x = s ? strtol(s, &end, 10) : -1;
    if (!s || !end || *end || x < lo || x >= hi) return -1;
    *v = (int)x;
    return 0;
}

static size_t io_bytes(const ep_io_spec *s) {
    return (size_t)ep_shape_count(s->shape, s->ndim) * ep_dtype_size(s->dtype);
}

/* The bytes a source holds, and their dtype and size, checked against what body input j needs. */
static int src_check(const loop_engine *l, int code, const ep_io_spec *want, ep_status *st) {
    if (code >= 0) {
        if (code >= l->spec->n_inputs) return ep_fail(st, EP_ERR_MODEL, "loop: source i%d out of range", code);
        const ep_io_spec *have = &l->spec->inputs[code];
        if (have->dtype != want->dtype || io_bytes(have) != io_bytes(want))
            return ep_fail(st, EP_ERR_MODEL, "loop: input %s does not fit body value %s", have->name, want->name);
    } else if (code != SRC_NONE) {
        int b = -code - 2;
        if (b >= l->spec->n_model_blobs || ep_blob_size(&l->spec->model_blobs[b]) != io_bytes(want))
            return ep_fail(st, EP_ERR_MODEL, "loop: constant %d does not fit body value %s", b, want->name);
    }
    return EP_OK;
}

static const void *src_data(const loop_engine *l, int code, const ep_tensor *inputs) {
    if (code >= 0) return inputs[code].data;
    return l->spec->model_blobs[-code - 2].data;
}

static void loop_close(void *h) {
    loop_engine *l = h;
    if (!l) return;
    if (l->body) ep_engine_close(l->body);
    if (l->in)
        for (int j = 0; j < l->n_in; j++)
            if (l->in[j].owned) ep_tensor_free(&l->in[j]);
    if (l->out) ep_tensor_array_free(l->out, l->n_out);
    free(l->in);
    free(l->src);
    free(l->next);
    free(l->out_from);
    free(l);
}

static int loop_open(const ep_model_spec *spec, int threads, void **out, ep_status *st) {
    *out = NULL;
    const ep_loop_body *body = spec->loop_body;
    if (!body || !body->spec || !body->table) return ep_fail(st, EP_ERR_MODEL, "loop segment without a body");
    const ep_model_spec *bs = body->spec;
    if (bs->n_inputs < 2 || bs->n_outputs < 1 || bs->inputs[0].dtype != EP_I64 || bs->inputs[1].dtype != EP_BOOL ||
        bs->outputs[0].dtype != EP_BOOL || io_bytes(&bs->inputs[0]) != 8 || io_bytes(&bs->inputs[1]) != 1 ||
        io_bytes(&bs->outputs[0]) != 1)
        return ep_fail(st, EP_ERR_MODEL, "loop body: step, condition or next condition is not one value");
    loop_engine *l = calloc(1, sizeof *l);
    if (!l) return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    l->spec = spec;
    l->body_spec = bs;
    l->n_in = bs->n_inputs;
    l->n_out = bs->n_outputs;
    l->src = calloc((size_t)l->n_in, sizeof *l->src);
    l->next = calloc((size_t)l->n_in, sizeof *l->next);
    l->out_from = calloc((size_t)(spec->n_outputs ? spec->n_outputs : 1), sizeof *l->out_from);
    l->in = ep_tensor_array(l->n_in);
    l->out = ep_tensor_array(l->n_out);
    if (!l->src || !l->next || !l->out_from || !l->in || !l->out) {
        loop_close(l);
        return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    }
    int rc = EP_OK;
    char key[48];
    if (parse_src(ep_option_get(spec, "loop.max", "none"), &l->max_src) ||
        parse_src(ep_option_get(spec, "loop.cond", "none"), &l->cond_src))
        rc = ep_fail(st, EP_ERR_MODEL, "loop: trip count or condition source damaged");
    if (!rc) rc = src_check(l, l->max_src, &bs->inputs[0], st);
    if (!rc) rc = src_check(l, l->cond_src, &bs->inputs[1], st);
    l->guard = -1;
    const char *g = ep_option_get(spec, "loop.guard", NULL);
    if (!rc && g && (parse_index(g, 1, l->n_out, &l->guard) || bs->outputs[l->guard].dtype != EP_BOOL ||
                     io_bytes(&bs->outputs[l->guard]) != 1))
        rc = ep_fail(st, EP_ERR_MODEL, "loop: guard output damaged");
    char *claimed = calloc((size_t)l->n_out, 1);
    if (!claimed && !rc) rc = ep_fail(st, EP_ERR_NOMEM, "out of memory");
    if (claimed && l->guard > 0) claimed[l->guard] = 1;
    for (int j = 2; j < l->n_in && !rc; j++) {
        snprintf(key, sizeof key, "loop.in.%d", j);
        if (parse_src(ep_option_get(spec, key, NULL), &l->src[j])) {
            rc = ep_fail(st, EP_ERR_MODEL, "loop: source of body input %d damaged", j);
            break;
        }
        if ((rc = src_check(l, l->src[j], &bs->inputs[j], st))) break;
        snprintf(key, sizeof key, "loop.next.%d", j);
        const char *nx = ep_option_get(spec, key, NULL);
        l->next[j] = -1;
        if (nx) {
            int o;
            if (parse_index(nx, 1, l->n_out, &o) || claimed[o] || bs->outputs[o].dtype != bs->inputs[j].dtype ||
                io_bytes(&bs->outputs[o]) != io_bytes(&bs->inputs[j])) {
                rc = ep_fail(st, EP_ERR_MODEL, "loop: body output for input %s damaged", bs->inputs[j].name);
                break;
            }
            claimed[o] = 1;
            l->next[j] = o;
        } else if (l->src[j] == SRC_NONE) {
            rc = ep_fail(st, EP_ERR_MODEL, "loop: body input %s has no value", bs->inputs[j].name);
        }
    }
    free(claimed);
    for (int r = 0; r < spec->n_outputs && !rc; r++) {
        snprintf(key, sizeof key, "loop.out.%d", r);
        int j;
        if (parse_index(ep_option_get(spec, key, NULL), 2, l->n_in, &j) ||
            spec->outputs[r].dtype != bs->inputs[j].dtype || io_bytes(&spec->outputs[r]) != io_bytes(&bs->inputs[j]))
            rc = ep_fail(st, EP_ERR_MODEL, "loop: output %s damaged", spec->outputs[r].name);
        else
            l->out_from[r] = j;
    }
    /* step, condition and changed values: owned buffers at the body's shapes; invariants: views set per run */
    for (int j = 0; j < l->n_in && !rc; j++)
        if (j < 2 || l->next[j] >= 0)
            rc = ep_tensor_alloc(&l->in[j], bs->inputs[j].dtype, bs->inputs[j].ndim, bs->inputs[j].shape, st);
    for (int o = 0; o < l->n_out && !rc; o++)
        rc = ep_tensor_alloc(&l->out[o], bs->outputs[o].dtype, bs->outputs[o].ndim, bs->outputs[o].shape, st);
    if (!rc) rc = ep_seq_open(bs, body->table, threads, &l->body, st);
    if (rc) {
        loop_close(l);
        return rc;
    }
    *out = l;
    return EP_OK;
}

static int loop_run(void *h, const ep_tensor *inputs, ep_tensor *outputs, ep_status *st) {
    loop_engine *l = h;
    const ep_model_spec *bs = l->body_spec;
    /* the model's trip count, but never more than EP_LOOP_MAX_STEPS: exporters write INT64_MAX for "while" */
    long long max = EP_LOOP_MAX_STEPS, capped = 1;
    if (l->max_src != SRC_NONE) {
        int64_t m;
        memcpy(&m, src_data(l, l->max_src, inputs), sizeof m);
        capped = m > EP_LOOP_MAX_STEPS;
        max = m < 0 ? 0 : capped ? EP_LOOP_MAX_STEPS : m;
    }
    unsigned char cond = 1;
    if (l->cond_src != SRC_NONE) cond = *(const unsigned char *)src_data(l, l->cond_src, inputs) != 0;
    for (int j = 2; j < l->n_in; j++) {
        if (l->next[j] >= 0) {
            if (l->src[j] != SRC_NONE) memcpy(l->in[j].data, src_data(l, l->src[j], inputs), l->in[j].nbytes);
            else memset(l->in[j].data, 0, l->in[j].nbytes);
            continue;
        }
        /* an invariant: a view at the body's shape of the segment input or the constant (never written) */
        ep_tensor *v = &l->in[j];
        v->dtype = bs->inputs[j].dtype;
        v->ndim = bs->inputs[j].ndim;
        memcpy(v->shape, bs->inputs[j].shape, sizeof v->shape);
        v->nbytes = io_bytes(&bs->inputs[j]);
        v->data = (void *)src_data(l, l->src[j], inputs);
        v->owned = 0;
    }
    long long step = 0;
    for (; step < max && cond; step++) {
        int64_t i64 = step;
        memcpy(l->in[0].data, &i64, sizeof i64);
        *(unsigned char *)l->in[1].data = cond;
        int rc = ep_engine_run(l->body, l->in, l->out, st);
        if (rc) {
            char msg[sizeof st->message];
            memcpy(msg, st->message, sizeof msg);
            return ep_fail(st, rc, "loop step %lld: %.400s", step, msg);
        }
        if (l->guard > 0 && !*(const unsigned char *)l->out[l->guard].data)
            return ep_fail(st, EP_ERR_MODEL,
                           "loop step %lld: a slice the loop's body was compiled to take at a fixed length would "
                           "have another one here (edgepack/loop_lengths.py); onnxruntime runs this input", step);
        cond = *(const unsigned char *)l->out[0].data != 0;
        for (int j = 2; j < l->n_in; j++) { /* the new values become the inputs; the old buffers the spares */
            if (l->next[j] < 0) continue;
            void *p = l->in[j].data;
            l->in[j].data = l->out[l->next[j]].data;
            l->out[l->next[j]].data = p;
        }
    }
    if (capped && cond && step >= max)
        return ep_fail(st, EP_ERR_MODEL, "the model's loop did not stop within %lld steps", max);
    for (int r = 0; r < l->spec->n_outputs; r++) {
        const ep_tensor *v = &l->in[l->out_from[r]];
        if (outputs[r].nbytes != v->nbytes)
            return ep_fail(st, EP_ERR_MODEL, "loop output %s: %zu bytes, %zu expected", l->spec->outputs[r].name,
                           v->nbytes, outputs[r].nbytes);
        memcpy(outputs[r].data, v->data, v->nbytes);
    }
    return EP_OK;
}

static const char *loop_describe(void) { return "loop"; }

const ep_engine_ops ep_engine_ops_loop = {"loop", loop_open, loop_run, loop_close, loop_describe};
