/* HTTP/1.x request-head parser for untrusted bytes (fuzzed: tests/fuzz/http_fuzz.c).
 * Only what `serve` needs: method, path, Content-Type, Content-Length, Transfer-Encoding, Expect. */
#include "ep_server.h"

#include <string.h>

EP_SIZE_OPT_BEGIN

static int is_tchar(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           (c && strchr("!#$%&'*+-.^_`|~", c));
}

static int ieq(const char *a, size_t alen, const char *b) {
    size_t bl = strlen(b);
    if (alen != bl) return 0;
    for (size_t i = 0; i < alen; i++) {
        char x = a[i], y = b[i];
        if (x >= 'A' && x <= 'Z') x = (char)(x - 'A' + 'a');
        if (y >= 'A' && y <= 'Z') y = (char)(y - 'A' + 'a');
        if (x != y) return 0;
    }
    return 1;
}

/* Finds the end of the head ("\r\n\r\n" or "\n\n"); 0 when absent. */
static size_t head_end(const char *b, size_t len) {
    for (size_t i = 0; i + 1 < len; i++) {
        if (b[i] == '\n' && b[i + 1] == '\n') return i + 2;
        if (b[i] == '\n' && b[i + 1] == '\r' && i + 2 < len && b[i + 2] == '\n') return i + 3;
    }
    return 0;
}

int ep_http_parse(const char *buf, size_t len, ep_http_req *r) {
    memset(r, 0, sizeof *r);
    r->content_length = -1;
    size_t end = head_end(buf, len);
    if (!end) return len >= EP_HTTP_MAX_HEAD ? -431 : 0;
    if (end > EP_HTTP_MAX_HEAD) return -431;
    size_t pos = 0;
    /* request line: METHOD SP TARGET SP HTTP/1.x */
    size_t m = 0;
    while (pos < end && is_tchar((unsigned char)buf[pos])) {
        if (m + 1 >= sizeof r->method) return -501;
        r->method[m++] = buf[pos++];
    }
    if (!m || pos >= end || buf[pos] != ' ') return -400;
    pos++;
    size_t p = 0;
    if (pos >= end || buf[pos] != '/') return -400;
    while (pos < end && buf[pos] != ' ') {
        unsigned char c = (unsigned char)buf[pos];
        if (c <= 0x20 || c == 0x7f) return -400;
        if (p + 1 >= sizeof r->path) return -414;
        r->path[p++] = (char)c;
        pos++;
    }
    if (pos >= end) return -400;
    pos++;
    if (end - pos < 9 || memcmp(buf + pos, "HTTP/1.", 7) != 0 || (buf[pos + 7] != '0' && buf[pos + 7] != '1'))
        return -400;
    pos += 8;
    if (buf[pos] == '\r') pos++;
    if (pos >= end || buf[pos] != '\n') return -400;
    pos++;
    /* header fields */
    while (pos < end) {
        if (buf[pos] == '\n') break;
        if (buf[pos] == '\r' && pos + 1 < end && buf[pos + 1] == '\n') break;
        size_t ns = pos;
        while (pos < end && is_tchar((unsigned char)buf[pos])) pos++;
        size_t nl = pos - ns;
        if (!nl || pos >= end || buf[pos] != ':') return -400;
        pos++;
        while (pos < end && (buf[pos] == ' ' || buf[pos] == '\t')) pos++;
        size_t vs = pos;
        while (pos < end && buf[pos] != '\n') {
            unsigned char c = (unsigned char)buf[pos];
            if ((c < 0x20 && c != '\t' && c != '\r') || c == 0x7f) return -400;
            if (c == '\r' && (pos + 1 >= end || buf[pos + 1] != '\n')) return -400;
            pos++;
        }
        if (pos >= end) return -400;
        size_t ve = pos;
        pos++;
        if (ve > vs && buf[ve - 1] == '\r') ve--;
        while (ve > vs && (buf[ve - 1] == ' ' || buf[ve - 1] == '\t')) ve--;
        const char *name = buf + ns, *val = buf + vs;
        size_t vl = ve - vs;
        if (ieq(name, nl, "content-length")) {
            if (!vl || vl > 15) return -400;
            long long v = 0;
            for (size_t i = 0; i < vl; i++) {
                if (val[i] < '0' || val[i] > '9') return -400;
                v = v * 10 + (val[i] - '0');
            }
            if (r->content_length >= 0 && r->content_length != v) return -400;
            r->content_length = v;
        } else if (ieq(name, nl, "content-type")) {
            size_t n = vl < sizeof r->content_type - 1 ? vl : sizeof r->content_type - 1;
            memcpy(r->content_type, val, n);
            r->content_type[n] = 0;
        } else if (ieq(name, nl, "transfer-encoding")) {
            r->chunked = 1; /* any transfer coding: not supported, answered 411/501 */
        } else if (ieq(name, nl, "expect")) {
            if (ieq(val, vl, "100-continue")) r->expect_continue = 1;
            else return -417;
        }
    }
    if (r->chunked && r->content_length >= 0) return -400; /* request smuggling shape */
    return (int)end;
}

/* Does the comma-separated token list [v, v+vl) hold TOKEN (case-insensitive)? */
static int has_token(const char *v, size_t vl, const char *token) {
    size_t i = 0;
    while (i < vl) {
        while (i < vl && (v[i] == ' ' || v[i] == '\t' || v[i] == ',')) i++;
        size_t s = i;
        while (i < vl && v[i] != ',') i++;
        size_t e = i;
        while (e > s && (v[e - 1] == ' ' || v[e - 1] == '\t')) e--;
        if (e > s && ieq(v + s, e - s, token)) return 1;
    }
    return 0;
}

int ep_http_keep_alive(const char *b, size_t len) {
    /* the request line was validated by ep_http_parse: "METHOD SP TARGET SP HTTP/1.x" */
    size_t pos = 0;
    while (pos < len && b[pos] != '\n') pos++;
    if (pos < 9) return 0;
    size_t ve = pos > 0 && b[pos - 1] == '\r' ? pos - 1 : pos;
    if (ve < 8) return 0;
    int keep = memcmp(b + ve - 8, "HTTP/1.1", 8) == 0;
    pos++;
    while (pos < len) {
        size_t ls = pos;
        while (pos < len && b[pos] != '\n') pos++;
        size_t le = pos;
        pos++;
        if (le > ls && b[le - 1] == '\r') le--;
        if (le == ls) break; /* end of head */
        const char *colon = memchr(b + ls, ':', le - ls);
        if (!colon || !ieq(b + ls, (size_t)(colon - (b + ls)), "connection")) continue;
        const char *v = colon + 1;
        size_t vl = (size_t)(b + le - v);
        if (has_token(v, vl, "close")) return 0;
        if (has_token(v, vl, "keep-alive")) keep = 1;
    }
    return keep;
}

EP_SIZE_OPT_END
