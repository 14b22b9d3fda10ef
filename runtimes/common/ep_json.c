/* A small JSON parser for untrusted request bodies: recursive descent with a depth limit, nodes in
 * one growing array, decoded strings in one buffer no larger than the input. */
#include "ep_io.h"

#include <stdlib.h>
#include <string.h>

EP_SIZE_OPT_BEGIN

typedef struct {
    const char *s;
    size_t len, pos;
    ep_json *d;
    ep_status *st;
} jp;

static void ws(jp *p) {
    while (p->pos < p->len && (p->s[p->pos] == ' ' || p->s[p->pos] == '\t' || p->s[p->pos] == '\n' || p->s[p->pos] == '\r'))
        p->pos++;
}

static int new_node(jp *p, ep_jtype t) {
    ep_json *d = p->d;
    if (d->n == d->cap) {
        int cap = d->cap ? d->cap * 2 : 64;
        ep_jnode *nn = realloc(d->nodes, (size_t)cap * sizeof *nn);
        if (!nn) return -1;
        d->nodes = nn;
        d->cap = cap;
    }
    ep_jnode *n = &d->nodes[d->n];
    memset(n, 0, sizeof *n);
    n->type = t;
    n->child = n->next = -1;
    return d->n++;
}

static int err(jp *p, const char *what) {
    ep_fail(p->st, EP_ERR_INPUT, "invalid JSON at byte %zu: %s", p->pos, what);
    return -1;
}

static int hex4(const char *s, unsigned *out) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return 0;
    }
    *out = v;
    return 1;
}

/* Decodes the string at p->pos (on the opening quote) into d->strings; returns its offset. */
static long parse_str(jp *p) {
    ep_json *d = p->d;
    p->pos++;
    size_t start = d->spos;
    while (1) {
        if (p->pos >= p->len) return err(p, "unterminated string");
        unsigned char c = (unsigned char)p->s[p->pos++];
        if (c == '"') break;
        if (c < 0x20) return err(p, "control character in string");
        if (c != '\\') {
            d->strings[d->spos++] = (char)c;
            continue;
        }
        if (p->pos >= p->len) return err(p, "unterminated escape");
        char e = p->s[p->pos++];
        switch (e) {
        case '"': case '\\': case '/': d->strings[d->spos++] = e; break;
        case 'b': d->strings[d->spos++] = '\b'; break;
        case 'f': d->strings[d->spos++] = '\f'; break;
        case 'n': d->strings[d->spos++] = '\n'; break;
        case 'r': d->strings[d->spos++] = '\r'; break;
        case 't': d->strings[d->spos++] = '\t'; break;
        case 'u': {
            unsigned u;
            if (p->len - p->pos < 4 || !hex4(p->s + p->pos, &u)) return err(p, "bad \\u escape");
            p->pos += 4;
            if (u >= 0xD800 && u < 0xDC00 && p->len - p->pos >= 6 && p->s[p->pos] == '\\' && p->s[p->pos + 1] == 'u') {
                unsigned lo;
                if (hex4(p->s + p->pos + 2, &lo) && lo >= 0xDC00 && lo < 0xE000) {
                    u = 0x10000 + ((u - 0xD800) << 10) + (lo - 0xDC00);
                    p->pos += 6;
                }
            }
            if (u >= 0xD800 && u < 0xE000) u = 0xFFFD;
            /* \uXXXX is 6 source bytes; UTF-8 needs at most 4: the buffer bound holds */
            char *o = d->strings + d->spos;
            if (u < 0x80) { o[0] = (char)u; d->spos += 1; }
            else if (u < 0x800) { o[0] = (char)(0xC0 | u >> 6); o[1] = (char)(0x80 | (u & 63)); d->spos += 2; }
            else if (u < 0x10000) {
                o[0] = (char)(0xE0 | u >> 12); o[1] = (char)(0x80 | ((u >> 6) & 63)); o[2] = (char)(0x80 | (u & 63));
                d->spos += 3;
            } else {
                o[0] = (char)(0xF0 | u >> 18); o[1] = (char)(0x80 | ((u >> 12) & 63));
                o[2] = (char)(0x80 | ((u >> 6) & 63)); o[3] = (char)(0x80 | (u & 63)); d->spos += 4;
            }
            break;
        }
        default: return err(p, "bad escape");
        }
    }
    d->strings[d->spos++] = 0;
    return (long)start;
}

static int parse_value(jp *p, int depth);

static int parse_container(jp *p, int depth, int is_obj) {
    int idx = new_node(p, is_obj ? EP_JOBJ : EP_JARR);
    if (idx < 0) return err(p, "out of memory");
    p->pos++;
    ws(p);
    char close = is_obj ? '}' : ']';
    if (p->pos < p->len && p->s[p->pos] == close) {
        p->pos++;
        return idx;
    }
    int last = -1;
    while (1) {
        long key = -1;
        ws(p);
        if (is_obj) {
            if (p->pos >= p->len || p->s[p->pos] != '"') return err(p, "expected a member name");
            key = parse_str(p);
            if (key < 0) return -1;
            ws(p);
            if (p->pos >= p->len || p->s[p->pos] != ':') return err(p, "expected ':'");
            p->pos++;
        }
        int child = parse_value(p, depth + 1);
        if (child < 0) return -1;
        if (key >= 0) p->d->nodes[child].key = (const char *)(intptr_t)(key + 1); /* fixed up at the end */
        if (last < 0) p->d->nodes[idx].child = child;
        else p->d->nodes[last].next = child;
        last = child;
        p->d->nodes[idx].n++;
        ws(p);
        if (p->pos >= p->len) return err(p, "unexpected end");
        char c = p->s[p->pos++];
        if (c == close) return idx;
        if (c != ',') return err(p, "expected ',' or a closing bracket");
    }
}

static int parse_value(jp *p, int depth) {
    if (depth > EP_JSON_MAX_DEPTH) return err(p, "nested too deeply");
    ws(p);
    if (p->pos >= p->len) return err(p, "unexpected end");
    char c = p->s[p->pos];
    if (c == '{' || c == '[') return parse_container(p, depth, c == '{');
    if (c == '"') {
        int idx = new_node(p, EP_JSTR);
        if (idx < 0) return err(p, "out of memory");
        long off = parse_str(p);
        if (off < 0) return -1;
        p->d->nodes[idx].str = (const char *)(intptr_t)(off + 1);
        return idx;
    }
    static const struct { const char *w; ep_jtype t; double v; } words[] = {
        {"true", EP_JBOOL, 1}, {"false", EP_JBOOL, 0}, {"null", EP_JNULL, 0}};
    for (int i = 0; i < 3; i++) {
        size_t wl = strlen(words[i].w);
        if (p->len - p->pos >= wl && memcmp(p->s + p->pos, words[i].w, wl) == 0) {
            int idx = new_node(p, words[i].t);
            if (idx < 0) return err(p, "out of memory");
            p->d->nodes[idx].num = words[i].v;
            p->pos += wl;
            return idx;
        }
    }
    /* number: validate the JSON grammar, then strtod on a bounded copy */
    size_t s = p->pos, i = s;
    if (i < p->len && p->s[i] == '-') i++;
    size_t digits = i;
    while (i < p->len && p->s[i] >= '0' && p->s[i] <= '9') i++;
    if (i == digits) return err(p, "unexpected character");
    if (i < p->len && p->s[i] == '.') {
        size_t f = ++i;
        while (i < p->len && p->s[i] >= '0' && p->s[i] <= '9') i++;
        if (i == f) return err(p, "bad number");
    }
    if (i < p->len && (p->s[i] == 'e' || p->s[i] == 'E')) {
        i++;
        if (i < p->len && (p->s[i] == '+' || p->s[i] == '-')) i++;
        size_t f = i;
        while (i < p->len && p->s[i] >= '0' && p->s[i] <= '9') i++;
        if (i == f) return err(p, "bad number");
    }
    char buf[64];
    size_t n = i - s;
    if (n >= sizeof buf) return err(p, "number too long");
    memcpy(buf, p->s + s, n);
    buf[n] = 0;
    int idx = new_node(p, EP_JNUM);
    if (idx < 0) return err(p, "out of memory");
    p->d->nodes[idx].num = strtod(buf, NULL);
    p->pos = i;
    return idx;
}

int ep_json_parse(const char *s, size_t len, ep_json *doc, ep_status *st) {
    memset(doc, 0, sizeof *doc);
    doc->scap = len + 1;
    doc->strings = malloc(doc->scap);
    if (!doc->strings) return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    jp p = {s, len, 0, doc, st};
    int root = parse_value(&p, 0);
    if (root >= 0) {
        ws(&p);
        if (p.pos != len) root = err(&p, "trailing characters");
    }
    if (root < 0) {
        ep_json_free(doc);
        return st->code ? st->code : EP_ERR_INPUT;
    }
    for (int i = 0; i < doc->n; i++) { /* offsets (+1) -> pointers, now that the buffers are final */
        ep_jnode *nd = &doc->nodes[i];
        if (nd->key) nd->key = doc->strings + ((intptr_t)nd->key - 1);
        if (nd->str) nd->str = doc->strings + ((intptr_t)nd->str - 1);
    }
    return EP_OK;
}

void ep_json_free(ep_json *doc) {
    free(doc->nodes);
    free(doc->strings);
    memset(doc, 0, sizeof *doc);
}

int ep_json_get(const ep_json *d, int obj, const char *key) {
    if (obj < 0 || obj >= d->n || d->nodes[obj].type != EP_JOBJ) return -1;
    for (int c = d->nodes[obj].child; c >= 0; c = d->nodes[c].next)
        if (d->nodes[c].key && strcmp(d->nodes[c].key, key) == 0) return c;
    return -1;
}

int ep_json_at(const ep_json *d, int arr, int i) {
    if (arr < 0 || arr >= d->n || d->nodes[arr].type != EP_JARR) return -1;
    int c = d->nodes[arr].child;
    while (c >= 0 && i-- > 0) c = d->nodes[c].next;
    return c;
}

EP_SIZE_OPT_END
