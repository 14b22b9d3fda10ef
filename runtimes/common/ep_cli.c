/* The artifact's command line: info, run, selftest, bench. Returns exit codes; never exits. */
#define _GNU_SOURCE
#include "ep_runtime.h"
#include "ep_io.h"
#include "ep_server.h" /* serve limit options (issue #11) */

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#define EP_MAX_INPUT_BYTES ((size_t)1 << 31)
#define EP_EXIT_FAIL 1

static const char USAGE[] =
    "usage: %s COMMAND [options]\n"
    "  info [--json]                          inputs, outputs, target, precision (--json: the manifest)\n"
    "  --version                              model, target, backend, edgepack version\n"
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
    const char **inputs; /* sized from argc: as many --input options as the command line holds */
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
    o->inputs = calloc(argc > 0 ? (size_t)argc : 1, sizeof *o->inputs);
    if (!o->inputs) return ep_fail(st, EP_ERR_NOMEM, "out of memory");
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
    /* the manifest as embedded, plus the thread cap the build wrote into the finished executable
     * after it was bundled (so not in the embedded manifest): verify-build rebuilds with it */
    const ep_blob *m = &ep_spec.manifest_json;
    size_t n = ep_blob_size(m);
    while (n > 0 && m->data[n - 1] != '}') n--;
    if (n == 0) { /* not an object: print it as it is */
        fwrite(m->data, 1, ep_blob_size(m), stdout);
        fputc('\n', stdout);
        return;
    }
    n--; /* drop the closing brace and the blank before it */
    while (n > 0 && (m->data[n - 1] == '\n' || m->data[n - 1] == ' ')) n--;
    fwrite(m->data, 1, n, stdout);
    printf(",\n \"default_threads_cap\": %d\n}\n", ep_default_threads_cap());
}

/* The value of the first "key": "value" string in the embedded manifest (bounded copy, "" if absent):
 * enough for a human summary; tools read `info --json`. */
static void manifest_string(const char *key, char *out, size_t len) {
    const ep_blob *m = &ep_spec.manifest_json;
    size_t n = ep_blob_size(m), klen = strlen(key);
    const char *text = (const char *)m->data;
    out[0] = 0;
    for (size_t i = 0; i + klen + 4 < n; i++) {
        if (text[i] != '"' || memcmp(text + i + 1, key, klen) != 0 || text[i + 1 + klen] != '"') continue;
        size_t j = i + 2 + klen;
        while (j < n && (text[j] == ':' || text[j] == ' ')) j++;
        if (j >= n || text[j] != '"') return;
        size_t k = 0;
        for (j++; j < n && text[j] != '"' && k + 1 < len; j++) out[k++] = text[j];
        out[k] = 0;
        return;
    }
}

static void print_io(const char *kind, const ep_io_spec *io) {
    char shape[128];
    ep_shape_str(io->shape, io->ndim, shape, sizeof shape);
    printf("%-7s %s: %s %s\n", kind, io->name, ep_dtype_name(io->dtype), shape);
}

/* `info`: what a person wants to know at a glance; `info --json`: the whole manifest. */
static void print_summary(void) {
    char precision[64], version[64];
    manifest_string("precision_rung", precision, sizeof precision);
    if (!precision[0]) manifest_string("precision", precision, sizeof precision);
    manifest_string("edgepack", version, sizeof version);
    const char *engine = ep_engine_describe();
    printf("model   %s\ntarget  %s\nbackend %s%s%s%s\nprecision %s\n", ep_spec.model_name, ep_spec.target,
           ep_spec.backend, strcmp(engine, ep_spec.backend) ? " (" : "", strcmp(engine, ep_spec.backend) ? engine : "",
           strcmp(engine, ep_spec.backend) ? ")" : "", precision[0] ? precision : "?");
    for (int i = 0; i < ep_spec.n_inputs; i++) print_io("input", &ep_spec.inputs[i]);
    for (int i = 0; i < ep_spec.n_outputs; i++) print_io("output", &ep_spec.outputs[i]);
    int cap = ep_default_threads_cap();
    if (cap > 0) printf("threads every free core, at most %d (the fastest measured at build; --threads N overrides)\n", cap);
    else printf("threads every free core (--threads N overrides)\n");
    printf("built by edgepack %s; the full manifest: info --json\n", version[0] ? version : "?");
}

static void print_version(void) {
    char version[64];
    manifest_string("edgepack", version, sizeof version);
    printf("%s for %s (%s), built by edgepack %s\n", ep_spec.model_name, ep_spec.target, ep_spec.backend,
           version[0] ? version : "?");
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

typedef struct {
    int index;        /* the model input this file feeds */
    const char *path;
} input_arg;

static int input_named(const char *name, size_t len) {
    for (int i = 0; i < ep_spec.n_inputs; i++)
        if (strlen(ep_spec.inputs[i].name) == len && memcmp(ep_spec.inputs[i].name, name, len) == 0) return i;
    return -1;
}

/* [NAME=]FILE: NAME= only where NAME is one of the model's inputs, so a path holding '='
 * (/data/a=b/x.npy) is a path for a one-input model; a mistyped NAME before an existing FILE is
 * still reported as the unknown input it is. */
static int assign_input(const char *arg, input_arg *out, ep_status *st) {
    const char *first = strchr(arg, '=');
    for (const char *eq = first; eq; eq = strchr(eq + 1, '=')) {
        int i = input_named(arg, (size_t)(eq - arg));
        if (i >= 0) {
            out->index = i;
            out->path = eq + 1;
            return EP_OK;
        }
    }
    int mistyped = first && access(arg, F_OK) != 0 && access(first + 1, F_OK) == 0;
    if (ep_spec.n_inputs == 1 && !mistyped) {
        out->index = 0;
        out->path = arg;
        return EP_OK;
    }
    char names[512] = "";
    for (int i = 0; i < ep_spec.n_inputs; i++) {
        strncat(names, i ? ", " : "", sizeof names - strlen(names) - 1);
        strncat(names, ep_spec.inputs[i].name, sizeof names - strlen(names) - 1);
    }
    if (mistyped)
        return ep_fail(st, EP_ERR_USAGE, "--input %s: no such input %.*s (the model's inputs: %s)", arg,
                       (int)(first - arg), arg, names);
    return ep_fail(st, EP_ERR_USAGE, "--input %s: the model has %d inputs, write NAME=FILE (its inputs: %s)", arg,
                   ep_spec.n_inputs, names);
}

/* An output's file name: its tensor name with anything but [A-Za-z0-9_.-] as '_', no leading '.',
 * at most EP_NAME_MAX bytes (tensor names of any length stay one short file name). */
#define EP_NAME_MAX 100
static void safe_name(const char *name, char *out) {
    size_t j = 0;
    for (size_t i = 0; name[i] && j < EP_NAME_MAX; i++) {
        char c = name[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                 c == '-' || (c == '.' && j > 0);
        out[j++] = ok ? c : '_';
    }
    out[j] = 0;
    if (!j) snprintf(out, EP_NAME_MAX + 1, "output");
}

/* DIR/NAME.npy for every output; names that sanitise alike ("a/b", "a:b") get _2, _3, ... so no
 * output overwrites another. Returns n malloc'd paths (free with free_paths). */
static void free_paths(char **p, int n) {
    if (!p) return;
    for (int i = 0; i < n; i++) free(p[i]);
    free(p);
}

static int output_paths(const char *dir, char ***out, ep_status *st) {
    int n = ep_spec.n_outputs;
    char **paths = calloc((size_t)n, sizeof *paths);
    char (*names)[EP_NAME_MAX + 16] = calloc((size_t)n, sizeof *names);
    if (!paths || !names) {
        free(paths);
        free(names);
        return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    }
    for (int i = 0; i < n; i++) {
        char base[EP_NAME_MAX + 1];
        safe_name(ep_spec.outputs[i].name, base);
        snprintf(names[i], sizeof names[i], "%s", base);
        for (int k = 2, clash = 1; clash; k++) { /* at most n tries: only n names exist */
            clash = 0;
            for (int j = 0; j < i && !clash; j++) clash = strcasecmp(names[j], names[i]) == 0;
            if (clash) snprintf(names[i], sizeof names[i], "%s_%d", base, k);
        }
        if (asprintf(&paths[i], "%s/%s.npy", dir, names[i]) < 0) {
            paths[i] = NULL;
            free_paths(paths, n);
            free(names);
            return ep_fail(st, EP_ERR_NOMEM, "out of memory");
        }
    }
    free(names);
    *out = paths;
    return EP_OK;
}

static int is_csv_path(const char *p) {
    size_t n = strlen(p);
    return n > 4 && strcasecmp(p + n - 4, ".csv") == 0;
}

/* Files in, tensors out: each --input read, parsed and checked against the model's declaration. */
static int read_inputs(const cli_opts *o, const input_arg *args, const ep_prepost *pp, ep_tensor *inputs,
                       ep_status *st) {
    int rc = EP_OK;
    char *have = calloc((size_t)ep_spec.n_inputs + 1, 1);
    if (!have) return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    for (int k = 0; k < o->n_inputs && !rc; k++) {
        int idx = args[k].index;
        const char *path = args[k].path;
        if (have[idx]) {
            rc = ep_fail(st, EP_ERR_USAGE, "input %s given twice", ep_spec.inputs[idx].name);
            break;
        }
        unsigned char *buf;
        size_t len;
        rc = ep_read_file(path, EP_MAX_INPUT_BYTES, &buf, &len, st);
        if (rc) break;
        ep_kind kind = ep_sniff(buf, len);
        int checked = 0; /* a shape/dtype error names the input already; a parse error names the file */
        if (kind == EP_KIND_NPY || ep_spec.n_inputs != 1) {
            rc = ep_npy_parse(buf, len, &inputs[idx], st);
            checked = !rc;
            if (!rc) rc = ep_coerce_input(&ep_spec.inputs[idx], &inputs[idx],
                                          pp->has_image && pp->image_input == idx, st);
        } else { /* JSON or (baked preprocessing) an image, for the one input */
            rc = ep_inputs_from_bytes(&ep_spec, pp, buf, len, kind, inputs, st);
        }
        free(buf);
        if (rc && !checked) {
            char msg[sizeof st->message];
            snprintf(msg, sizeof msg, "%s", st->message);
            ep_fail(st, EP_ERR_INPUT, "%s: %s", path, msg);
        }
        if (rc) break;
        have[idx] = 1;
    }
    for (int i = 0; !rc && i < ep_spec.n_inputs; i++)
        if (!have[i]) rc = ep_fail(st, EP_ERR_USAGE, "missing input %s (--input %s=FILE.npy)", ep_spec.inputs[i].name,
                                   ep_spec.inputs[i].name);
    free(have);
    return rc;
}

static void print_run_report(const cli_opts *o, double ms, const ep_prepost *pp, const ep_tensor *outputs,
                             char **paths) {
    printf("{\"latency_ms\": %.3f, \"threads\": %d, ", ms, o->threads);
    if (!paths) {
        ep_write_answer(stdout, &ep_spec, pp, outputs);
        fputs("}\n", stdout);
        return;
    }
    fputs("\"outputs\": {", stdout);
    for (int i = 0; i < ep_spec.n_outputs; i++) {
        if (i) fputs(", ", stdout);
        ep_json_string(stdout, ep_spec.outputs[i].name);
        printf(": {\"dtype\": \"%s\", \"shape\": ", ep_dtype_name(outputs[i].dtype));
        ep_write_shape_json(stdout, outputs[i].shape, outputs[i].ndim);
        fputs(", \"file\": ", stdout);
        ep_json_string(stdout, paths[i]);
        fputc('}', stdout);
    }
    fputs("}}\n", stdout);
}

static int cmd_run(const cli_opts *o, ep_status *st) {
    if (o->input_dir) {
        if (o->n_inputs) return ep_fail(st, EP_ERR_USAGE, "give --input or --input-dir, not both");
        return ep_run_batch(o->input_dir, NULL, o->output_dir, o->threads, st);
    }
    if (o->n_inputs == 0) return ep_fail(st, EP_ERR_USAGE, "run needs --input [NAME=]FILE.npy");
    input_arg *args = calloc((size_t)o->n_inputs, sizeof *args);
    if (!args) return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    int rc = EP_OK;
    for (int k = 0; k < o->n_inputs && !rc; k++) rc = assign_input(o->inputs[k], &args[k], st);
    if (!rc && o->n_inputs == 1 && is_csv_path(args[0].path)) {
        rc = ep_run_batch(NULL, args[0].path, o->output_dir, o->threads, st);
        free(args);
        return rc;
    }
    char **paths = NULL;
    if (!rc && o->output_dir) rc = output_paths(o->output_dir, &paths, st);
    /* before anything runs: no output file may be one of the inputs (also via links) */
    for (int i = 0; !rc && paths && i < ep_spec.n_outputs; i++)
        for (int k = 0; !rc && k < o->n_inputs; k++)
            if (ep_same_file(paths[i], args[k].path))
                rc = ep_fail(st, EP_ERR_USAGE, "--output %s: output %s would overwrite the input %s", o->output_dir,
                             paths[i], args[k].path);
    ep_prepost pp;
    memset(&pp, 0, sizeof pp);
    if (!rc) rc = ep_prepost_load(&ep_spec, &pp, st);
    ep_tensor *inputs = ep_tensor_array(ep_spec.n_inputs), *outputs = ep_tensor_array(ep_spec.n_outputs);
    if (!rc && (!inputs || !outputs)) rc = ep_fail(st, EP_ERR_NOMEM, "out of memory");
    if (!rc) rc = read_inputs(o, args, &pp, inputs, st);
    ep_engine *e = NULL;
    if (!rc) rc = ep_engine_open(&ep_spec, o->threads, &e, st);
    if (!rc) rc = ep_alloc_outputs(&ep_spec, outputs, st);
    double ms = 0;
    if (!rc) {
        double t0 = ep_now_ms();
        rc = ep_engine_run(e, inputs, outputs, st);
        ms = ep_now_ms() - t0;
    }
    if (!rc && paths) {
        if (mkdir(o->output_dir, 0755) != 0 && errno != EEXIST)
            rc = ep_fail(st, EP_ERR_IO, "%s: %s", o->output_dir, strerror(errno));
        for (int i = 0; !rc && i < ep_spec.n_outputs; i++) rc = ep_npy_write_file(paths[i], &outputs[i], st);
    }
    if (!rc) print_run_report(o, ms, &pp, outputs, paths);
    if (e) ep_engine_close(e);
    ep_tensor_array_free(inputs, ep_spec.n_inputs);
    ep_tensor_array_free(outputs, ep_spec.n_outputs);
    free_paths(paths, ep_spec.n_outputs);
    free(args);
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

/* Peak RSS of this program: VmHWM of its own address space. ru_maxrss is not that: Linux carries the
 * launcher's peak over exec (a vfork from a 120 MB Python reports 120 MB for any artifact). */
static long peak_rss_kb(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (f) {
        char line[256];
        long kb = -1;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "VmHWM: %ld kB", &kb) == 1) break;
        fclose(f);
        if (kb > 0) return kb;
    }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss;
}

/* CPU time of the whole process so far (every thread, user + system), ms: with the machine's own
 * CPU counters it tells whether anything else ran while bench timed (edgepack/thread_policy.py) */
static double process_cpu_ms(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return -1;
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e3
           + (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e3;
}

/* Run the golden inputs `runs` times after `warmup` runs; fills sorted latencies. */
static int timed_runs(const cli_opts *o, int warmup, int runs, double *lat, ep_tensor *outputs, ep_status *st) {
    ep_tensor *inputs = ep_tensor_array(ep_spec.n_inputs);
    if (!inputs) return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    int rc = load_golden(ep_spec.golden_inputs, ep_spec.n_inputs, inputs, st);
    if (rc) {
        free(inputs);
        return rc;
    }
    ep_engine *e = NULL;
    rc = ep_engine_open(&ep_spec, o->threads, &e, st);
    if (!rc) rc = ep_alloc_outputs(&ep_spec, outputs, st);
    for (int i = 0; !rc && i < warmup + runs; i++) {
        double t0 = ep_now_ms();
        rc = ep_engine_run(e, inputs, outputs, st);
        if (i >= warmup) lat[i - warmup] = ep_now_ms() - t0;
    }
    if (e) ep_engine_close(e);
    ep_tensor_array_free(inputs, ep_spec.n_inputs);
    if (!rc) qsort(lat, (size_t)runs, sizeof(double), cmp_double);
    return rc;
}

static int cmd_selftest(const cli_opts *o, ep_status *st) {
    int runs = o->runs > 0 ? o->runs : 3, warmup = o->warmup >= 0 ? o->warmup : 1;
    ep_tensor *outputs = ep_tensor_array(ep_spec.n_outputs), *golden = ep_tensor_array(ep_spec.n_outputs);
    double *lat = calloc((size_t)runs, sizeof(double));
    int rc = outputs && golden && lat ? EP_OK : ep_fail(st, EP_ERR_NOMEM, "out of memory");
    if (!rc) rc = timed_runs(o, warmup, runs, lat, outputs, st);
    double median = rc ? 0 : lat[runs / 2];
    free(lat);
    if (!rc) rc = load_golden(ep_spec.golden_outputs, ep_spec.n_outputs, golden, st);
    if (rc) {
        ep_tensor_array_free(outputs, ep_spec.n_outputs);
        free(golden);
        return rc;
    }
    int pass = 1;
    double worst_err = 0, worst_bound = 0, worst_ratio = -1, min_cos = 1;
    for (int i = 0; i < ep_spec.n_outputs; i++) {
        double err = ep_max_abs_diff(&outputs[i], &golden[i]);
        double scale = ep_max_abs(&golden[i]);
        double bound = ep_spec.atol + ep_spec.rtol * scale;
        double ratio = bound > 0 ? err / bound : (err > 0 ? INFINITY : 0);
        if (!(err <= bound)) pass = 0;
        /* the same second check as the build's verification: an error spread over the whole output
         * stays under the max bound but turns the output's direction (only where ref is not ~0) */
        if (scale > ep_spec.atol) {
            double c = ep_cosine(&outputs[i], &golden[i]);
            if (!(c >= ep_spec.min_cosine)) pass = 0;
            if (!(c >= min_cos)) min_cos = c;
        }
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
        printf(", \"max_abs_err\": %.6g, \"bound\": %.6g, \"cosine\": %.9g, \"min_cosine\": %.6g, "
               "\"latency_ms\": %.3f, \"threads\": %d}\n", worst_err, worst_bound, isnan(min_cos) ? 0.0 : min_cos,
               ep_spec.min_cosine, median, o->threads);
    } else {
        printf("%s model=%s target=%s backend=%s max_abs_err=%.3g bound=%.3g cosine=%.6f latency_ms=%.3f threads=%d\n",
               pass ? "PASS" : "FAIL", ep_spec.model_name, ep_spec.target, ep_spec.backend, worst_err, worst_bound,
               isnan(min_cos) ? 0.0 : min_cos, median, o->threads);
    }
    ep_tensor_array_free(outputs, ep_spec.n_outputs);
    ep_tensor_array_free(golden, ep_spec.n_outputs);
    return pass ? EP_OK : EP_EXIT_FAIL;
}

static int cmd_bench(const cli_opts *given, ep_status *st) {
    cli_opts opts = *given;
    cli_opts *o = &opts;
    if (o->runs < 0) o->runs = 50;
    if (o->warmup < 0) o->warmup = 5;
    ep_tensor *outputs = ep_tensor_array(ep_spec.n_outputs);
    double *lat = calloc((size_t)o->runs, sizeof(double));
    if (!lat || !outputs) {
        free(lat);
        free(outputs);
        return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    }
    int rc = timed_runs(o, o->warmup, o->runs, lat, outputs, st);
    ep_tensor_array_free(outputs, ep_spec.n_outputs);
    if (!rc) {
        double mn = lat[0], med = lat[o->runs / 2], p90 = lat[(int)((o->runs - 1) * 0.9 + 0.5)];
        long rss = peak_rss_kb();
        char why[400];
        int emulated = ep_emulated(why, sizeof why);
        if (o->json) {
            printf("{\"runs\": %d, \"warmup\": %d, \"threads\": %d, \"min_ms\": %.4f, \"median_ms\": %.4f, "
                   "\"p90_ms\": %.4f, \"peak_rss_kb\": %ld, \"cpu_ms\": %.1f, \"emulated\": %s, \"emulation\": ",
                   o->runs, o->warmup, o->threads, mn, med, p90, rss, process_cpu_ms(), emulated ? "true" : "false");
            ep_json_string(stdout, emulated ? why : "");
            fputs("}\n", stdout);
        } else {
            printf("runs=%d warmup=%d threads=%d min_ms=%.4f median_ms=%.4f p90_ms=%.4f peak_rss_kb=%ld\n", o->runs,
                   o->warmup, o->threads, mn, med, p90, rss);
        }
        /* timings taken in an emulator are the emulator's speed: say so where a person reads it */
        if (emulated) fprintf(stderr, "note: running under emulation (%s): these timings are not the device's\n", why);
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
    if (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "version") == 0) {
        print_version();
        return EP_OK;
    }
    for (int i = 2; i < argc; i++) { /* `run --help` etc.: the usage, which covers every command */
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fprintf(stdout, USAGE, prog);
            return EP_OK;
        }
    }
    const char *cmd = argv[1];
    cli_opts o;
    int rc = parse_opts(argc, argv, 2, &o, &st);
    if (!rc) {
        if (strcmp(cmd, "info") == 0) {
            if (o.json) print_manifest();
            else print_summary();
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
    free(o.inputs);
    if (rc && rc != EP_EXIT_FAIL) fprintf(stderr, "error: %s\n", st.message);
    return rc;
}
