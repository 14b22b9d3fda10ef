/* Engines as a table, and the segment table a build embeds.
 *
 * Each backend's engine file exports one ep_engine_ops under its own name (ep_engine_ops_ncnn,
 * ep_engine_ops_tvm) instead of global ep_engine_* functions, so several engines link into one
 * executable. ep_engine_seq.c implements ep_runtime.h's ep_engine_open/run/close on top: it runs
 * the artifact's segments in order, each with its engine, passing tensors between them by slot.
 * A one-backend artifact is one segment whose spec is ep_spec itself.
 */
#ifndef EP_ENGINE_TABLE_H
#define EP_ENGINE_TABLE_H

#include "ep_runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One backend engine. open() gets a segment's own spec (its inputs/outputs, options, model blobs)
 * and returns an opaque handle; run() has ep_engine_run's contract for that spec. */
typedef struct {
    const char *name; /* "ncnn", "tvm": the backend name the build writes into the segment table */
    int (*open)(const ep_model_spec *spec, int threads, void **out, ep_status *st);
    int (*run)(void *engine, const ep_tensor *inputs, ep_tensor *outputs, ep_status *st);
    void (*close)(void *engine);
    const char *(*describe)(void);
} ep_engine_ops;

/* One segment: an engine, the spec it opens, and where its tensors live. Slot k holds one
 * tensor of the whole graph: slots 0..n_inputs-1 are the model's inputs, the others are written
 * by exactly one segment (its outputs). */
typedef struct {
    const ep_engine_ops *engine;
    const ep_model_spec *spec;
    const int *input_slots;  /* spec->n_inputs entries */
    const int *output_slots; /* spec->n_outputs entries */
} ep_segment;

typedef struct {
    int n_slots;
    const ep_io_spec *slots; /* dtype and shape of each slot */
    int n_segments;
    const ep_segment *segments;
    const int *output_slots; /* model output i is slot output_slots[i] (ep_spec.n_outputs entries) */
    /* model outputs that are constants (no segment computes them: onnx-asr's features_lens once the
     * input shapes are fixed): slot const_slots[c] is filled once at open with const_data[c]'s bytes */
    int n_consts;
    const int *const_slots;
    const ep_blob *const_data;
    /* model outputs whose length the model computes (a decoder's steps, edgepack/loops.py): output
     * trim_outputs[c] is cut along trim_axes[c] to the integer in slot trim_slots[c] after each run */
    int n_trims;
    const int *trim_outputs;
    const int *trim_axes;
    const int *trim_slots;
} ep_segment_table;

/* A loop segment's body: its own spec (inputs: iteration number, condition, carried values; outputs:
 * the next condition, the carried values it changes) and segment table, run once per step by the loop
 * engine (ep_engine_loop.c) through the same sequencer as the whole model. */
typedef struct {
    const ep_model_spec *spec;
    const ep_segment_table *table;
} ep_loop_body;

/* The sequencer over any table: ep_engine_open is ep_seq_open over the artifact's ep_segments;
 * ep_engine_run/close serve both. */
int ep_seq_open(const ep_model_spec *spec, const ep_segment_table *t, int threads, ep_engine **out, ep_status *st);

extern const ep_engine_ops ep_engine_ops_ncnn; /* runtimes/ncnn/ep_engine_ncnn.c */
extern const ep_engine_ops ep_engine_ops_tvm;  /* runtimes/tvm/ep_engine_tvm.cc */
extern const ep_engine_ops ep_engine_ops_loop; /* runtimes/common/ep_engine_loop.c */

extern const ep_segment_table ep_segments; /* generated per artifact, next to ep_spec */

#ifdef __cplusplus
}
#endif
#endif
