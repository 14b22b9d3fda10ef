/* YOLO-family decoding + greedy NMS (see ep_detect.h). Kept at the build's -O: it runs per request,
 * and its budget is < 1 ms for 100 boxes on x86. */
#include "ep_detect.h"

#include <math.h>
#include <stdlib.h>

int ep_detect_check(const ep_det_cfg *c, ep_status *st) {
    if (c->format < EP_DET_YOLOV8 || c->format > EP_DET_YOLOX || c->classes < 1 || c->anchors < 1 ||
        c->max_det < 1 || !(c->conf >= 0 && c->conf <= 1) || !(c->iou >= 0 && c->iou <= 1))
        return ep_fail(st, EP_ERR_MODEL, "embedded detection settings damaged");
    if (c->grid) {
        if (c->n_strides < 1 || c->n_strides > EP_DET_MAX_STRIDES || c->in_h < 1 || c->in_w < 1)
            return ep_fail(st, EP_ERR_MODEL, "embedded detection settings damaged (grid)");
        long long cells = 0;
        for (int i = 0; i < c->n_strides; i++) {
            int s = c->strides[i];
            if (s < 1) return ep_fail(st, EP_ERR_MODEL, "embedded detection settings damaged (stride)");
            cells += (long long)((c->in_h + s - 1) / s) * ((c->in_w + s - 1) / s);
        }
        if (cells != c->anchors)
            return ep_fail(st, EP_ERR_MODEL, "detection grid has %lld cells for %d anchors", cells, c->anchors);
    }
    return EP_OK;
}

/* One box per anchor for the candidates, and behind them room for two plain arrays (best score and
 * class per anchor) that the class scan reads and writes in order. */
size_t ep_detect_work_size(const ep_det_cfg *c) {
    size_t n = c->anchors > 0 ? (size_t)c->anchors : 0;
    return n + (n * (sizeof(float) + sizeof(int)) + sizeof(ep_det_box) - 1) / sizeof(ep_det_box);
}

static int by_score(const void *pa, const void *pb) {
    const ep_det_box *a = pa, *b = pb;
    if (a->score != b->score) return a->score < b->score ? 1 : -1;
    return (a->anchor > b->anchor) - (a->anchor < b->anchor); /* ties: the lower anchor first, as numpy's stable sort */
}

static float iou(const ep_det_box *a, const ep_det_box *b) {
    float ix = fminf(a->x2, b->x2) - fmaxf(a->x1, b->x1), iy = fminf(a->y2, b->y2) - fmaxf(a->y1, b->y1);
    if (!(ix > 0) || !(iy > 0)) return 0;
    float inter = ix * iy;
    float uni = (a->x2 - a->x1) * (a->y2 - a->y1) + (b->x2 - b->x1) * (b->y2 - b->y1) - inter;
    return uni > 0 ? inter / uni : 0;
}

/* The anchor's grid cell and stride (yolox): strides in order, cells row-major within each. */
static void grid_of(const ep_det_cfg *c, int anchor, float *gx, float *gy, float *stride) {
    int base = 0;
    for (int i = 0; i < c->n_strides; i++) {
        int s = c->strides[i], gh = (c->in_h + s - 1) / s, gw = (c->in_w + s - 1) / s;
        if (anchor < base + gh * gw) {
            int k = anchor - base;
            *gx = (float)(k % gw);
            *gy = (float)(k / gw);
            *stride = (float)s;
            return;
        }
        base += gh * gw;
    }
    *gx = *gy = 0;
    *stride = 1;
}

int ep_detect(const ep_det_cfg *c, const float *out, size_t n_values, ep_det_box *work, size_t work_cap,
              ep_det_box *dets, int det_cap, int *n_dets, ep_status *st) {
    *n_dets = 0;
    int rc = ep_detect_check(c, st);
    if (rc) return rc;
    size_t n = (size_t)c->anchors, first = c->format == EP_DET_YOLOV8 ? 4 : 5, feat = first + (size_t)c->classes;
    if (n_values != n * feat)
        return ep_fail(st, EP_ERR_MODEL, "detector output has %zu values, expected %zux%zu", n_values, n, feat);
    if (work_cap < ep_detect_work_size(c)) return ep_fail(st, EP_ERR_NOMEM, "detection work buffer too small");
    /* element (anchor i, value j) of either layout */
    size_t si = c->channels_first ? 1 : feat, sj = c->channels_first ? n : 1;
    /* best class per anchor, in two arrays behind the n candidate boxes; class-major when the classes
     * are rows, so memory is read in order (and the compiler vectorises the compare-select) */
    float *best = (float *)(void *)(work + n);
    int *best_cls = (int *)(void *)(best + n);
    for (size_t i = 0; i < n; i++) {
        best[i] = -INFINITY;
        best_cls[i] = 0;
    }
    for (size_t k = 0; k < (size_t)c->classes; k++) {
        const float *col = out + (first + k) * sj;
        if (si == 1 && first == 4) {
            for (size_t i = 0; i < n; i++) {
                float v = col[i];
                int better = v > best[i];
                best[i] = better ? v : best[i];
                best_cls[i] = better ? (int)k : best_cls[i];
            }
            continue;
        }
        for (size_t i = 0; i < n; i++) {
            float v = col[i * si];
            if (first == 5) v *= out[i * si + 4 * sj]; /* objectness x class */
            if (v > best[i]) {
                best[i] = v;
                best_cls[i] = (int)k;
            }
        }
    }
    size_t m = 0; /* candidates, compacted to the front */
    for (size_t i = 0; i < n; i++) {
        if (!(best[i] > c->conf)) continue;
        const float *a = out + i * si;
        float cx = a[0], cy = a[sj], w = a[2 * sj], h = a[3 * sj];
        if (c->grid) {
            float gx, gy, s;
            grid_of(c, (int)i, &gx, &gy, &s);
            cx = (cx + gx) * s;
            cy = (cy + gy) * s;
            w = expf(w) * s;
            h = expf(h) * s;
        }
        ep_det_box b = {cx - w * 0.5f, cy - h * 0.5f, cx + w * 0.5f, cy + h * 0.5f, best[i], best_cls[i], (int)i};
        work[m++] = b; /* boxes end before best[]: nothing still to be read is overwritten */
    }
    qsort(work, m, sizeof *work, by_score);
    int cap = det_cap < c->max_det ? det_cap : c->max_det, kept = 0;
    for (size_t i = 0; i < m && kept < cap; i++) {
        int drop = 0;
        for (int k = 0; k < kept && !drop; k++)
            drop = (c->agnostic || dets[k].cls == work[i].cls) && iou(&work[i], &dets[k]) > c->iou;
        if (!drop) dets[kept++] = work[i];
    }
    *n_dets = kept;
    return EP_OK;
}

void ep_det_geometry(int ih, int iw, int h, int w, int letterbox, ep_det_geom *g) {
    g->ih = ih;
    g->iw = iw;
    if (letterbox < 0 || ih < 1 || iw < 1) {
        g->nh = h;
        g->nw = w;
        g->top = g->left = 0;
        return;
    }
    double r = fmin((double)h / ih, (double)w / iw);
    int nh = (int)floor(ih * r + 0.5), nw = (int)floor(iw * r + 0.5);
    g->nh = nh < 1 ? 1 : nh > h ? h : nh;
    g->nw = nw < 1 ? 1 : nw > w ? w : nw;
    g->top = (h - g->nh) / 2;
    g->left = (w - g->nw) / 2;
}

static float clip(float v, float hi) { return fminf(fmaxf(v, 0.0f), hi); } /* NaN -> 0 */

void ep_det_to_image(const ep_det_geom *g, ep_det_box *b, int n) {
    if (g->ih < 1 || g->iw < 1) return;
    float gx = (float)((double)g->iw / g->nw), gy = (float)((double)g->ih / g->nh);
    float l = (float)g->left, t = (float)g->top, W = (float)g->iw, H = (float)g->ih;
    for (int i = 0; i < n; i++) {
        b[i].x1 = clip((b[i].x1 - l) * gx, W);
        b[i].x2 = clip((b[i].x2 - l) * gx, W);
        b[i].y1 = clip((b[i].y1 - t) * gy, H);
        b[i].y2 = clip((b[i].y2 - t) * gy, H);
    }
}
