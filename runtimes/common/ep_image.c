/* Images in: PNG, JPEG and binary PPM/PGM decoded by stb_image (Debian libstb-dev, found at build
 * time, not vendored). Linked only into artifacts built with image preprocessing; the others get
 * ep_image_none.c (see edgepack/bundle.py). The resize into the model input is in ep_predict.c. */
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
