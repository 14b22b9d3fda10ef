/* Images in: PNG, JPEG and binary PPM/PGM decoded by stb_image (Debian libstb-dev, found at build
 * time, not vendored). Linked only into artifacts built with image preprocessing; the others get
 * ep_image_none.c (see edgepack/bundle.py). The resize into the model input is in ep_predict.c.
 *
 * stb_image trusts its input more than a server may (issue #11: a 16-bit PNM header crashed the
 * packaged 2.27; a PNM header with no pixels decoded to whatever the allocator handed back). So the
 * bytes are checked here first, by our own strict parsers: the format and its 8-bit depth, the
 * dimensions against a pixel limit, and that the whole payload is present. Only then does stb
 * decode, with every allocation zeroed and capped by what that image can legitimately need. */
#include "ep_server.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* What one decode may allocate at most (set per call, per thread): a zlib bomb inside a PNG, or a
 * header that lies, ends in a refused allocation instead of gigabytes. */
static _Thread_local size_t alloc_cap;

static void *img_malloc(size_t n) { return n <= alloc_cap ? calloc(1, n ? n : 1) : NULL; }
static void *img_realloc(void *p, size_t n) { return n <= alloc_cap ? realloc(p, n ? n : 1) : NULL; }

#define STB_IMAGE_IMPLEMENTATION
#define STBI_ONLY_PNG
#define STBI_ONLY_JPEG
#define STBI_ONLY_PNM
#define STBI_NO_STDIO
#define STBI_NO_LINEAR
#define STBI_NO_HDR
#define STBI_MAX_DIMENSIONS 8192
#define STBI_MALLOC(n) img_malloc(n)
#define STBI_REALLOC(p, n) img_realloc(p, n)
#define STBI_FREE(p) free(p)
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

EP_SIZE_OPT_BEGIN

#define MAX_SIDE 8192 /* = STBI_MAX_DIMENSIONS */

static uint64_t max_pixels = EP_DEFAULT_MAX_PIXELS;

void ep_image_set_max_pixels(uint64_t n) { max_pixels = n; }

static uint32_t be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static unsigned be16(const unsigned char *p) { return (unsigned)p[0] << 8 | p[1]; }

/* ---- PNG: IHDR first (8-bit or less), then whole chunks up to IEND ----------------------- */
static int check_png(const unsigned char *b, size_t len, int *w, int *h, ep_status *st) {
    if (len < 8 + 25 || be32(b + 8) != 13 || memcmp(b + 12, "IHDR", 4) != 0)
        return ep_fail(st, EP_ERR_INPUT, "PNG: no IHDR header (truncated or not a PNG)");
    uint32_t pw = be32(b + 16), ph = be32(b + 20);
    unsigned depth = b[24], color = b[25];
    if (depth == 16) return ep_fail(st, EP_ERR_INPUT, "PNG: 16-bit images are not accepted: send an 8-bit PNG");
    if (depth != 1 && depth != 2 && depth != 4 && depth != 8)
        return ep_fail(st, EP_ERR_INPUT, "PNG: bit depth %u is not valid", depth);
    if (color != 0 && color != 2 && color != 3 && color != 4 && color != 6)
        return ep_fail(st, EP_ERR_INPUT, "PNG: colour type %u is not valid", color);
    if (!pw || !ph || pw > MAX_SIDE || ph > MAX_SIDE)
        return ep_fail(st, EP_ERR_INPUT, "PNG: %ux%u pixels: each side must be 1..%d", (unsigned)pw, (unsigned)ph,
                       MAX_SIDE);
    size_t pos = 8;
    int idat = 0;
    while (len - pos >= 12) {
        uint32_t clen = be32(b + pos);
        if (clen > 0x7fffffffu) return ep_fail(st, EP_ERR_INPUT, "PNG: corrupt chunk length");
        if ((size_t)clen > len - pos - 12) break; /* truncated inside a chunk */
        const unsigned char *type = b + pos + 4;
        if (memcmp(type, "IDAT", 4) == 0) idat = 1;
        if (memcmp(type, "IEND", 4) == 0) {
            if (!idat) return ep_fail(st, EP_ERR_INPUT, "PNG: no image data (IDAT)");
            *w = (int)pw;
            *h = (int)ph;
            return EP_OK;
        }
        pos += 12 + (size_t)clen;
    }
    return ep_fail(st, EP_ERR_INPUT, "PNG: truncated (the file ends before its IEND chunk)");
}

/* ---- JPEG: markers up to SOF (baseline/extended/progressive, 8-bit), scans, EOI ------------ */
static int check_jpeg(const unsigned char *b, size_t len, int *w, int *h, ep_status *st) {
    size_t pos = 2;
    int sof = 0, sos = 0;
    while (1) {
        while (pos < len && b[pos] != 0xFF) pos++; /* stb also skips stray bytes between segments */
        while (pos < len && b[pos] == 0xFF) pos++; /* fill bytes */
        if (pos >= len) break;
        unsigned m = b[pos++];
        if (m == 0xD9) {
            if (!sof || !sos) return ep_fail(st, EP_ERR_INPUT, "JPEG: ends before any image data");
            return EP_OK;
        }
        if ((m >= 0xD0 && m <= 0xD7) || m == 0x01) continue; /* standalone markers */
        if (m == 0xD8 || m == 0x00) return ep_fail(st, EP_ERR_INPUT, "JPEG: corrupt marker structure");
        if (len - pos < 2) break;
        unsigned seg = be16(b + pos);
        if (seg < 2) return ep_fail(st, EP_ERR_INPUT, "JPEG: corrupt segment length");
        if (seg > len - pos) break;
        const unsigned char *s = b + pos;
        if (m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC) {
            if (m > 0xC2)
                return ep_fail(st, EP_ERR_INPUT, "JPEG: lossless, arithmetic-coded or hierarchical JPEG is not "
                               "accepted: send a baseline or progressive JPEG");
            if (sof) return ep_fail(st, EP_ERR_INPUT, "JPEG: more than one frame header");
            if (seg < 8) return ep_fail(st, EP_ERR_INPUT, "JPEG: corrupt frame header");
            if (s[2] != 8) return ep_fail(st, EP_ERR_INPUT, "JPEG: %u-bit samples are not accepted: send an 8-bit JPEG", s[2]);
            unsigned jh = be16(s + 3), jw = be16(s + 5), nc = s[7];
            if (!jw || !jh || jw > MAX_SIDE || jh > MAX_SIDE)
                return ep_fail(st, EP_ERR_INPUT, "JPEG: %ux%u pixels: each side must be 1..%d", jw, jh, MAX_SIDE);
            if (nc != 1 && nc != 3 && nc != 4) return ep_fail(st, EP_ERR_INPUT, "JPEG: %u colour components", nc);
            *w = (int)jw;
            *h = (int)jh;
            sof = 1;
        }
        if (m == 0xC4) {
            /* stb 2.27 writes a table's symbols without checking their count against its 256 slots
             * (fixed upstream in 2.28): refuse counts over 256 here, and any table that overruns */
            for (size_t p = 2; p < seg;) {
                if (seg - p < 17 || (s[p] >> 4) > 1 || (s[p] & 15) > 3)
                    return ep_fail(st, EP_ERR_INPUT, "JPEG: corrupt Huffman table");
                size_t n = 0;
                for (int i = 1; i <= 16; i++) n += s[p + i];
                if (n > 256 || seg - p - 17 < n) return ep_fail(st, EP_ERR_INPUT, "JPEG: corrupt Huffman table");
                p += 17 + n;
            }
        }
        pos += seg;
        if (m == 0xDA) {
            if (!sof) return ep_fail(st, EP_ERR_INPUT, "JPEG: scan before the frame header");
            sos = 1;
            /* entropy-coded data: runs to the next marker that is neither a stuffed 0xFF00 nor RSTn */
            while (pos < len) {
                if (b[pos] != 0xFF) {
                    pos++;
                    continue;
                }
                if (pos + 1 >= len) break;
                unsigned n = b[pos + 1];
                if (n == 0x00 || (n >= 0xD0 && n <= 0xD7)) pos += 2;
                else if (n == 0xFF) pos++;
                else break;
            }
        }
    }
    return ep_fail(st, EP_ERR_INPUT, "JPEG: truncated (the file ends before its end-of-image marker)");
}

/* ---- binary PGM/PPM: P5/P6, width, height, maxval 255, one whitespace, all w*h*c bytes ------ */
static int pnm_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

/* Whitespace and comments, then 1..5 digits: the same tokens stb_image reads, but bounded. */
static int pnm_int(const unsigned char *b, size_t len, size_t *pos, unsigned *v) {
    size_t p = *pos;
    while (p < len) {
        if (pnm_space(b[p])) p++;
        else if (b[p] == '#') while (p < len && b[p] != '\n' && b[p] != '\r') p++;
        else break;
    }
    unsigned x = 0;
    int nd = 0;
    while (p < len && b[p] >= '0' && b[p] <= '9') {
        if (++nd > 5) return 0;
        x = x * 10 + (unsigned)(b[p++] - '0');
    }
    if (!nd || p >= len || !pnm_space(b[p])) return 0; /* a token must end in whitespace */
    *v = x;
    *pos = p;
    return 1;
}

static int check_pnm(const unsigned char *b, size_t len, int *w, int *h, ep_status *st) {
    size_t pos = 2;
    unsigned pw, ph, maxv;
    if (len < 3 || !pnm_space(b[2]) || !pnm_int(b, len, &pos, &pw) || !pnm_int(b, len, &pos, &ph) ||
        !pnm_int(b, len, &pos, &maxv))
        return ep_fail(st, EP_ERR_INPUT, "PNM: malformed header (expected P5/P6, width, height, 255)");
    if (maxv != 255)
        return ep_fail(st, EP_ERR_INPUT, "PNM: maxval %u: only 8-bit binary PGM/PPM (maxval 255) is accepted%s",
                       maxv, maxv > 255 ? " (16-bit images are refused)" : "");
    if (!pw || !ph || pw > MAX_SIDE || ph > MAX_SIDE)
        return ep_fail(st, EP_ERR_INPUT, "PNM: %ux%u pixels: each side must be 1..%d", pw, ph, MAX_SIDE);
    size_t need = (size_t)pw * ph * (b[1] == '6' ? 3 : 1);
    pos++; /* the single whitespace after maxval */
    if (len - pos < need)
        return ep_fail(st, EP_ERR_INPUT, "PNM: truncated: %ux%u needs %zu pixel bytes, the body has %zu", pw, ph,
                       need, len - pos);
    *w = (int)pw;
    *h = (int)ph;
    return EP_OK;
}

/* The largest single buffer a valid image of this size needs: inflated PNG rows (4 bytes a pixel
 * plus filter bytes), JPEG coefficients (2 bytes a padded sample, per component), the joined IDATs,
 * the decoder's own state (~20 KB for JPEG). */
static size_t decode_cap(int w, int h, size_t len) {
    return (size_t)(w + 16) * (size_t)(h + 16) * 8 + 2 * len + ((size_t)1 << 20);
}

int ep_image_check(const unsigned char *b, size_t len, int *w, int *h, ep_status *st) {
    int rc;
    *w = *h = 0;
    if (len > 0x7fffffff) return ep_fail(st, EP_ERR_INPUT, "image too large (over 2 GiB)");
    if (len >= 8 && memcmp(b, "\x89PNG\r\n\x1a\n", 8) == 0) rc = check_png(b, len, w, h, st);
    else if (len >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF) rc = check_jpeg(b, len, w, h, st);
    else if (len >= 2 && b[0] == 'P' && (b[1] == '5' || b[1] == '6')) rc = check_pnm(b, len, w, h, st);
    else return ep_fail(st, EP_ERR_INPUT, "cannot decode the image: not a PNG, JPEG or binary PGM/PPM image");
    if (rc) {
        char why[sizeof st->message];
        snprintf(why, sizeof why, "%s", st->message);
        return ep_fail(st, EP_ERR_INPUT, "cannot decode the image: %s", why);
    }
    if ((uint64_t)*w * (uint64_t)*h > max_pixels)
        return ep_fail(st, EP_ERR_INPUT, "image is %dx%d = %llu pixels, over the limit of %llu (serve --max-pixels)",
                       *w, *h, (unsigned long long)*w * (unsigned long long)*h, (unsigned long long)max_pixels);
    /* stb's own reading of the header must agree with ours before it is let near the pixels */
    int sw, sh, sn;
    alloc_cap = decode_cap(*w, *h, len);
    int info = stbi_info_from_memory(b, (int)len, &sw, &sh, &sn), is16 = stbi_is_16_bit_from_memory(b, (int)len);
    alloc_cap = 0;
    if (!info || sw != *w || sh != *h) return ep_fail(st, EP_ERR_INPUT, "cannot decode the image: inconsistent header");
    if (is16) return ep_fail(st, EP_ERR_INPUT, "cannot decode the image: 16-bit images are not accepted");
    return EP_OK;
}

int ep_image_decode(const unsigned char *buf, size_t len, int channels, ep_tensor *out, ep_status *st) {
    memset(out, 0, sizeof *out);
    int w, h, n;
    int rc = ep_image_check(buf, len, &w, &h, st);
    if (rc) return rc;
    alloc_cap = decode_cap(w, h, len);
    int dw, dh;
    unsigned char *px = stbi_load_from_memory(buf, (int)len, &dw, &dh, &n, channels);
    alloc_cap = 0;
    if (!px) return ep_fail(st, EP_ERR_INPUT, "cannot decode the image (%s)", stbi_failure_reason());
    if (dw != w || dh != h) {
        stbi_image_free(px);
        return ep_fail(st, EP_ERR_INPUT, "cannot decode the image: inconsistent header");
    }
    int64_t shape[3] = {h, w, channels};
    rc = ep_tensor_alloc(out, EP_U8, 3, shape, st);
    if (!rc) memcpy(out->data, px, out->nbytes);
    stbi_image_free(px);
    return rc;
}

EP_SIZE_OPT_END
