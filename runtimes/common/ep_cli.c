/* The artifact's command line: info, run, selftest, bench. Returns exit codes; never exits. */
#define _GNU_SOURCE
#include "ep_runtime.h"
#include "ep_io.h"
#include "ep_server.h" /* serve limit options (issue #11) */

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>

#define EP_MAX_INPUT_BYTES ((size_t)1 << 31)
#define EP_EXIT_FAIL 1

static const char USAGE[] =
    "usage: %s COMMAND [options]\n"
    "  info                                   print the manifest (JSON)\n"
    "  run --input [NAME=]FILE ... [--output DIR] [--threads N]\n"
    "                                         run the model on .npy, JSON, or (when built with\n"
    "                                         --preprocess) PNG/JPEG/PPM files; writes DIR/NAME.npy\n"
    "                                         or prints JSON\n"
    "  run --input-dir DIR [--output results.jsonl]    one JSON line per file (bad files: error lines)\n"
    "  run --input rows.csv [--output out.csv|out.jsonl] one run per CSV row\n"
    "  serve [--port P] [--host 127.0.0.1] [--idle-timeout S] [--max-body BYTES] [--threads N]\n"
    EP_SERVE_OPTIONS_USAGE
    "                                         HTTP: GET / (try-it page), POST /predict, GET /info, /health\n"
    "  selftest [--threads N] [--runs N] [--warmup N] [--json]\n"
    "                                         check the embedded golden output (exit 0 PASS, 1 FAIL)\n"
    "  bench [--runs N] [--warmup N] [--threads N] [--json]\n"
    "                                         latency min/median/p90 and peak RSS\n";

typedef struct {
    const char *inputs[64];
    int n_inputs;
    const char *output_dir;
    int threads, runs, warmup, json;
    const char *input_dir, *host;
    int port;
    double idle_timeout;
    long long max_body, max_requests;
} cli_opts;

static int parse_int(const char *s, int lo, int hi, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || end == s || v < lo || v > hi) return 0;
    *out = (int)v;
    return 1;
}

static int parse_opts(int argc, char **argv, int start, cli_opts *o, ep_status *st) {
    memset(o, 0, sizeof *o);
    int k;
    o->threads = 0;
    o->runs = -1;   /* -1: the command's own default (bench 50/5, selftest 3/1) */
    o->warmup = -1;
    o->host = "127.0.0.1";
    o->port = 8080;
    o->max_body = 16 << 20;
    for (int i = start; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--json") == 0) {
            o->json = 1;
        } else if (strcmp(a, "--input") == 0 || strcmp(a, "-i") == 0) {
            if (!v) return ep_fail(st, EP_ERR_USAGE, "%s needs a value", a);
            if (o->n_inputs == 64) return ep_fail(st, EP_ERR_USAGE, "too many --input options");
            o->inputs[o->n_inputs++] = v;
            i++;
        } else if (strcmp(a, "--output") == 0 || strcmp(a, "-o") == 0) {
            if (!v) return ep_fail(st, EP_ERR_USAGE, "%s needs a value", a);
            o->output_dir = v;
            i++;
        } else if (strcmp(a, "--input-dir") == 0) {
            if (!v) return ep_fail(st, EP_ERR_USAGE, "%s needs a value", a);
            o->input_dir = v;
            i++;
        } else if (strcmp(a, "--host") == 0) {
            if (!v) return ep_fail(st, EP_ERR_USAGE, "%s needs a value", a);
            o->host = v;
            i++;
        } else if (strcmp(a, "--port") == 0) {
            if (!v || !parse_int(v, 0, 65535, &o->port)) return ep_fail(st, EP_ERR_USAGE, "--port needs 0..65535");
            i++;
        } else if (strcmp(a, "--idle-timeout") == 0 || strcmp(a, "--max-body") == 0 ||
                   strcmp(a, "--max-requests") == 0) {
            char *end;
            double x = v ? strtod(v, &end) : -1;
            if (!v || *end || end == v || !(x >= 0) || x > 1e15)
                return ep_fail(st, EP_ERR_USAGE, "%s needs a number >= 0", a);
            if (a[2] == 'i') o->idle_timeout = x;
            else if (a[6] == 'b') o->max_body = (long long)x;
            else o->max_requests = (long long)x;
            i++;
        } else if (strcmp(a, "--threads") == 0) {
            if (!v || !parse_int(v, 0, 1024, &o->threads))
                return ep_fail(st, EP_ERR_USAGE, "--threads needs a number 0..1024 (0 = free cores)");
            i++;
        } else if (strcmp(a, "--runs") == 0) {
            if (!v || !parse_int(v, 1, 1000000, &o->runs)) return ep_fail(st, EP_ERR_USAGE, "--runs needs a number >= 1");
            i++;
        } else if (strcmp(a, "--warmup") == 0) {
            if (!v || !parse_int(v, 0, 1000000, &o->warmup))
                return ep_fail(st, EP_ERR_USAGE, "--warmup needs a number >= 0");
            i++;
        } else if ((k = ep_serve_option(a, v, st)) != 0) { /* --max-pixels, --max-conns, ... */
            if (k < 0) return st->code;
            i++;
        } else {
            return ep_fail(st, EP_ERR_USAGE, "unknown option %s", a);
        }
    }
    if (o->threads == 0) o->threads = ep_default_threads();
    return EP_OK;
}

static void print_manifest(void) {
    const ep_blob *m = &ep_spec.manifest_json;
    fwrite(m->data, 1, ep_blob_size(m), stdout);
    fputc('\n', stdout);
}

static int load_golden(const ep_blob *blobs, int n, ep_tensor *out, ep_status *st) {
    for (int i = 0; i < n; i++) {
        int rc = ep_npy_parse(blobs[i].data, ep_blob_size(&blobs[i]), &out[i], st);
        if (rc) {
            for (int j = 0; j < i; j++) ep_tensor_free(&out[j]);
            return ep_fail(st, EP_ERR_MODEL, "embedded golden data damaged: %s", st->message);
        }
    }
    return EP_OK;
}

static void free_all(ep_tensor *t, int n) {
    for (int i = 0; i < n; i++) ep_tensor_free(&t[i]);
}

/* [NAME=]FILE -> index of the input it feeds. */
static int assign_input(const char *arg, const char **path, int *index, ep_status *st) {
    const char *eq = strchr(arg, '=');
    if (!eq) {
        if (ep_spec.n_inputs != 1)
            return ep_fail(st, EP_ERR_USAGE, "--input %s: the model has %d inputs, write NAME=FILE", arg, ep_spec.n_inputs);
        *path = arg;
        *index = 0;
        return EP_OK;
    }
    size_t nl = (size_t)(eq - arg);
    for (int i = 0; i < ep_spec.n_inputs; i++)
        if (strlen(ep_spec.inputs[i].name) == nl && memcmp(ep_spec.inputs[i].name, arg, nl) == 0) {
            *path = eq + 1;
            *index = i;
            return EP_OK;
        }
    char names[512] = "";
    for (int i = 0; i < ep_spec.n_inputs; i++) {
        strncat(names, i ? ", " : "", sizeof names - strlen(names) - 1);
        strncat(names, ep_spec.inputs[i].name, sizeof names - strlen(names) - 1);
    }
    return ep_fail(st, EP_ERR_USAGE, "--input %.*s: no such input (the model's inputs: %s)", (int)nl, arg, names);
}

static void safe_name(const char *name, char *out, size_t len) {
    size_t j = 0;
    for (size_t i = 0; name[i] && j + 1 < len; i++) {
        char c = name[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                 c == '-' || (c == '.' && i > 0);
        out[j++] = ok ? c : '_';
    }
    out[j] = 0;
    if (!j) snprintf(out, len, "output");
}

static int is_csv_path(const char *p) {
    size_t n = strlen(p);
    return n > 4 && strcmp(p + n - 4, ".csv") == 0;
}

static int cmd_run(const cli_opts *o, ep_status *st) {
    if (o->input_dir) {
        if (o->n_inputs) return ep_fail(st, EP_ERR_USAGE, "give --input or --input-dir, not both");
        return ep_run_batch(o->input_dir, NULL, o->output_dir, o->threads, st);
    }
    if (o->n_inputs == 1 && is_csv_path(o->inputs[0]))
        return ep_run_batch(NULL, strchr(o->inputs[0], '=') ? strchr(o->inputs[0], '=') + 1 : o->inputs[0], o->output_dir, o->threads, st);
    ep_prepost pp;
    int prc = ep_prepost_load(&ep_spec, &pp, st);
    if (prc) return prc;
    ep_tensor inputs[64], outputs[64];
    memset(inputs, 0, sizeof inputs);
    memset(outputs, 0, sizeof outputs);
    int have[64] = {0};
    int rc = EP_OK;
    if (o->n_inputs == 0) return ep_fail(st, EP_ERR_USAGE, "run needs --input [NAME=]FILE.npy");
    for (int k = 0; k < o->n_inputs && !rc; k++) {
        const char *path;
        int idx;
        rc = assign_input(o->inputs[k], &path, &idx, st);
        if (rc) break;
        if (have[idx]) {
            rc = ep_fail(st, EP_ERR_USAGE, "input %s given twice", ep_spec.inputs[idx].name);
            break;
        }
        unsigned char *buf;
        size_t len;
        rc = ep_read_file(path, EP_MAX_INPUT_BYTES, &buf, &len, st);
        if (rc) break;
        if (!strchr(o->inputs[k], '=') && ep_spec.n_inputs == 1)
            rc = ep_inputs_from_bytes(&ep_spec, &pp, buf, len, EP_KIND_AUTO, inputs, st);
        else
            rc = ep_npy_parse(buf, len, &inputs[idx], st);
        free(buf);
        if (rc) {
            char msg[sizeof st->message];
            snprintf(msg, sizeof msg, "%s", st->message);
            ep_fail(st, EP_ERR_INPUT, "%s: %s", path, msg);
            break;
        }
        have[idx] = 1;
        rc = ep_coerce_input(&ep_spec.inputs[idx], &inputs[idx], st);
    }
    for (int i = 0; !rc && i < ep_spec.n_inputs; i++)
        if (!have[i]) rc = ep_fail(st, EP_ERR_USAGE, "missing input %s (--input %s=FILE.npy)", ep_spec.inputs[i].name,
                                   ep_spec.inputs[i].name);
    ep_engine *e = NULL;
    if (!rc) rc = ep_engine_open(&ep_spec, o->threads, &e, st);
    if (!rc) rc = ep_alloc_outputs(&ep_spec, outputs, st);
    double ms = 0;
    if (!rc) {
        double t0 = ep_now_ms();
        rc = ep_engine_run(e, inputs, outputs, st);
        ms = ep_now_ms() - t0;
    }
    if (!rc && o->output_dir) {
        if (mkdir(o->output_dir, 0755) != 0 && errno != EEXIST)
            rc = ep_fail(st, EP_ERR_IO, "%s: %s", o->output_dir, strerror(errno));
        for (int i = 0; !rc && i < ep_spec.n_outputs; i++) {
            char name[256], path[4096];
            safe_name(ep_spec.outputs[i].name, name, sizeof name);
            snprintf(path, sizeof path, "%s/%s.npy", o->output_dir, name);
            rc = ep_npy_write_file(path, &outputs[i], st);
        }
    }
    if (!rc && !o->output_dir) {
        printf("{\"latency_ms\": %.3f, \"threads\": %d, ", ms, o->threads);
        ep_write_answer(stdout, &ep_spec, &pp, outputs);
        fputs("}\n", stdout);
    } else if (!rc) {
        printf("{\"latency_ms\": %.3f, \"threads\": %d, \"outputs\": {", ms, o->threads);
        for (int i = 0; i < ep_spec.n_outputs; i++) {
            if (i) fputs(", ", stdout);
            ep_json_string(stdout, ep_spec.outputs[i].name);
            printf(": {\"dtype\": \"%s\", \"shape\": ", ep_dtype_name(outputs[i].dtype));
            ep_write_shape_json(stdout, outputs[i].shape, outputs[i].ndim);
            {
                char name[256], path[4096];
                safe_name(ep_spec.outputs[i].name, name, sizeof name);
                snprintf(path, sizeof path, "%s/%s.npy", o->output_dir, name);
                fputs(", \"file\": ", stdout);
                ep_json_string(stdout, path);
            }
            fputc('}', stdout);
        }
        fputs("}}\n", stdout);
    }
    if (e) ep_engine_close(e);
    free_all(inputs, ep_spec.n_inputs);
    free_all(outputs, ep_spec.n_outputs);
    ep_prepost_free(&pp);
    return rc;
}

static int cmd_serve(const cli_opts *o, ep_status *st) {
    ep_serve_opts so = {o->host, o->port, o->idle_timeout, (size_t)o->max_body, o->threads, (long)o->max_requests};
    return ep_serve(&so, st);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static long peak_rss_kb(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss;
}

/* Run the golden inputs `runs` times after `warmup` runs; fills sorted latencies. */
static int timed_runs(const cli_opts *o, int warmup, int runs, double *lat, ep_tensor *outputs, ep_status *st) {
    ep_tensor inputs[64];
    memset(inputs, 0, sizeof inputs);
    int rc = load_golden(ep_spec.golden_inputs, ep_spec.n_inputs, inputs, st);
    if (rc) return rc;
    ep_engine *e = NULL;
    rc = ep_engine_open(&ep_spec, o->threads, &e, st);
    if (!rc) rc = ep_alloc_outputs(&ep_spec, outputs, st);
    for (int i = 0; !rc && i < warmup + runs; i++) {
        double t0 = ep_now_ms();
        rc = ep_engine_run(e, inputs, outputs, st);
        if (i >= warmup) lat[i - warmup] = ep_now_ms() - t0;
    }
    if (e) ep_engine_close(e);
    free_all(inputs, ep_spec.n_inputs);
    if (!rc) qsort(lat, (size_t)runs, sizeof(double), cmp_double);
    return rc;
}

static int cmd_selftest(const cli_opts *o, ep_status *st) {
    ep_tensor outputs[64], golden[64];
    memset(outputs, 0, sizeof outputs);
    int runs = o->runs > 0 ? o->runs : 3, warmup = o->warmup >= 0 ? o->warmup : 1;
    double *lat = calloc((size_t)runs, sizeof(double));
    if (!lat) return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    int rc = timed_runs(o, warmup, runs, lat, outputs, st);
    double median = lat[runs / 2];
    free(lat);
    if (!rc) rc = load_golden(ep_spec.golden_outputs, ep_spec.n_outputs, golden, st);
    if (rc) {
        free_all(outputs, ep_spec.n_outputs);
        return rc;
    }
    int pass = 1;
    double worst_err = 0, worst_bound = 0, worst_ratio = -1;
    for (int i = 0; i < ep_spec.n_outputs; i++) {
        double err = ep_max_abs_diff(&outputs[i], &golden[i]);
        double bound = ep_spec.atol + ep_spec.rtol * ep_max_abs(&golden[i]);
        double ratio = bound > 0 ? err / bound : (err > 0 ? INFINITY : 0);
        if (!(err <= bound)) pass = 0;
        if (ratio > worst_ratio) {
            worst_ratio = ratio;
            worst_err = err;
            worst_bound = bound;
        }
    }
    if (o->json) {
        printf("{\"result\": \"%s\", \"model\": ", pass ? "PASS" : "FAIL");
        ep_json_string(stdout, ep_spec.model_name);
        printf(", \"target\": ");
        ep_json_string(stdout, ep_spec.target);
        printf(", \"backend\": ");
        ep_json_string(stdout, ep_spec.backend);
        printf(", \"max_abs_err\": %.6g, \"bound\": %.6g, \"latency_ms\": %.3f, \"threads\": %d}\n", worst_err,
               worst_bound, median, o->threads);
    } else {
        printf("%s model=%s target=%s backend=%s max_abs_err=%.3g bound=%.3g latency_ms=%.3f threads=%d\n",
               pass ? "PASS" : "FAIL", ep_spec.model_name, ep_spec.target, ep_spec.backend, worst_err, worst_bound,
               median, o->threads);
    }
    free_all(outputs, ep_spec.n_outputs);
    free_all(golden, ep_spec.n_outputs);
    return pass ? EP_OK : EP_EXIT_FAIL;
}

static int cmd_bench(const cli_opts *given, ep_status *st) {
    cli_opts opts = *given;
    cli_opts *o = &opts;
    if (o->runs < 0) o->runs = 50;
    if (o->warmup < 0) o->warmup = 5;
    ep_tensor outputs[64];
    memset(outputs, 0, sizeof outputs);
    double *lat = calloc((size_t)o->runs, sizeof(double));
    if (!lat) return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    int rc = timed_runs(o, o->warmup, o->runs, lat, outputs, st);
    free_all(outputs, ep_spec.n_outputs);
    if (!rc) {
        double mn = lat[0], med = lat[o->runs / 2], p90 = lat[(int)((o->runs - 1) * 0.9 + 0.5)];
        long rss = peak_rss_kb();
        if (o->json)
            printf("{\"runs\": %d, \"warmup\": %d, \"threads\": %d, \"min_ms\": %.4f, \"median_ms\": %.4f, "
                   "\"p90_ms\": %.4f, \"peak_rss_kb\": %ld}\n",
                   o->runs, o->warmup, o->threads, mn, med, p90, rss);
        else
            printf("runs=%d warmup=%d threads=%d min_ms=%.4f median_ms=%.4f p90_ms=%.4f peak_rss_kb=%ld\n", o->runs,
                   o->warmup, o->threads, mn, med, p90, rss);
    }
    free(lat);
    return rc;
}

int ep_cli(int argc, char **argv) {
    const char *prog = argc > 0 ? argv[0] : "artifact";
    ep_status st = {0, ""};
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "help") == 0) {
        fprintf(argc < 2 ? stderr : stdout, USAGE, prog);
        return argc < 2 ? EP_ERR_USAGE : EP_OK;
    }
    const char *cmd = argv[1];
    cli_opts o;
    int rc = parse_opts(argc, argv, 2, &o, &st);
    if (!rc) {
        if (strcmp(cmd, "info") == 0) {
            print_manifest();
        } else if (strcmp(cmd, "run") == 0) {
            rc = cmd_run(&o, &st);
        } else if (strcmp(cmd, "selftest") == 0) {
            rc = cmd_selftest(&o, &st);
        } else if (strcmp(cmd, "bench") == 0) {
            rc = cmd_bench(&o, &st);
        } else if (strcmp(cmd, "serve") == 0) {
            rc = cmd_serve(&o, &st);
        } else {
            rc = ep_fail(&st, EP_ERR_USAGE, "unknown command %s (try: info, run, selftest, bench, serve)", cmd);
        }
    }
    if (rc && rc != EP_EXIT_FAIL) fprintf(stderr, "error: %s\n", st.message);
    return rc;
}
