/* Fuzz target for the artifact's detection decoding + NMS (runtimes/common/ep_detect.c): a model's
 * raw output is whatever its weights make of an untrusted image, NaN, Inf and huge values included.
 *
 * The first 10 bytes choose the settings (format, classes, layout, grid, NMS), the rest are the
 * output's float32 values (repeated to fill it). Besides ASan/UBSan, the answer's invariants are
 * checked: at most max_det boxes, scores above conf and non-increasing, classes in range, and no
 * two kept boxes (of one class unless agnostic) overlapping by more than iou. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ep_detect.h"
#include "fuzz_driver.h"

static float box_iou(const ep_det_box *a, const ep_det_box *b) {
    float ix = fminf(a->x2, b->x2) - fmaxf(a->x1, b->x1), iy = fminf(a->y2, b->y2) - fmaxf(a->y1, b->y1);
    if (!(ix > 0) || !(iy > 0)) return 0;
    float inter = ix * iy, uni = (a->x2 - a->x1) * (a->y2 - a->y1) + (b->x2 - b->x1) * (b->y2 - b->y1) - inter;
    return uni > 0 ? inter / uni : 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 10) return 0;
    ep_det_cfg c;
    memset(&c, 0, sizeof c);
    c.format = (ep_det_format)(data[0] % 3);
    c.classes = 1 + data[1] % 16;
    c.channels_first = data[2] & 1;
    c.grid = c.format == EP_DET_YOLOX && (data[2] & 2);
    c.agnostic = (data[2] & 4) != 0;
    c.max_det = 1 + data[3] % 64;
    c.conf = data[4] / 255.0f;
    c.iou = data[5] / 255.0f;
    c.in_h = 8 * (1 + data[6] % 8);
    c.in_w = 8 * (1 + data[7] % 8);
    c.n_strides = 3;
    c.strides[0] = 8, c.strides[1] = 16, c.strides[2] = 32;
    if (c.grid) {
        for (int i = 0; i < 3; i++)
            c.anchors += ((c.in_h + c.strides[i] - 1) / c.strides[i]) * ((c.in_w + c.strides[i] - 1) / c.strides[i]);
    } else {
        c.anchors = 1 + (int)((data[8] | data[9] << 8) % 512);
    }
    size_t feat = (size_t)c.classes + (c.format == EP_DET_YOLOV8 ? 4 : 5), n = feat * (size_t)c.anchors;
    float *out = malloc(n * sizeof *out);
    ep_det_box *work = malloc(ep_detect_work_size(&c) * sizeof *work), *dets = malloc((size_t)c.max_det * sizeof *dets);
    if (!out || !work || !dets) abort();
    size_t nf = (size - 10) / 4;
    for (size_t i = 0; i < n; i++) {
        if (nf) memcpy(&out[i], data + 10 + 4 * (i % nf), 4);
        else out[i] = 0;
    }
    ep_status st = {0, ""};
    int nd = -1;
    if (ep_detect(&c, out, n, work, ep_detect_work_size(&c), dets, c.max_det, &nd, &st) != EP_OK)
        fuzz_fail("ep_detect refused valid settings");
    if (nd < 0 || nd > c.max_det) fuzz_fail("more boxes than max_det");
    for (int i = 0; i < nd; i++) {
        if (!(dets[i].score > c.conf)) fuzz_fail("a kept box scores at or below conf");
        if (i && dets[i].score > dets[i - 1].score) fuzz_fail("boxes not sorted by score");
        if (dets[i].cls < 0 || dets[i].cls >= c.classes) fuzz_fail("class out of range");
        for (int k = 0; k < i; k++)
            if ((c.agnostic || dets[k].cls == dets[i].cls) && box_iou(&dets[i], &dets[k]) > c.iou)
                fuzz_fail("two kept boxes overlap past iou");
    }
    /* the mapping back to an image: finite in, clipped to the image out */
    ep_det_geom g;
    ep_det_geometry(1 + data[6] * 3, 1 + data[7] * 5, c.in_h, c.in_w, data[8] & 1 ? 114 : -1, &g);
    ep_det_to_image(&g, dets, nd);
    for (int i = 0; i < nd; i++)
        if (!(dets[i].x1 >= 0 && dets[i].x2 <= (float)g.iw && dets[i].y1 >= 0 && dets[i].y2 <= (float)g.ih))
            fuzz_fail("a mapped box leaves the image");
    free(out);
    free(work);
    free(dets);
    return 0;
}

#ifndef EP_LIBFUZZER
static const char *const TOKENS[] = {"\x00\x00\xc0\x7f", "\x00\x00\x80\x7f", "\x00\x00\x80\xff", "\x00\x00\x80\x3f",
                                     "\x00\x00\x00\x3f", "\xff\xff\x7f\x7f", "\x00\x00\x00\x00", "\x01\x00\x00\x00"};

int main(int argc, char **argv) {
    return fuzz_main(argc, argv, TOKENS, sizeof TOKENS / sizeof TOKENS[0], 1 << 16);
}
#endif
