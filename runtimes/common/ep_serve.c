/* `serve`: one model, loaded once, behind a small HTTP/1.1 server that one client cannot stall.
 *
 * One poll() loop owns every socket, all non-blocking: it reads request heads and bodies, answers
 * GET /, /health and /info itself, and writes every answer. Each request has a deadline for its
 * whole head and one for its whole body (not per recv, so a byte every few seconds does not keep a
 * slot forever); connections are kept alive between requests and bounded in number (more are
 * answered 503). A complete POST /predict goes to a small pool of worker threads that parse,
 * decode and format the answer in parallel; only the inference itself holds a mutex, because an
 * engine need not be thread-safe. Bodies over --max-body are refused with 413, CSV rows and JSON
 * values per request are bounded, every bad request gets a 4xx JSON error and the server carries
 * on. Binds 127.0.0.1 unless told otherwise; exits 0 after --idle-timeout seconds without a request. */
#define _GNU_SOURCE
#include "ep_server.h"
#include "ep_page.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>
#include <fcntl.h>

EP_SIZE_OPT_BEGIN

ep_serve_limits ep_serve_cfg = {EP_DEFAULT_MAX_PIXELS, 1024, 256, 4, 10.0, 30.0};

#define WRITE_TIMEOUT_MS 30000.0
#define DRAIN_MS 2000.0                  /* reading a refused body before closing, so the client sees our answer */
#define DRAIN_MAX_BYTES ((size_t)1 << 30)
#define ACCEPT_BURST 64

int ep_serve_option(const char *a, const char *v, ep_status *st) {
    static const char *const names[] = {"--max-pixels", "--max-rows", "--max-conns", "--workers", "--head-timeout",
                                        "--body-timeout"};
    static const double hi[] = {8192.0 * 8192.0, 1e7, 10000, 64, 86400, 86400};
    int k = -1;
    for (int i = 0; i < (int)(sizeof names / sizeof names[0]); i++)
        if (strcmp(a, names[i]) == 0) k = i;
    if (k < 0) return 0;
    char *end = NULL;
    double x = v ? strtod(v, &end) : -1;
    int integral = k < 4;
    if (!v || *end || end == v || !(x > 0) || x > hi[k] || (integral && x != (double)(long long)x)) {
        ep_fail(st, EP_ERR_USAGE, "%s needs a%s number in (0, %g]", a, integral ? " whole" : "", hi[k]);
        return -1;
    }
    switch (k) {
    case 0: ep_serve_cfg.max_pixels = (uint64_t)x; ep_image_set_max_pixels((uint64_t)x); break;
    case 1: ep_serve_cfg.max_rows = (int)x; break;
    case 2: ep_serve_cfg.max_conns = (int)x; break;
    case 3: ep_serve_cfg.workers = (int)x; break;
    case 4: ep_serve_cfg.head_timeout_s = x; break;
    default: ep_serve_cfg.body_timeout_s = x; break;
    }
    return 1;
}

typedef enum { S_HEAD, S_BODY, S_WORK, S_WRITE, S_DRAIN } conn_state;

typedef struct conn {
    int fd;
    conn_state state;
    double deadline;       /* ms (ep_now_ms) when the current phase must be over */
    char *in;              /* request head bytes (and any pipelined bytes after it) */
    size_t in_len;
    ep_http_req rq;
    int raw; /* POST /predict?raw=1: a detector's answer also carries its raw output tensors */
    int keep;              /* keep the connection after this answer */
    int drain;             /* after the answer: read and drop what the client still sends, then close */
    unsigned char *body;
    size_t body_len, body_want;
    char *out;             /* the whole answer, head and body */
    size_t out_len, out_pos;
    struct conn *next;     /* job / done queue */
} conn;

typedef struct {
    const ep_serve_opts *o;
    ep_engine *engine;
    ep_prepost pp;
    long served, errors;   /* touched with __atomic builtins: workers count errors too */
    int64_t input_values;  /* all inputs' elements: bounds the values a JSON body may hold */
    pthread_mutex_t engine_lock;
    pthread_mutex_t q_lock;
    pthread_cond_t q_cond;
    conn *jobs, *jobs_tail, *done;
    int stopping;
    int wake[2];           /* workers -> loop: an answer is ready */
    conn **cs;             /* open connections, cs[0..n) (at most --max-conns) */
    int n;
} server;

static void count(long *v) { __atomic_fetch_add(v, 1, __ATOMIC_RELAXED); }
static long load(const long *v) { return __atomic_load_n(v, __ATOMIC_RELAXED); }

static const char *reason(int code) {
    switch (code) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 414: return "URI Too Long";
    case 415: return "Unsupported Media Type";
    case 417: return "Expectation Failed";
    case 422: return "Unprocessable Content";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    default: return "Error";
    }
}

/* The whole answer in one owned buffer (c->out); on out of memory the connection just closes. */
static void set_answer(conn *c, int code, const char *ctype, const char *body, size_t len) {
    char head[768];
    int n = snprintf(head, sizeof head,
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\nConnection: %s\r\n"
                     "Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n"
                     "Content-Security-Policy: " EP_PAGE_CSP "\r\n%s\r\n",
                     code, reason(code), ctype, len, c->keep ? "keep-alive" : "close",
                     code == 405 ? "Allow: GET, POST\r\n" : "");
    free(c->out);
    c->out = malloc((size_t)n + len);
    c->out_pos = c->out_len = 0;
    if (!c->out) {
        c->keep = c->drain = 0;
        return;
    }
    memcpy(c->out, head, (size_t)n);
    if (len) memcpy(c->out + n, body, len);
    c->out_len = (size_t)n + len;
}

static void set_error(server *s, conn *c, int code, const char *msg) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (f) {
        fprintf(f, "{\"error\": ");
        ep_json_string(f, msg);
        fprintf(f, ", \"status\": %d}\n", code);
        fclose(f);
    }
    set_answer(c, code, "application/json", buf ? buf : "{}", buf ? len : 2);
    free(buf);
    count(&s->errors);
}

/* ---- /predict, on a worker thread ------------------------------------------------------ */

typedef enum { CT_NONE, CT_IMAGE, CT_NPY, CT_JSON, CT_CSV, CT_OCTET, CT_BAD } ctype_kind;

static ctype_kind content_kind(const char *ct) {
    char t[128];
    size_t n = 0;
    while (ct[n] && ct[n] != ';' && ct[n] != ' ' && n + 1 < sizeof t) {
        t[n] = ct[n];
        n++;
    }
    t[n] = 0;
    if (!n) return CT_NONE;
    if (strncasecmp(t, "image/", 6) == 0) return CT_IMAGE;
    if (!strcasecmp(t, "application/json") || !strcasecmp(t, "text/json")) return CT_JSON;
    if (!strcasecmp(t, "text/csv") || !strcasecmp(t, "application/csv")) return CT_CSV;
    if (!strcasecmp(t, "application/x-npy") || !strcasecmp(t, "application/npy")) return CT_NPY;
    if (!strcasecmp(t, "application/octet-stream") || !strcasecmp(t, "text/plain")) return CT_OCTET;
    return CT_BAD;
}

/* Amplification bounds, checked on the raw bytes before any parser allocates: a JSON body holds
 * at most ~2 tokens per model input value; CSV at most --max-rows rows of one input each. */
static int body_too_big(const server *s, ep_kind kind, const unsigned char *b, size_t len, char *msg, size_t ml) {
    if (kind == EP_KIND_JSON && s->input_values > 0) {
        size_t tokens = 0;
        for (size_t i = 0; i < len; i++) tokens += b[i] == ',' || b[i] == '[' || b[i] == '{';
        size_t lim = 2 * (size_t)s->input_values + 4096;
        if (tokens > lim) {
            snprintf(msg, ml, "JSON body holds over %zu values; the model's inputs take %lld in all", lim,
                     (long long)s->input_values);
            return 1;
        }
    } else if (kind == EP_KIND_CSV) {
        size_t rows = 0, cells = 0;
        for (size_t i = 0; i < len; i++) {
            rows += b[i] == '\n';
            cells += b[i] == ',' || b[i] == ';' || b[i] == '\t' || b[i] == '\n';
        }
        rows += len && b[len - 1] != '\n';
        int64_t per = ep_spec.n_inputs >= 1 ? ep_shape_count(ep_spec.inputs[0].shape, ep_spec.inputs[0].ndim) : 1;
        if (per < 1) per = 1;
        size_t max_rows = (size_t)ep_serve_cfg.max_rows;
        if (rows > max_rows + 1) { /* +1: a header row */
            snprintf(msg, ml, "CSV body has %zu rows, over the limit of %zu per request (serve --max-rows)", rows,
                     max_rows);
            return 1;
        }
        if (cells > (max_rows + 1) * ((size_t)per + 1) + 64) {
            snprintf(msg, ml, "CSV body has %zu cells, more than %zu rows of %lld values", cells, max_rows,
                     (long long)per);
            return 1;
        }
    }
    return 0;
}

/* CSV rows -> one run per row (or one run for all rows when the input takes them all), as a JSON
 * array like ep_predict_csv's, but parsing and formatting outside the engine lock. */
static int predict_csv(server *s, const char *text, size_t len, FILE *f, ep_status *st) {
    const ep_model_spec *spec = &ep_spec;
    if (spec->n_inputs != 1) return ep_fail(st, EP_ERR_INPUT, "CSV input needs a model with one input");
    double *vals;
    int rows, cols;
    int rc = ep_csv_parse(text, len, &vals, &rows, &cols, st);
    if (rc) return rc;
    const ep_io_spec *in = &spec->inputs[0];
    int64_t per = ep_shape_count(in->shape, in->ndim);
    int step = per == cols ? 1 : per == (int64_t)cols * rows ? rows : 0; /* rows per run */
    if (!step) {
        free(vals);
        char b[128];
        ep_shape_str(in->shape, in->ndim, b, sizeof b);
        return ep_fail(st, EP_ERR_INPUT, "CSV rows have %d values; input %s takes %s (%lld values per row)", cols,
                       in->name, b, (long long)per);
    }
    ep_tensor *x = ep_tensor_array(1), *y = ep_tensor_array(spec->n_outputs);
    rc = x && y ? EP_OK : ep_fail(st, EP_ERR_NOMEM, "out of memory");
    fputc('[', f);
    for (int r = 0; r < rows && !rc; r += step) {
        rc = ep_tensor_alloc(&x[0], in->dtype, in->ndim, in->shape, st);
        for (int64_t j = 0; j < per && !rc; j++) ep_tensor_set(&x[0], (size_t)j, vals[(size_t)r * cols + (size_t)j]);
        if (!rc) rc = ep_alloc_outputs(spec, y, st);
        if (!rc) {
            pthread_mutex_lock(&s->engine_lock);
            rc = ep_engine_run(s->engine, x, y, st);
            pthread_mutex_unlock(&s->engine_lock);
        }
        if (!rc) {
            fprintf(f, "%s{\"row\": %d, ", r ? ", " : "", r);
            ep_write_answer(f, spec, &s->pp, y);
            fputc('}', f);
        }
        ep_free_tensors(x, 1);
        ep_free_tensors(y, spec->n_outputs);
    }
    fputc(']', f);
    if (x) ep_tensor_array_free(x, 1);
    if (y) ep_tensor_array_free(y, spec->n_outputs);
    free(vals);
    return rc;
}

static void handle_predict(server *s, conn *c) {
    const ep_model_spec *spec = &ep_spec;
    const unsigned char *body = c->body;
    size_t len = c->body_len;
    ep_status st = {0, ""};
    char msg[300];
    ctype_kind ck = content_kind(c->rq.content_type);
    if (ck == CT_BAD) {
        snprintf(msg, sizeof msg, "unsupported Content-Type %s: send the raw file as image/png, image/jpeg, "
                 "application/x-npy, application/json or text/csv", c->rq.content_type);
        set_error(s, c, 415, msg);
        return;
    }
    if (!len) {
        set_error(s, c, 400, "empty body: POST an image, .npy, JSON tensor or CSV rows");
        return;
    }
    ep_kind sniffed = ep_sniff(body, len);
    ep_kind kind = ck == CT_IMAGE ? EP_KIND_IMAGE : ck == CT_NPY ? EP_KIND_NPY : ck == CT_JSON ? EP_KIND_JSON
                 : ck == CT_CSV ? EP_KIND_CSV : sniffed;
    if (kind != sniffed && !(kind == EP_KIND_CSV) && !(kind == EP_KIND_JSON && sniffed == EP_KIND_CSV)) {
        set_error(s, c, 415, "the body does not match its Content-Type");
        return;
    }
    if (body_too_big(s, kind, body, len, msg, sizeof msg)) {
        set_error(s, c, 413, msg);
        return;
    }
    char *out = NULL;
    size_t olen = 0;
    FILE *f = open_memstream(&out, &olen);
    ep_tensor *inputs = ep_tensor_array(spec->n_inputs), *outputs = ep_tensor_array(spec->n_outputs);
    int rc;
    if (!f || !inputs || !outputs) {
        rc = ep_fail(&st, EP_ERR_NOMEM, "out of memory");
    } else if (kind == EP_KIND_CSV) {
        double t0 = ep_now_ms();
        fputs("{\"rows\": ", f);
        rc = predict_csv(s, (const char *)body, len, f, &st);
        fprintf(f, ", \"latency_ms\": %.3f}\n", ep_now_ms() - t0);
    } else {
        ep_answer_ctx actx = {0, 0, c->raw};
        rc = ep_inputs_from_bytes_ctx(spec, &s->pp, body, len, kind, inputs, &actx, &st); /* parse/decode: no lock */
        if (!rc) {
            rc = ep_alloc_outputs(spec, outputs, &st);
            double t0 = ep_now_ms();
            if (!rc) {
                pthread_mutex_lock(&s->engine_lock);
                rc = ep_engine_run(s->engine, inputs, outputs, &st);
                pthread_mutex_unlock(&s->engine_lock);
            }
            if (!rc) {
                fputc('{', f);
                ep_write_answer_ctx(f, spec, &s->pp, outputs, &actx);
                fprintf(f, ", \"latency_ms\": %.3f}\n", ep_now_ms() - t0);
            }
            ep_free_tensors(inputs, spec->n_inputs);
            ep_free_tensors(outputs, spec->n_outputs);
        }
    }
    if (inputs) ep_tensor_array_free(inputs, spec->n_inputs);
    if (outputs) ep_tensor_array_free(outputs, spec->n_outputs);
    if (f) fclose(f);
    if (rc) set_error(s, c, rc == EP_ERR_INPUT || rc == EP_ERR_USAGE ? 422 : 500, st.message);
    else set_answer(c, 200, "application/json", out, olen);
    free(out);
}

static void *worker_main(void *arg) {
    server *s = arg;
    while (1) {
        pthread_mutex_lock(&s->q_lock);
        while (!s->jobs && !s->stopping) pthread_cond_wait(&s->q_cond, &s->q_lock);
        conn *c = s->jobs;
        if (c) {
            s->jobs = c->next;
            if (!s->jobs) s->jobs_tail = NULL;
        }
        int stopping = s->stopping;
        pthread_mutex_unlock(&s->q_lock);
        if (!c) break; /* stopping, queue empty */
        if (!stopping) handle_predict(s, c); /* when stopping, queued requests are dropped */
        free(c->body); /* each request's body is its own, freed before the next one is read */
        c->body = NULL;
        c->body_len = c->body_want = 0;
        pthread_mutex_lock(&s->q_lock);
        c->next = s->done;
        s->done = c;
        pthread_mutex_unlock(&s->q_lock);
        ssize_t w = write(s->wake[1], "x", 1);
        (void)w; /* a full pipe already means "wake up" */
    }
    return NULL;
}

/* ---- the socket loop ------------------------------------------------------------------- */

static void conn_close(conn *c) {
    if (c->fd >= 0) close(c->fd);
    free(c->in);
    free(c->body);
    free(c->out);
    free(c);
}

/* Sends what the socket takes now; returns -1 when the connection is done for (error or closed). */
static int flush_out(conn *c) {
    while (c->out_pos < c->out_len) {
        ssize_t k = send(c->fd, c->out + c->out_pos, c->out_len - c->out_pos, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
        if (k <= 0) return -1;
        c->out_pos += (size_t)k;
    }
    return 0;
}

static void start_write(conn *c) {
    c->state = S_WRITE;
    c->deadline = ep_now_ms() + WRITE_TIMEOUT_MS;
}

static void fail_conn(server *s, conn *c, int code, const char *msg, int drain) {
    c->keep = 0;
    c->drain = drain;
    set_error(s, c, code, msg);
    start_write(c);
}

static void submit(server *s, conn *c) {
    c->state = S_WORK;
    c->next = NULL;
    pthread_mutex_lock(&s->q_lock);
    if (s->jobs_tail) s->jobs_tail->next = c;
    else s->jobs = c;
    s->jobs_tail = c;
    pthread_cond_signal(&s->q_cond);
    pthread_mutex_unlock(&s->q_lock);
}

static void consume_in(conn *c, size_t n) {
    memmove(c->in, c->in + n, c->in_len - n);
    c->in_len -= n;
}

/* A head is complete in c->in (hl bytes): route it. */
static void on_head(server *s, conn *c, int hl) {
    ep_http_req *rq = &c->rq;
    c->keep = ep_http_keep_alive(c->in, (size_t)hl);
    c->drain = 0;
    int is_get = strcmp(rq->method, "GET") == 0, is_post = strcmp(rq->method, "POST") == 0;
    char *q = strchr(rq->path, '?');
    if (q) *q = 0;
    c->raw = q && (strstr(q + 1, "raw=1") || strstr(q + 1, "raw=true"));
    const ep_page_asset *page = ep_page_find(rq->path);
    int known = page || !strcmp(rq->path, "/health") || !strcmp(rq->path, "/info") || !strcmp(rq->path, "/predict");
    if (is_get && known && strcmp(rq->path, "/predict") != 0) {
        if (rq->chunked || rq->content_length > 0) c->keep = 0; /* a GET body is not read: do not parse it as a request */
        consume_in(c, (size_t)hl);
        if (page) {
            set_answer(c, 200, page->content_type, page->body, page->len);
        } else if (!strcmp(rq->path, "/health")) {
            char b[160];
            int n = snprintf(b, sizeof b, "{\"status\": \"ok\", \"served\": %ld, \"errors\": %ld}\n", load(&s->served),
                             load(&s->errors));
            set_answer(c, 200, "application/json", b, (size_t)n);
        } else {
            const ep_blob *m = &ep_spec.manifest_json;
            set_answer(c, 200, "application/json", (const char *)m->data, ep_blob_size(m));
        }
        start_write(c);
        return;
    }
    if (!known || !is_post) {
        if (known) fail_conn(s, c, 405, "method not allowed", 1);
        else fail_conn(s, c, 404, "no such path (try /, /predict, /info, /health)", 1);
        return;
    }
    if (rq->chunked) {
        fail_conn(s, c, 411, "send a Content-Length (chunked bodies are not accepted)", 1);
        return;
    }
    if (rq->content_length < 0) {
        fail_conn(s, c, 411, "Content-Length required", 1);
        return;
    }
    if ((unsigned long long)rq->content_length > s->o->max_body) {
        char msg[160];
        snprintf(msg, sizeof msg, "body of %lld bytes exceeds the limit of %zu bytes (--max-body)", rq->content_length,
                 s->o->max_body);
        fail_conn(s, c, 413, msg, 1);
        return;
    }
    size_t want = (size_t)rq->content_length, got = c->in_len - (size_t)hl;
    if (got > want) got = want;
    c->body = malloc(want ? want : 1);
    if (!c->body) {
        fail_conn(s, c, 500, "out of memory", 1);
        return;
    }
    memcpy(c->body, c->in + hl, got);
    consume_in(c, (size_t)hl + got); /* what is left is the next pipelined request */
    c->body_len = got;
    c->body_want = want;
    if (got == want) {
        submit(s, c);
        return;
    }
    if (rq->expect_continue) {
        ssize_t k = send(c->fd, "HTTP/1.1 100 Continue\r\n\r\n", 25, MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)k; /* best effort: a client that does not get it sends the body after its own wait */
    }
    c->state = S_BODY;
    c->deadline = ep_now_ms() + ep_serve_cfg.body_timeout_s * 1000;
}

/* Parses what is buffered; returns after routing one head or when more bytes are needed. */
static void try_head(server *s, conn *c) {
    int hl = ep_http_parse(c->in, c->in_len, &c->rq);
    if (hl > 0) on_head(s, c, hl);
    else if (hl < 0) fail_conn(s, c, -hl, "malformed request", 1);
    else if (c->in_len >= EP_HTTP_MAX_HEAD) fail_conn(s, c, 431, "malformed request", 1);
}

static void begin_request(server *s, conn *c) {
    c->state = S_HEAD;
    c->deadline = ep_now_ms() + ep_serve_cfg.head_timeout_s * 1000;
    if (c->in_len) try_head(s, c);
}

/* The answer is out: next request, drain, or close. Returns -1 when the connection is to be closed. */
static int after_write(server *s, conn *c) {
    free(c->out);
    c->out = NULL;
    c->out_len = c->out_pos = 0;
    count(&s->served);
    if (c->keep) {
        begin_request(s, c);
        return 0;
    }
    if (c->drain) {
        shutdown(c->fd, SHUT_WR);
        c->state = S_DRAIN;
        c->deadline = ep_now_ms() + DRAIN_MS;
        c->body_len = 0; /* bytes drained */
        return 0;
    }
    return -1;
}

/* One readiness event; returns -1 when the connection is to be closed. */
static int on_event(server *s, conn *c, short rev) {
    if (c->state == S_WRITE) {
        if (flush_out(c)) return -1;
        if (c->out_pos == c->out_len) return after_write(s, c);
        return 0;
    }
    if (!(rev & (POLLIN | POLLHUP | POLLERR))) return 0;
    if (c->state == S_DRAIN) {
        char junk[16384];
        ssize_t k = recv(c->fd, junk, sizeof junk, 0);
        if (k < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
        if (k <= 0) return -1;
        c->body_len += (size_t)k;
        return c->body_len > DRAIN_MAX_BYTES ? -1 : 0;
    }
    if (c->state == S_HEAD) {
        ssize_t k = recv(c->fd, c->in + c->in_len, EP_HTTP_MAX_HEAD - c->in_len, 0);
        if (k < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
        if (k <= 0) {
            if (k == 0 && c->in_len) {
                fail_conn(s, c, 400, "incomplete request head", 0);
                return 0;
            }
            return -1;
        }
        c->in_len += (size_t)k;
        try_head(s, c);
        return 0;
    }
    if (c->state == S_BODY) {
        ssize_t k = recv(c->fd, c->body + c->body_len, c->body_want - c->body_len, 0);
        if (k < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
        if (k <= 0) {
            free(c->body);
            c->body = NULL;
            if (k == 0) {
                fail_conn(s, c, 400, "truncated body: fewer bytes than Content-Length", 0);
                return 0;
            }
            return -1;
        }
        c->body_len += (size_t)k;
        if (c->body_len == c->body_want) submit(s, c);
    }
    return 0;
}

/* Deadline passed: 408 for a request begun (then a short drain, so a client still sending reads the
 * answer instead of a reset), a quiet close for an idle keep-alive connection or a stuck write. */
static int on_deadline(server *s, conn *c) {
    if (c->state == S_HEAD && c->in_len) {
        char msg[120];
        snprintf(msg, sizeof msg, "request head not complete within %g s", ep_serve_cfg.head_timeout_s);
        fail_conn(s, c, 408, msg, 1);
        return 0;
    }
    if (c->state == S_BODY) {
        char msg[120];
        snprintf(msg, sizeof msg, "request body not complete within %g s", ep_serve_cfg.body_timeout_s);
        free(c->body);
        c->body = NULL;
        fail_conn(s, c, 408, msg, 1);
        return 0;
    }
    return -1;
}

static int start_workers(server *s, pthread_t *t, int n) {
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setstacksize(&a, (size_t)8 << 20); /* the engine runs on these threads too */
    int started = 0;
    while (started < n && pthread_create(&t[started], &a, worker_main, s) == 0) started++;
    pthread_attr_destroy(&a);
    return started;
}

static int listen_on(const ep_serve_opts *o, int *out, ep_status *st) {
    struct sockaddr_in6 a6;
    struct sockaddr_in a4;
    memset(&a6, 0, sizeof a6);
    memset(&a4, 0, sizeof a4);
    int v6 = 0;
    if (inet_pton(AF_INET, o->host, &a4.sin_addr) == 1) {
        a4.sin_family = AF_INET;
        a4.sin_port = htons((uint16_t)o->port);
    } else if (inet_pton(AF_INET6, o->host, &a6.sin6_addr) == 1) {
        a6.sin6_family = AF_INET6;
        a6.sin6_port = htons((uint16_t)o->port);
        v6 = 1;
    } else {
        return ep_fail(st, EP_ERR_USAGE, "--host %s: not a numeric IP address", o->host);
    }
    int fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (fd < 0 || bind(fd, v6 ? (struct sockaddr *)&a6 : (struct sockaddr *)&a4, v6 ? sizeof a6 : sizeof a4) != 0 ||
        listen(fd, 256) != 0 || fcntl(fd, F_SETFL, O_NONBLOCK) != 0) {
        int rc = ep_fail(st, EP_ERR_IO, "cannot listen on %s:%d: %s", o->host, o->port, strerror(errno));
        if (fd >= 0) close(fd);
        return rc;
    }
    *out = fd;
    return EP_OK;
}

static void say_listening(int fd, const ep_serve_opts *o, int workers) {
    struct sockaddr_storage sa;
    socklen_t sl = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &sl);
    int p = ntohs(sa.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&sa)->sin6_port
                                           : ((struct sockaddr_in *)&sa)->sin_port);
    int br = strchr(o->host, ':') != NULL;
    printf("{\"listening\": \"http://%s%s%s:%d/\", \"port\": %d, \"model\": ", br ? "[" : "", o->host, br ? "]" : "",
           p, p);
    ep_json_string(stdout, ep_spec.model_name);
    printf(", \"idle_timeout_s\": %g, \"max_body\": %zu, \"max_pixels\": %llu, \"max_rows\": %d, "
           "\"max_conns\": %d, \"workers\": %d, \"head_timeout_s\": %g, \"body_timeout_s\": %g}\n",
           o->idle_timeout_s, o->max_body, (unsigned long long)ep_serve_cfg.max_pixels, ep_serve_cfg.max_rows,
           ep_serve_cfg.max_conns, workers, ep_serve_cfg.head_timeout_s, ep_serve_cfg.body_timeout_s);
    fflush(stdout);
}

static void refuse_busy(server *s, int fd) {
    static const char msg[] = "{\"error\": \"too many open connections (serve --max-conns)\", \"status\": 503}\n";
    char busy[320];
    int n = snprintf(busy, sizeof busy, "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\nConnection: close\r\nRetry-After: 1\r\n\r\n%s", sizeof msg - 1, msg);
    ssize_t k = send(fd, busy, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)k; /* best effort: the connection is closed either way */
    close(fd);
    count(&s->errors);
}

static void drop_conn(server *s, int i) {
    conn_close(s->cs[i]);
    s->cs[i] = s->cs[--s->n];
}

static void accept_some(server *s, int lfd) {
    for (int k = 0; k < ACCEPT_BURST; k++) {
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break; /* EAGAIN, or e.g. ECONNABORTED/EMFILE: keep serving */
        if (s->n >= ep_serve_cfg.max_conns) {
            refuse_busy(s, fd);
            continue;
        }
        conn *c = calloc(1, sizeof *c);
        char *in = malloc(EP_HTTP_MAX_HEAD);
        if (!c || !in) {
            free(c);
            free(in);
            close(fd);
            continue;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        c->fd = fd;
        c->in = in;
        s->cs[s->n++] = c;
        begin_request(s, c);
    }
}

/* Answers the workers finished: start writing them. */
static void collect_done(server *s) {
    char junk[256];
    while (read(s->wake[0], junk, sizeof junk) > 0) {}
    pthread_mutex_lock(&s->q_lock);
    conn *d = s->done;
    s->done = NULL;
    pthread_mutex_unlock(&s->q_lock);
    while (d) {
        conn *nx = d->next;
        start_write(d);
        if (flush_out(d) || (d->out_pos == d->out_len && after_write(s, d))) {
            for (int i = 0; i < s->n; i++)
                if (s->cs[i] == d) {
                    drop_conn(s, i);
                    break;
                }
        }
        d = nx;
    }
}

static int loop(server *s, int lfd, ep_status *st) {
    const ep_serve_opts *o = s->o;
    struct pollfd *pf = calloc((size_t)ep_serve_cfg.max_conns + 2, sizeof *pf);
    if (!pf) return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    int rc = EP_OK;
    double last = ep_now_ms(); /* idle clock: runs only while no connection is open */
    while (!o->max_requests || load(&s->served) < o->max_requests) {
        double now = ep_now_ms(), next = now + 60000;
        for (int i = 0; i < s->n; i++)
            if (s->cs[i]->state != S_WORK && s->cs[i]->deadline < next) next = s->cs[i]->deadline;
        if (s->n) last = now;
        if (o->idle_timeout_s > 0) {
            double until = last + o->idle_timeout_s * 1000;
            if (until <= now) {
                fprintf(stderr, "idle for %g s: shutting down\n", o->idle_timeout_s);
                break;
            }
            if (until < next) next = until;
        }
        int n = s->n;
        pf[0] = (struct pollfd){s->wake[0], POLLIN, 0};
        pf[1] = (struct pollfd){lfd, POLLIN, 0};
        for (int i = 0; i < n; i++) {
            conn *c = s->cs[i];
            short ev = c->state == S_WRITE ? POLLOUT : c->state == S_WORK ? 0 : POLLIN;
            pf[i + 2] = (struct pollfd){ev ? c->fd : -1, ev, 0};
        }
        int pr = poll(pf, (nfds_t)n + 2, next <= now ? 0 : (int)(next - now) + 1);
        if (pr < 0) {
            if (errno == EINTR) continue;
            rc = ep_fail(st, EP_ERR_IO, "poll: %s", strerror(errno));
            break;
        }
        /* high to low: a closed connection is replaced by the last one, already handled */
        for (int i = n - 1; i >= 0; i--) {
            conn *c = s->cs[i];
            int r = pf[i + 2].revents ? on_event(s, c, pf[i + 2].revents) : 0;
            if (!r && c->state != S_WORK && ep_now_ms() >= c->deadline) r = on_deadline(s, c);
            if (!r && c->state == S_WRITE && c->out_pos == 0) { /* a fresh answer: try it now */
                if (flush_out(c)) r = -1;
                else if (c->out_pos == c->out_len) r = after_write(s, c);
            }
            if (r) drop_conn(s, i);
        }
        if (pf[0].revents & POLLIN) collect_done(s);
        if (pf[1].revents & POLLIN) accept_some(s, lfd);
    }
    free(pf);
    return rc;
}

int ep_serve(const ep_serve_opts *o, ep_status *st) {
    signal(SIGPIPE, SIG_IGN);
    server s;
    memset(&s, 0, sizeof s);
    s.o = o;
    s.wake[0] = s.wake[1] = -1;
    ep_image_set_max_pixels(ep_serve_cfg.max_pixels);
    for (int i = 0; i < ep_spec.n_inputs; i++) {
        int64_t k = ep_shape_count(ep_spec.inputs[i].shape, ep_spec.inputs[i].ndim);
        if (k > 0) s.input_values += k;
    }
    int rc = ep_prepost_load(&ep_spec, &s.pp, st);
    if (!rc) rc = ep_engine_open(&ep_spec, o->threads, &s.engine, st);
    if (rc) {
        ep_prepost_free(&s.pp);
        return rc;
    }
    int lfd = -1, nw = 0;
    pthread_t *threads = NULL;
    rc = listen_on(o, &lfd, st);
    if (!rc && pipe2(s.wake, O_NONBLOCK | O_CLOEXEC) != 0) rc = ep_fail(st, EP_ERR_IO, "pipe: %s", strerror(errno));
    if (!rc) {
        s.cs = calloc((size_t)ep_serve_cfg.max_conns, sizeof *s.cs);
        threads = calloc((size_t)ep_serve_cfg.workers, sizeof *threads);
        if (!s.cs || !threads) rc = ep_fail(st, EP_ERR_NOMEM, "out of memory");
    }
    if (!rc) {
        pthread_mutex_init(&s.engine_lock, NULL);
        pthread_mutex_init(&s.q_lock, NULL);
        pthread_cond_init(&s.q_cond, NULL);
        nw = start_workers(&s, threads, ep_serve_cfg.workers);
        if (!nw) rc = ep_fail(st, EP_ERR_IO, "cannot start the server's worker threads");
    }
    if (!rc) {
        say_listening(lfd, o, nw);
        rc = loop(&s, lfd, st);
    }
    if (nw) {
        /* workers drop queued requests and finish the one they hold; then every connection goes */
        pthread_mutex_lock(&s.q_lock);
        s.stopping = 1;
        pthread_cond_broadcast(&s.q_cond);
        pthread_mutex_unlock(&s.q_lock);
        for (int i = 0; i < nw; i++) pthread_join(threads[i], NULL);
        pthread_mutex_destroy(&s.engine_lock);
        pthread_mutex_destroy(&s.q_lock);
        pthread_cond_destroy(&s.q_cond);
    }
    for (int i = 0; i < s.n; i++) conn_close(s.cs[i]);
    free(s.cs);
    free(threads);
    if (lfd >= 0) close(lfd);
    if (s.wake[0] >= 0) close(s.wake[0]);
    if (s.wake[1] >= 0) close(s.wake[1]);
    ep_engine_close(s.engine);
    ep_prepost_free(&s.pp);
    return rc;
}

EP_SIZE_OPT_END
