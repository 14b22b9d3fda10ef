/* `serve` limits and the strict image checks (issue #11): declarations kept out of ep_io.h so the
 * server and the image decoder can change without touching the shared runtime headers.
 *
 * ep_serve.c    a poll() loop owns every socket (deadlines per request, keep-alive, a bound on
 *               connections); a small pool of worker threads parses, decodes and answers /predict;
 *               inference itself is serialised by one mutex (engines need not be thread-safe).
 * ep_image.c    checks format, bit depth, dimensions and payload length before stb_image decodes.
 */
#ifndef EP_SERVER_H
#define EP_SERVER_H

#include "ep_io.h"

#include <stdint.h>

typedef struct {
    uint64_t max_pixels;  /* decoded image width*height (also bounds the decoder's allocations) */
    int max_rows;         /* CSV rows per request */
    int max_conns;        /* open connections; more are answered 503 and closed */
    int workers;          /* threads that parse/decode/answer /predict */
    double head_timeout_s; /* deadline for a whole request head (also the keep-alive idle time) */
    double body_timeout_s; /* deadline for a whole body, from the end of its head */
} ep_serve_limits;

#define EP_DEFAULT_MAX_PIXELS ((uint64_t)4096 * 4096)
extern ep_serve_limits ep_serve_cfg;

/* Command-line hook: 1 when NAME is a serve limit option (VALUE consumed and stored in ep_serve_cfg),
 * 0 when it is not one of ours, -1 on a bad value (st filled, EP_ERR_USAGE). */
int ep_serve_option(const char *name, const char *value, ep_status *st);
#define EP_SERVE_OPTIONS_USAGE                                                                          \
    "        [--max-pixels N] [--max-rows N] [--max-conns N] [--workers N]\n"                            \
    "        [--head-timeout S] [--body-timeout S]\n"

/* HTTP/1.1 keeps the connection unless "Connection: close"; 1.0 closes unless "keep-alive".
 * HEAD is a complete request head of HEAD_LEN bytes (as accepted by ep_http_parse). */
int ep_http_keep_alive(const char *head, size_t head_len);

/* Image decoding limits; ep_image_decode refuses images with more pixels. */
void ep_image_set_max_pixels(uint64_t n);
/* The strict pre-decode check: format (PNG, JPEG baseline/progressive, binary PGM/PPM), 8-bit depth,
 * 1..limit pixels, and a complete payload. Fills *w, *h; EP_OK or EP_ERR_INPUT with a message. */
int ep_image_check(const unsigned char *buf, size_t len, int *w, int *h, ep_status *st);

#endif
