/* Decode + NMS alone (runtimes/common/ep_detect.c), at the artifact's -O2, on a synthetic YOLOv8n-sized
 * output [1, 84, 8400] with exactly K boxes above conf (well apart, so NMS keeps all K) and the other
 * anchors just below it: the time per image for K kept boxes. Built and run by bench/bench_detect.py.
 *   bench_detect_micro K RUNS -> one JSON line */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "ep_detect.h"

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int k = argc > 1 ? atoi(argv[1]) : 100, runs = argc > 2 ? atoi(argv[2]) : 200;
    ep_det_cfg c = {EP_DET_YOLOV8, 80, 8400, 1, 0, 0, 300, 0.25f, 0.45f, 640, 640, 3, {8, 16, 32}};
    size_t n = 8400, feat = 84;
    float *out = calloc(n * feat, sizeof *out);
    size_t wn = ep_detect_work_size(&c);
    ep_det_box *work = malloc(wn * sizeof *work), *dets = malloc(300 * sizeof *dets);
    double *t = malloc((size_t)runs * sizeof *t);
    if (!out || !work || !dets || !t || k < 0 || k > 300) return 2;
    srand(1);
    for (size_t i = 0; i < n; i++) {
        int keep = (int)(i % (n / (k ? k : 1))) == 0 && (int)(i / (n / (k ? k : 1))) < k;
        int j = (int)(i / (n / (k ? k : 1)));
        out[0 * n + i] = keep ? 32.0f + (j % 10) * 60 : 320; /* boxes 40x40 on a 10-wide grid: no overlap */
        out[1 * n + i] = keep ? 32.0f + (j / 10) * 60 : 320;
        out[2 * n + i] = out[3 * n + i] = 40;
        for (size_t q = 0; q < 80; q++) out[(4 + q) * n + i] = (float)rand() / RAND_MAX * 0.2f; /* below conf */
        if (keep) out[(4 + (size_t)(j % 80)) * n + i] = 0.5f + 0.4f * (float)rand() / RAND_MAX;
    }
    ep_status st = {0, ""};
    int nd = 0;
    for (int r = 0; r < runs; r++) {
        double t0 = now_ms();
        if (ep_detect(&c, out, n * feat, work, wn, dets, 300, &nd, &st)) return fprintf(stderr, "%s\n", st.message), 1;
        t[r] = now_ms() - t0;
    }
    qsort(t, (size_t)runs, sizeof *t, cmp);
    printf("{\"anchors\": 8400, \"classes\": 80, \"kept\": %d, \"runs\": %d, \"min_ms\": %.4f, \"median_ms\": %.4f}\n", nd,
           runs, t[0], t[runs / 2]);
    return 0;
}
