/* YOLO-family detection decoding + NMS over a model's raw output (issue #13), for every backend.
 *
 * Plain structs in, caller-sized buffers, status codes; no allocation, no exit(), nothing sized by a
 * model-controlled count except the caller's buffers (whose capacities are checked). The numpy
 * reference with the same order of operations is edgepack/prepost/detect.py. */
#ifndef EP_DETECT_H
#define EP_DETECT_H

#include <stddef.h>

#include "ep_runtime.h"

typedef enum { EP_DET_YOLOV8 = 0, EP_DET_YOLOV5 = 1, EP_DET_YOLOX = 2 } ep_det_format;

#define EP_DET_MAX_STRIDES 8
typedef struct {
    ep_det_format format;
    int classes, anchors;     /* C and N of [1, 4(+1)+C, N] / [1, N, 4(+1)+C] */
    int channels_first;       /* 1: [1, feat, N] (yolov8's export) */
    int grid;                 /* yolox: boxes are grid offsets, decoded with in_h/in_w and strides */
    int agnostic, max_det;
    float conf, iou;
    int in_h, in_w;
    int n_strides, strides[EP_DET_MAX_STRIDES];
} ep_det_cfg;

typedef struct {
    float x1, y1, x2, y2, score;
    int cls, anchor;
} ep_det_box;

/* Where the model input's pixels came from: the original image size and the resize/letterbox that
 * put it at (top, left), nh x nw inside the input. ih == 0: no image (boxes stay in input pixels). */
typedef struct {
    int ih, iw, top, left, nh, nw;
} ep_det_geom;

/* Settings a caller cannot use (counts, thresholds, strides vs anchors): EP_ERR_MODEL with why. */
int ep_detect_check(const ep_det_cfg *c, ep_status *st);
/* How many ep_det_box the work buffer must hold (one per anchor, and room for per-anchor scratch). */
size_t ep_detect_work_size(const ep_det_cfg *c);
/* Raw output (n_values floats) -> at most min(det_cap, max_det) boxes in dets, best score first. */
int ep_detect(const ep_det_cfg *c, const float *out, size_t n_values, ep_det_box *work, size_t work_cap,
              ep_det_box *dets, int det_cap, int *n_dets, ep_status *st);
/* The letterbox (pad >= 0) or stretch placement of an ih x iw image in an h x w input. */
void ep_det_geometry(int ih, int iw, int h, int w, int letterbox, ep_det_geom *g);
/* Boxes in input pixels -> the original image's pixels, clipped to it (no-op when g->ih == 0). */
void ep_det_to_image(const ep_det_geom *g, ep_det_box *b, int n);

#endif
