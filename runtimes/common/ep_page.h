/* The try-it page's files (ep_page.c), served by ep_serve.c at fixed paths. */
#ifndef EP_PAGE_H
#define EP_PAGE_H

#include <stddef.h>

typedef struct {
    const char *path, *content_type, *body;
    size_t len;
} ep_page_asset;

/* The page's file at PATH ("/", "/page.js", "/page.css"), or NULL. */
const ep_page_asset *ep_page_find(const char *path);

/* Sent with every answer: the page may load only its own script and style and fetch only this origin;
 * no inline script, no plugins, no framing, no form posts elsewhere. */
#define EP_PAGE_CSP                                                                                      \
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; base-uri 'none'; "     \
    "form-action 'none'; frame-ancestors 'none'"

#endif
