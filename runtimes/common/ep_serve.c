/* `serve`: one model, loaded once, behind a small single-threaded HTTP/1.1 server.
 *
 * One request per connection (Connection: close), socket timeouts so a stalled client cannot hold
 * the server long, bodies over --max-body refused with 413, every bad request answered 4xx with a
 * JSON error and the server carrying on. Binds 127.0.0.1 unless told otherwise; exits 0 after
 * --idle-timeout seconds without a request. */
#define _GNU_SOURCE
#include "ep_io.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

EP_SIZE_OPT_BEGIN

#define IO_TIMEOUT_S 5

typedef struct {
    const ep_serve_opts *o;
    ep_engine *engine;
    ep_prepost pp;
    long served, errors;
} server;

static int send_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

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
    default: return "Error";
    }
}

static void respond(int fd, int code, const char *ctype, const char *body, size_t len) {
    char head[512];
    int n = snprintf(head, sizeof head,
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\nConnection: close\r\n"
                     "Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n%s\r\n",
                     code, reason(code), ctype, len, code == 405 ? "Allow: GET, POST\r\n" : "");
    if (send_all(fd, head, (size_t)n) == 0 && len) send_all(fd, body, len);
}

static void respond_error(server *s, int fd, int code, const char *msg) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) return;
    fprintf(f, "{\"error\": ");
    ep_json_string(f, msg);
    fprintf(f, ", \"status\": %d}\n", code);
    fclose(f);
    respond(fd, code, "application/json", buf, len);
    free(buf);
    s->errors++;
}

/* Reads until the peer stops sending (bounded in time and bytes) so closing does not reset a
 * client that is still writing a refused body before it reads our answer. */
static void drain(int fd) {
    char junk[65536];
    shutdown(fd, SHUT_WR);
    double t0 = ep_now_ms();
    size_t total = 0;
    while (ep_now_ms() - t0 < 2000 && total < ((size_t)1 << 30)) {
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, 200) <= 0) break;
        ssize_t k = recv(fd, junk, sizeof junk, 0);
        if (k <= 0) break;
        total += (size_t)k;
    }
}

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

static void handle_predict(server *s, int fd, const ep_http_req *rq, const unsigned char *body, size_t len) {
    const ep_model_spec *spec = &ep_spec;
    ep_status st = {0, ""};
    ctype_kind ck = content_kind(rq->content_type);
    if (ck == CT_BAD) {
        char msg[300];
        snprintf(msg, sizeof msg, "unsupported Content-Type %s: send the raw file as image/png, image/jpeg, "
                 "application/x-npy, application/json or text/csv", rq->content_type);
        respond_error(s, fd, 415, msg);
        return;
    }
    if (!len) {
        respond_error(s, fd, 400, "empty body: POST an image, .npy, JSON tensor or CSV rows");
        return;
    }
    ep_kind sniffed = ep_sniff(body, len);
    ep_kind kind = ck == CT_IMAGE ? EP_KIND_IMAGE : ck == CT_NPY ? EP_KIND_NPY : ck == CT_JSON ? EP_KIND_JSON
                 : ck == CT_CSV ? EP_KIND_CSV : sniffed;
    if (kind != sniffed && !(kind == EP_KIND_CSV) && !(kind == EP_KIND_JSON && sniffed == EP_KIND_CSV)) {
        respond_error(s, fd, 415, "the body does not match its Content-Type");
        return;
    }
    char *out = NULL;
    size_t olen = 0;
    FILE *f = open_memstream(&out, &olen);
    if (!f) {
        respond_error(s, fd, 500, "out of memory");
        return;
    }
    int rc;
    double t0 = ep_now_ms();
    if (kind == EP_KIND_CSV) {
        fputs("{\"rows\": ", f);
        rc = ep_predict_csv(spec, &s->pp, s->engine, (const char *)body, len, f, 0, &st);
        fprintf(f, ", \"latency_ms\": %.3f}\n", ep_now_ms() - t0);
    } else {
        ep_tensor inputs[64], outputs[64];
        memset(outputs, 0, sizeof outputs);
        rc = ep_inputs_from_bytes(spec, &s->pp, body, len, kind, inputs, &st);
        if (!rc) {
            rc = ep_alloc_outputs(spec, outputs, &st);
            if (!rc) rc = ep_engine_run(s->engine, inputs, outputs, &st);
            if (!rc) {
                fputc('{', f);
                ep_write_answer(f, spec, &s->pp, outputs);
                fprintf(f, ", \"latency_ms\": %.3f}\n", ep_now_ms() - t0);
            }
            ep_free_tensors(inputs, spec->n_inputs);
            ep_free_tensors(outputs, spec->n_outputs);
        }
    }
    fclose(f);
    if (rc) respond_error(s, fd, rc == EP_ERR_INPUT || rc == EP_ERR_USAGE ? 422 : 500, st.message);
    else respond(fd, 200, "application/json", out, olen);
    free(out);
}

static void handle(server *s, int fd) {
    struct timeval tv = {IO_TIMEOUT_S, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    char head[EP_HTTP_MAX_HEAD];
    size_t have = 0;
    ep_http_req rq;
    int hl = 0;
    while (1) {
        ssize_t k = recv(fd, head + have, sizeof head - have, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            if (have) respond_error(s, fd, k == 0 ? 400 : 408, k == 0 ? "incomplete request head" : "request timed out");
            return;
        }
        have += (size_t)k;
        hl = ep_http_parse(head, have, &rq);
        if (hl != 0) break;
        if (have == sizeof head) {
            hl = -431;
            break;
        }
    }
    if (hl < 0) {
        respond_error(s, fd, -hl, "malformed request");
        drain(fd);
        return;
    }
    int is_get = strcmp(rq.method, "GET") == 0, is_post = strcmp(rq.method, "POST") == 0;
    char *q = strchr(rq.path, '?');
    if (q) *q = 0;
    if (is_get && strcmp(rq.path, "/") == 0) {
        respond(fd, 200, "text/html; charset=utf-8", ep_page_html, strlen(ep_page_html));
    } else if (is_get && strcmp(rq.path, "/health") == 0) {
        char b[160];
        int n = snprintf(b, sizeof b, "{\"status\": \"ok\", \"served\": %ld, \"errors\": %ld}\n", s->served, s->errors);
        respond(fd, 200, "application/json", b, (size_t)n);
    } else if (is_get && strcmp(rq.path, "/info") == 0) {
        const ep_blob *m = &ep_spec.manifest_json;
        respond(fd, 200, "application/json", (const char *)m->data, ep_blob_size(m));
    } else if (strcmp(rq.path, "/predict") == 0 && is_post) {
        if (rq.chunked) {
            respond_error(s, fd, 411, "send a Content-Length (chunked bodies are not accepted)");
            drain(fd);
            return;
        }
        if (rq.content_length < 0) {
            respond_error(s, fd, 411, "Content-Length required");
            drain(fd);
            return;
        }
        if ((unsigned long long)rq.content_length > s->o->max_body) {
            char msg[160];
            snprintf(msg, sizeof msg, "body of %lld bytes exceeds the limit of %zu bytes (--max-body)",
                     rq.content_length, s->o->max_body);
            respond_error(s, fd, 413, msg);
            drain(fd);
            return;
        }
        size_t want = (size_t)rq.content_length, got = have - (size_t)hl;
        if (got > want) got = want; /* pipelined extra bytes are ignored: one request per connection */
        unsigned char *body = malloc(want ? want : 1);
        if (!body) {
            respond_error(s, fd, 500, "out of memory");
            return;
        }
        memcpy(body, head + hl, got);
        if (rq.expect_continue && got < want) send_all(fd, "HTTP/1.1 100 Continue\r\n\r\n", 25);
        while (got < want) {
            ssize_t k = recv(fd, body + got, want - got, 0);
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) break;
            got += (size_t)k;
        }
        if (got < want) respond_error(s, fd, 400, "truncated body: fewer bytes than Content-Length");
        else handle_predict(s, fd, &rq, body, want);
        free(body);
    } else if (strcmp(rq.path, "/") == 0 || strcmp(rq.path, "/health") == 0 || strcmp(rq.path, "/info") == 0 ||
               strcmp(rq.path, "/predict") == 0) {
        respond_error(s, fd, 405, "method not allowed");
        drain(fd);
    } else {
        respond_error(s, fd, 404, "no such path (try /, /predict, /info, /health)");
        drain(fd);
    }
}

int ep_serve(const ep_serve_opts *o, ep_status *st) {
    signal(SIGPIPE, SIG_IGN);
    server s;
    memset(&s, 0, sizeof s);
    s.o = o;
    int rc = ep_prepost_load(&ep_spec, &s.pp, st);
    if (!rc) rc = ep_engine_open(&ep_spec, o->threads, &s.engine, st);
    if (rc) {
        ep_prepost_free(&s.pp);
        return rc;
    }
    struct sockaddr_in6 a6;
    struct sockaddr_in a4;
    memset(&a6, 0, sizeof a6);
    memset(&a4, 0, sizeof a4);
    int fd = -1, v6 = 0;
    if (inet_pton(AF_INET, o->host, &a4.sin_addr) == 1) {
        a4.sin_family = AF_INET;
        a4.sin_port = htons((uint16_t)o->port);
    } else if (inet_pton(AF_INET6, o->host, &a6.sin6_addr) == 1) {
        a6.sin6_family = AF_INET6;
        a6.sin6_port = htons((uint16_t)o->port);
        v6 = 1;
    } else {
        rc = ep_fail(st, EP_ERR_USAGE, "--host %s: not a numeric IP address", o->host);
    }
    if (!rc) {
        fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM, 0);
        int one = 1;
        if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (fd < 0 || bind(fd, v6 ? (struct sockaddr *)&a6 : (struct sockaddr *)&a4, v6 ? sizeof a6 : sizeof a4) != 0 ||
            listen(fd, 128) != 0)
            rc = ep_fail(st, EP_ERR_IO, "cannot listen on %s:%d: %s", o->host, o->port, strerror(errno));
    }
    if (!rc) {
        struct sockaddr_storage sa;
        socklen_t sl = sizeof sa;
        getsockname(fd, (struct sockaddr *)&sa, &sl);
        int p = ntohs(sa.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&sa)->sin6_port
                                               : ((struct sockaddr_in *)&sa)->sin_port);
        printf("{\"listening\": \"http://%s%s%s:%d/\", \"port\": %d, \"model\": ", strchr(o->host, ':') ? "[" : "",
               o->host, strchr(o->host, ':') ? "]" : "", p, p);
        ep_json_string(stdout, ep_spec.model_name);
        printf(", \"idle_timeout_s\": %g, \"max_body\": %zu}\n", o->idle_timeout_s, o->max_body);
        fflush(stdout);
        double last = ep_now_ms();
        while (!o->max_requests || s.served < o->max_requests) {
            int wait_ms = -1;
            if (o->idle_timeout_s > 0) {
                double left = o->idle_timeout_s * 1000 - (ep_now_ms() - last);
                if (left <= 0) {
                    fprintf(stderr, "idle for %g s: shutting down\n", o->idle_timeout_s);
                    break;
                }
                wait_ms = left > 60000 ? 60000 : (int)left + 1;
            }
            struct pollfd pf = {fd, POLLIN, 0};
            int pr = poll(&pf, 1, wait_ms);
            if (pr < 0 && errno != EINTR) {
                rc = ep_fail(st, EP_ERR_IO, "poll: %s", strerror(errno));
                break;
            }
            if (pr <= 0) continue;
            int c = accept(fd, NULL, NULL);
            if (c < 0) continue; /* e.g. ECONNABORTED, EMFILE: keep serving */
            handle(&s, c);
            close(c);
            s.served++;
            last = ep_now_ms();
        }
    }
    if (fd >= 0) close(fd);
    ep_engine_close(s.engine);
    ep_prepost_free(&s.pp);
    return rc;
}

EP_SIZE_OPT_END
