/* ep_engine_open/run/close (ep_runtime.h) over the artifact's segment table (ep_engine_table.h):
 * the segments run in order, each with its own engine, reading and writing tensors by slot.
 *
 * Slots written by a segment are allocated once at open (their shapes are static); the model's
 * inputs are borrowed from the caller for the duration of one run. The table is checked at open
 * (counts, slot indices, that every slot a segment reads was written before it and matches the
 * segment's declared shape), so a damaged table is a clear error, not a bad read.
 *
 * A model output whose length the model computes (a decoder that stops at its end token) is computed at
 * its largest and cut after the run to the length in its slot (the table's trims).
 *
 * EDGEPACK_SEGMENT_TIMES=1 in the environment: at close, one stderr line per segment with its
 * runs and total milliseconds (where a partitioned artifact spends its time; read once at open).
 */
#include "ep_engine_table.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct ep_engine {
    const ep_model_spec *spec;
    const ep_segment_table *table;
    void **handles;      /* one per segment */
    ep_tensor *slots;    /* table->n_slots; model-input slots are views */
    ep_tensor *seg_in;   /* scratch views, sized for the largest segment */
    ep_tensor *seg_out;
    ep_tensor *saved;    /* spec->n_outputs: slot buffers set aside while outputs are written in place */
    double *seg_ms;      /* per segment, summed over runs; NULL unless EDGEPACK_SEGMENT_TIMES is set */
    long runs;
};

static char g_describe[256];

static int same_io(const ep_io_spec *a, const ep_io_spec *b) {
    if (a->dtype != b->dtype || a->ndim != b->ndim) return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return 0;
    return 1;
}

/* Every index in range, every slot written once before it is read, shapes agree. */
static int check_table(const ep_model_spec *spec, const ep_segment_table *t, ep_status *st) {
    if (t->n_segments < 1 || t->n_segments > EP_MAX_IO || t->n_slots < spec->n_inputs || t->n_slots > EP_MAX_IO ||
        !t->segments || !t->slots || !t->output_slots)
        return ep_fail(st, EP_ERR_MODEL, "embedded segment table damaged: %d segments, %d slots", t->n_segments,
                       t->n_slots);
    char *written = calloc((size_t)t->n_slots, 1);
    if (!written) return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    int rc = EP_OK;
    for (int i = 0; i < spec->n_inputs && !rc; i++) {
        written[i] = 1;
        if (!same_io(&t->slots[i], &spec->inputs[i]))
            rc = ep_fail(st, EP_ERR_MODEL, "segment table: slot %d does not match input %s", i, spec->inputs[i].name);
    }
    if (!rc && (t->n_consts < 0 || t->n_consts > t->n_slots || (t->n_consts && (!t->const_slots || !t->const_data))))
        rc = ep_fail(st, EP_ERR_MODEL, "segment table: %d constant slots, damaged", t->n_consts);
    for (int c = 0; c < t->n_consts && !rc; c++) {
        int k = t->const_slots[c];
        if (k < spec->n_inputs || k >= t->n_slots || written[k] || !t->const_data[c].data || !t->const_data[c].size)
            rc = ep_fail(st, EP_ERR_MODEL, "segment table: constant %d fills slot %d, which is taken or unset", c, k);
        else
            written[k] = 1;
    }
    if (!rc && (t->n_trims < 0 || t->n_trims > spec->n_outputs ||
                (t->n_trims && (!t->trim_outputs || !t->trim_axes || !t->trim_slots))))
        rc = ep_fail(st, EP_ERR_MODEL, "segment table: %d cut outputs, damaged", t->n_trims);
    for (int c = 0; c < t->n_trims && !rc; c++) {
        int j = t->trim_outputs[c], a = t->trim_axes[c], k = t->trim_slots[c];
        if (j < 0 || j >= spec->n_outputs || a < 0 || a >= spec->outputs[j].ndim || k < 0 || k >= t->n_slots ||
            (t->slots[k].dtype != EP_I64 && t->slots[k].dtype != EP_I32) ||
            ep_shape_count(t->slots[k].shape, t->slots[k].ndim) != 1)
            rc = ep_fail(st, EP_ERR_MODEL, "segment table: cut %d (output %d, axis %d, length slot %d) is damaged", c,
                         j, a, k);
    }
    for (int s = 0; s < t->n_segments && !rc; s++) {
        const ep_segment *g = &t->segments[s];
        if (!g->engine || !g->spec || (g->spec->n_inputs && !g->input_slots) || !g->output_slots) {
            rc = ep_fail(st, EP_ERR_MODEL, "segment %d of the embedded table is damaged", s);
            break;
        }
        if ((rc = ep_spec_check(g->spec, st))) break;
        for (int i = 0; i < g->spec->n_inputs && !rc; i++) {
            int k = g->input_slots[i];
            if (k < 0 || k >= t->n_slots || !written[k] || !same_io(&t->slots[k], &g->spec->inputs[i]))
                rc = ep_fail(st, EP_ERR_MODEL, "segment %d (%s): input %s reads slot %d, which is unset or differs",
                             s, g->engine->name, g->spec->inputs[i].name, k);
        }
        for (int i = 0; i < g->spec->n_outputs && !rc; i++) {
            int k = g->output_slots[i];
            if (k < spec->n_inputs || k >= t->n_slots || written[k] || !same_io(&t->slots[k], &g->spec->outputs[i]))
                rc = ep_fail(st, EP_ERR_MODEL, "segment %d (%s): output %s writes slot %d, which is taken or differs",
                             s, g->engine->name, g->spec->outputs[i].name, k);
            else
                written[k] = 1;
        }
    }
    for (int i = 0; i < spec->n_outputs && !rc; i++) {
        int k = t->output_slots[i];
        if (k < 0 || k >= t->n_slots || !written[k] || !same_io(&t->slots[k], &spec->outputs[i]))
            rc = ep_fail(st, EP_ERR_MODEL, "segment table: output %s comes from slot %d, which is unset or differs",
                         spec->outputs[i].name, k);
    }
    free(written);
    return rc;
}

const char *ep_engine_describe(void) {
    const ep_segment_table *t = &ep_segments;
    if (t->n_segments == 1 && t->segments && t->segments[0].engine) return t->segments[0].engine->describe();
    size_t used = 0;
    g_describe[0] = '\0';
    for (int s = 0; s < t->n_segments && t->segments; s++) {
        int n = snprintf(g_describe + used, sizeof g_describe - used, "%s%s", s ? " -> " : "",
                         t->segments[s].engine ? t->segments[s].engine->name : "?");
        if (n < 0 || (size_t)n >= sizeof g_describe - used) break;
        used += (size_t)n;
    }
    return g_describe;
}

void ep_engine_close(ep_engine *e) {
    if (!e) return;
    const ep_segment_table *t = e->table;
    if (e->seg_ms && e->runs > 0)
        for (int s = 0; s < t->n_segments; s++)
            fprintf(stderr, "segment %d (%s): %ld runs, %.3f ms total, %.4f ms per run\n", s,
                    t->segments[s].engine->name, e->runs, e->seg_ms[s], e->seg_ms[s] / (double)e->runs);
    free(e->seg_ms);
    if (e->handles)
        for (int s = 0; s < t->n_segments; s++)
            if (e->handles[s]) t->segments[s].engine->close(e->handles[s]);
    if (e->slots) {
        /* model-input slots only ever hold borrowed views: ep_tensor_free leaves those alone */
        ep_tensor_array_free(e->slots, t->n_slots);
    }
    free(e->seg_in);
    free(e->seg_out);
    free(e->saved);
    free(e->handles);
    free(e);
}

int ep_engine_open(const ep_model_spec *spec, int threads, ep_engine **out, ep_status *st) {
    return ep_seq_open(spec, &ep_segments, threads, out, st);
}

int ep_seq_open(const ep_model_spec *spec, const ep_segment_table *t, int threads, ep_engine **out, ep_status *st) {
    *out = NULL;
    int rc = ep_spec_check(spec, st);
    if (rc) return rc;
    if ((rc = check_table(spec, t, st))) return rc;
    ep_engine *e = calloc(1, sizeof *e);
    if (!e) return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    e->spec = spec;
    e->table = t;
    int widest = 1;
    for (int s = 0; s < t->n_segments; s++) {
        if (t->segments[s].spec->n_inputs > widest) widest = t->segments[s].spec->n_inputs;
        if (t->segments[s].spec->n_outputs > widest) widest = t->segments[s].spec->n_outputs;
    }
    e->handles = calloc((size_t)t->n_segments, sizeof *e->handles);
    e->slots = ep_tensor_array(t->n_slots);
    e->seg_in = calloc((size_t)widest, sizeof *e->seg_in);
    e->seg_out = calloc((size_t)widest, sizeof *e->seg_out);
    e->saved = calloc((size_t)spec->n_outputs, sizeof *e->saved);
    const char *times = getenv("EDGEPACK_SEGMENT_TIMES");
    if (times && times[0] && strcmp(times, "0") != 0) e->seg_ms = calloc((size_t)t->n_segments, sizeof *e->seg_ms);
    if (!e->handles || !e->slots || !e->seg_in || !e->seg_out || !e->saved) {
        ep_engine_close(e);
        return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    }
    for (int k = spec->n_inputs; k < t->n_slots && !rc; k++)
        rc = ep_tensor_alloc(&e->slots[k], t->slots[k].dtype, t->slots[k].ndim, t->slots[k].shape, st);
    for (int c = 0; c < t->n_consts && !rc; c++) {
        ep_tensor *slot = &e->slots[t->const_slots[c]];
        if (*t->const_data[c].size != (uint64_t)slot->nbytes)
            rc = ep_fail(st, EP_ERR_MODEL, "segment table: constant %d holds %llu bytes for a %zu-byte slot", c,
                         (unsigned long long)*t->const_data[c].size, slot->nbytes);
        else if (slot->nbytes)
            memcpy(slot->data, t->const_data[c].data, slot->nbytes);
    }
    for (int s = 0; s < t->n_segments && !rc; s++) {
        const ep_segment *g = &t->segments[s];
        rc = g->engine->open(g->spec, threads, &e->handles[s], st);
        if (rc && t->n_segments > 1) {
            char msg[sizeof st->message];
            memcpy(msg, st->message, sizeof msg);
            ep_fail(st, rc, "segment %d (%s): %.400s", s, g->engine->name, msg);
        }
    }
    if (rc) {
        ep_engine_close(e);
        return rc;
    }
    *out = e;
    return EP_OK;
}

/* A cut output back at the spec's shape: the caller allocated it so, a run shortens it. */
static void restore_cut(ep_tensor *t, const ep_io_spec *o) {
    t->ndim = o->ndim;
    memcpy(t->shape, o->shape, sizeof t->shape);
    t->nbytes = (size_t)ep_shape_count(o->shape, o->ndim) * ep_dtype_size(o->dtype);
}

/* Output t cut along axis to the computed length (as ONNX's Slice from 0 clamps its end: negative
 * counts from the end, then 0..dim), the rows kept packed at the front of its buffer. */
static void cut(ep_tensor *t, int axis, double end) {
    int64_t dim = t->shape[axis];
    double len = end < 0 ? end + (double)dim : end;
    int64_t n = len <= 0 || len != len ? 0 : len >= (double)dim ? dim : (int64_t)len;
    if (n == dim) return;
    size_t outer = 1, inner = ep_dtype_size(t->dtype);
    for (int d = 0; d < axis; d++) outer *= (size_t)t->shape[d];
    for (int d = axis + 1; d < t->ndim; d++) inner *= (size_t)t->shape[d];
    unsigned char *p = t->data;
    for (size_t o = 1; o < outer && n > 0; o++)
        memmove(p + o * (size_t)n * inner, p + o * (size_t)dim * inner, (size_t)n * inner);
    t->shape[axis] = n;
    t->nbytes = outer * (size_t)n * inner;
}

/* A view of src (never freed through the view). */
static void view(ep_tensor *dst, const ep_tensor *src) {
    *dst = *src;
    dst->owned = 0;
}

/* Slot k of model output j, when j is the first output read from k and a segment writes k:
 * then that segment writes the caller's tensor directly (no copy after the run). */
static int direct_output(const ep_engine *e, int j) {
    const ep_segment_table *t = e->table;
    int k = t->output_slots[j];
    if (k < e->spec->n_inputs) return -1;
    for (int i = 0; i < j; i++)
        if (t->output_slots[i] == k) return -1;
    for (int c = 0; c < t->n_consts; c++)
        if (t->const_slots[c] == k) return -1; /* filled at open: copied out, never lent */
    return k;
}

int ep_engine_run(ep_engine *e, const ep_tensor *inputs, ep_tensor *outputs, ep_status *st) {
    const ep_segment_table *t = e->table;
    const ep_model_spec *spec = e->spec;
    int rc = EP_OK;
    for (int c = 0; c < t->n_trims; c++) restore_cut(&outputs[t->trim_outputs[c]], &spec->outputs[t->trim_outputs[c]]);
    for (int j = 0; j < spec->n_outputs && !rc; j++) {
        const ep_tensor *slot = &e->slots[t->output_slots[j]];
        if (outputs[j].dtype != t->slots[t->output_slots[j]].dtype ||
            (t->output_slots[j] >= spec->n_inputs && outputs[j].nbytes != slot->nbytes))
            rc = ep_fail(st, EP_ERR_MODEL, "output %s: the caller's tensor does not match the model",
                         spec->outputs[j].name);
    }
    if (rc) return rc;
    for (int i = 0; i < spec->n_inputs; i++) view(&e->slots[i], &inputs[i]);
    for (int j = 0; j < spec->n_outputs; j++) {
        int k = direct_output(e, j);
        if (k < 0) continue;
        e->saved[j] = e->slots[k];
        view(&e->slots[k], &outputs[j]);
    }
    for (int s = 0; s < t->n_segments && !rc; s++) {
        const ep_segment *g = &t->segments[s];
        for (int i = 0; i < g->spec->n_inputs; i++) view(&e->seg_in[i], &e->slots[g->input_slots[i]]);
        for (int i = 0; i < g->spec->n_outputs; i++) view(&e->seg_out[i], &e->slots[g->output_slots[i]]);
        double t0 = e->seg_ms ? ep_now_ms() : 0.0;
        rc = g->engine->run(e->handles[s], e->seg_in, e->seg_out, st);
        if (e->seg_ms) e->seg_ms[s] += ep_now_ms() - t0;
        if (rc && t->n_segments > 1) {
            char msg[sizeof st->message];
            memcpy(msg, st->message, sizeof msg);
            ep_fail(st, rc, "segment %d (%s): %.400s", s, g->engine->name, msg);
        }
    }
    for (int j = 0; j < spec->n_outputs && !rc; j++) {
        if (direct_output(e, j) >= 0) continue;
        const ep_tensor *src = &e->slots[t->output_slots[j]];
        if (outputs[j].nbytes != src->nbytes)
            rc = ep_fail(st, EP_ERR_MODEL, "output %s: %zu bytes computed, %zu expected", spec->outputs[j].name,
                         src->nbytes, outputs[j].nbytes);
        else
            memcpy(outputs[j].data, src->data, src->nbytes);
    }
    /* before the lent slots are given back: a length that is itself a model output was written there */
    for (int c = 0; c < t->n_trims && !rc; c++)
        cut(&outputs[t->trim_outputs[c]], t->trim_axes[c], ep_tensor_get(&e->slots[t->trim_slots[c]], 0));
    for (int j = 0; j < spec->n_outputs; j++) {
        int k = direct_output(e, j);
        if (k >= 0) e->slots[k] = e->saved[j];
    }
    for (int i = 0; i < spec->n_inputs; i++) memset(&e->slots[i], 0, sizeof e->slots[i]);
    if (!rc) e->runs++;
    return rc;
}
