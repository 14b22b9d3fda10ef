/* The image decoder of artifacts built without image preprocessing: they take no image files, and
 * leaving stb_image out keeps them ~35 KB smaller (edgepack/bundle.py picks this or ep_image.c). */
#include "ep_server.h"

#include <string.h>

void ep_image_set_max_pixels(uint64_t n) { (void)n; }

int ep_image_check(const unsigned char *buf, size_t len, int *w, int *h, ep_status *st) {
    (void)buf;
    (void)len;
    *w = *h = 0;
    return ep_fail(st, EP_ERR_INPUT, "this model takes no images (build it with --preprocess image:...)");
}

int ep_image_decode(const unsigned char *buf, size_t len, int channels, ep_tensor *out, ep_status *st) {
    (void)buf;
    (void)len;
    (void)channels;
    memset(out, 0, sizeof *out);
    return ep_fail(st, EP_ERR_INPUT, "this model takes no images (build it with --preprocess image:...)");
}
