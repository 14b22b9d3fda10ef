/* Images in: PNG, JPEG and binary PPM/PGM decoded by stb_image (Debian libstb-dev, found at build
 * time, not vendored), then resized into the baked model input. The resize is edgepack's own
 * (half-pixel centres, no antialiasing) and matches edgepack/prepost.py:resize_image. */
#include "ep_io.h"

#include <stdlib.h>
#include <string.h>

#define STB_IMAGE_IMPLEMENTATION
#define STBI_ONLY_PNG
#define STBI_ONLY_JPEG
#define STBI_ONLY_PNM
#define STBI_NO_STDIO
#define STBI_NO_LINEAR
#define STBI_NO_HDR
#define STBI_MAX_DIMENSIONS 8192
#if defined(__clang__)
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wall"
#pragma clang diagnostic ignored "-Wextra"
/* the decoder is size-optimised (-Oz-like) whatever the build's -O: it is the runtime's largest part */
#pragma clang attribute push(__attribute__((minsize)), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wall"
#pragma GCC diagnostic ignored "-Wextra"
#endif
#include "stb_image.h"
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang diagnostic pop
#elif defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

int ep_image_sniff(const unsigned char *b, size_t len) {
    if (len >= 8 && memcmp(b, "\x89PNG\r\n\x1a\n", 8) == 0) return 1;
    if (len >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF) return 1;
    if (len >= 3 && b[0] == 'P' && (b[1] == '5' || b[1] == '6') &&
        (b[2] == ' ' || b[2] == '\n' || b[2] == '\r' || b[2] == '\t'))
        return 1;
    return 0;
}

int ep_image_decode(const unsigned char *buf, size_t len, int channels, ep_tensor *out, ep_status *st) {
    memset(out, 0, sizeof *out);
    if (len > 0x7fffffff) return ep_fail(st, EP_ERR_INPUT, "image too large");
    int w, h, n;
    unsigned char *px = stbi_load_from_memory(buf, (int)len, &w, &h, &n, channels);
    if (!px) return ep_fail(st, EP_ERR_INPUT, "cannot decode the image (%s)", stbi_failure_reason());
    int64_t shape[3] = {h, w, channels};
    int rc = ep_tensor_alloc(out, EP_U8, 3, shape, st);
    if (!rc) memcpy(out->data, px, out->nbytes);
    stbi_image_free(px);
    return rc;
}

int ep_image_to_input(const ep_tensor *img, const ep_prepost *pp, const ep_io_spec *in, ep_tensor *out,
                      ep_status *st) {
    int ih = (int)img->shape[0], iw = (int)img->shape[1], c = (int)img->shape[2];
    int h = pp->h, w = pp->w;
    if (c != pp->c) return ep_fail(st, EP_ERR_INPUT, "image has %d channels, the model takes %d", c, pp->c);
    if ((ih != h || iw != w) && pp->resize == 0)
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
    float sy = (float)((double)ih / h), sx = (float)((double)iw / w);
    for (int y = 0; y < h; y++) {
        int y0, y1;
        float fy;
        if (pp->resize == 2) {
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
            if (pp->resize == 2) {
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
                size_t at = pp->nchw ? ((size_t)ch * h + y) * w + x : ((size_t)y * w + x) * c + ch;
                dst[at] = v;
            }
        }
    }
    return EP_OK;
}
