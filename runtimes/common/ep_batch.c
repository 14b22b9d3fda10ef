/* Batch runs: `run --input-dir DIR --output results.jsonl` (one line per file; a bad file is an
 * error line, not a stop, but the exit status says some failed) and
 * `run --input rows.csv --output out.csv|out.jsonl`.
 * Nothing is lost: inputs are read (or listed) before the output is touched, the output is written
 * to a temporary file in its folder and renamed only when done, and it may not be an input. */
#define _GNU_SOURCE
#include "ep_io.h"

#include <dirent.h>
#include <errno.h>
#include <libgen.h>
#include <strings.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

EP_SIZE_OPT_BEGIN

#define EP_BATCH_MAX_FILE ((size_t)1 << 30)
#define EP_BATCH_MAX_FILES 1000000

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcasecmp(s + a - b, suf) == 0;
}

static int to_stdout(const char *output) { return !output || strcmp(output, "-") == 0; }

static int one_file(const ep_prepost *pp, ep_engine *e, const char *path, const char *name, FILE *out,
                    ep_status *st) {
    unsigned char *buf = NULL;
    size_t len = 0;
    int rc = ep_read_file(path, EP_BATCH_MAX_FILE, &buf, &len, st);
    if (rc) return rc;
    ep_kind kind = ep_sniff(buf, len);
    char *body = NULL;
    size_t blen = 0;
    FILE *f = open_memstream(&body, &blen); /* a line is written only when the whole answer is ready */
    if (!f) {
        free(buf);
        return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    }
    double t0 = ep_now_ms();
    if (kind == EP_KIND_CSV && !ends_with(name, ".csv")) {
        rc = ep_fail(st, EP_ERR_INPUT, "unrecognised file (expected an image, .npy, .json or .csv)");
    } else if (kind == EP_KIND_CSV) {
        fputs("\"rows\": ", f);
        rc = ep_predict_csv(&ep_spec, pp, e, (const char *)buf, len, f, EP_ROWS_JSON_ARRAY, st);
    } else {
        ep_tensor *inputs = ep_tensor_array(ep_spec.n_inputs), *outputs = ep_tensor_array(ep_spec.n_outputs);
        rc = inputs && outputs ? EP_OK : ep_fail(st, EP_ERR_NOMEM, "out of memory");
        if (!rc) rc = ep_inputs_from_bytes(&ep_spec, pp, buf, len, kind, inputs, st);
        if (!rc) rc = ep_alloc_outputs(&ep_spec, outputs, st);
        if (!rc) rc = ep_engine_run(e, inputs, outputs, st);
        if (!rc) ep_write_answer(f, &ep_spec, pp, outputs);
        ep_tensor_array_free(inputs, ep_spec.n_inputs);
        ep_tensor_array_free(outputs, ep_spec.n_outputs);
    }
    fclose(f);
    free(buf);
    if (!rc) {
        fputs("{\"file\": ", out);
        ep_json_string(out, name);
        fprintf(out, ", %s, \"latency_ms\": %.3f}\n", body, ep_now_ms() - t0);
    }
    free(body);
    return rc;
}

static void free_names(char **names, size_t n) {
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
}

/* The regular files' names in dir, sorted; read before anything is written. */
static int list_dir(const char *dir, char ***out, size_t *count, ep_status *st) {
    DIR *d = opendir(dir);
    if (!d) return ep_fail(st, EP_ERR_IO, "--input-dir %s: %s", dir, strerror(errno));
    char **names = NULL;
    size_t n = 0, cap = 0;
    int rc = EP_OK;
    struct dirent *de;
    while (!rc && (de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.') continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            char **nn = cap <= EP_BATCH_MAX_FILES ? realloc(names, cap * sizeof *nn) : NULL;
            if (!nn) {
                rc = ep_fail(st, EP_ERR_NOMEM, "too many files in %s", dir);
                break;
            }
            names = nn;
        }
        names[n] = strdup(de->d_name);
        if (!names[n]) rc = ep_fail(st, EP_ERR_NOMEM, "out of memory");
        else n++;
    }
    closedir(d);
    if (rc) {
        free_names(names, n);
        return rc;
    }
    if (n) qsort(names, n, sizeof *names, cmp_str);
    *out = names;
    *count = n;
    return EP_OK;
}

/* Results written into the input folder would overwrite an input, or be read as one next time. */
static int output_in_dir(const char *output, const char *dir) {
    char *copy = strdup(output);
    if (!copy) return 0;
    int same = ep_same_file(dirname(copy), dir);
    free(copy);
    return same;
}

static int run_dir(const ep_prepost *pp, ep_engine *e, const char *dir, char **names, size_t n, FILE *out,
                   const char *output, ep_status *st) {
    long ok = 0, bad = 0;
    for (size_t i = 0; i < n; i++) {
        char *path;
        struct stat sb;
        if (asprintf(&path, "%s/%s", dir, names[i]) < 0) return ep_fail(st, EP_ERR_NOMEM, "out of memory");
        if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) {
            free(path);
            continue;
        }
        ep_status fst = {0, ""};
        if (one_file(pp, e, path, names[i], out, &fst) == EP_OK) {
            ok++;
        } else {
            bad++;
            fputs("{\"file\": ", out);
            ep_json_string(out, names[i]);
            fputs(", \"error\": ", out);
            ep_json_string(out, fst.message);
            fputs("}\n", out);
        }
        free(path);
        fflush(out);
    }
    fprintf(stderr, "%ld files: %ld ok, %ld failed\n", ok + bad, ok, bad);
    if (bad)
        return ep_fail(st, EP_ERR_INPUT, "%ld of %ld files failed (their error lines are in %s)", bad, ok + bad,
                       to_stdout(output) ? "the output" : output);
    return EP_OK;
}

int ep_run_batch(const char *input_dir, const char *input_csv, const char *output, int threads, ep_status *st) {
    int rc = EP_OK;
    char **names = NULL;
    size_t n = 0;
    unsigned char *csv = NULL;
    size_t csv_len = 0;
    /* 1. every input read or listed, and the output checked, before the output is touched */
    if (input_csv) rc = ep_read_file(input_csv, EP_BATCH_MAX_FILE, &csv, &csv_len, st);
    else rc = list_dir(input_dir, &names, &n, st);
    if (!rc && !to_stdout(output)) {
        if (input_csv && ep_same_file(output, input_csv))
            rc = ep_fail(st, EP_ERR_USAGE, "--output %s is the input %s: write the results to another file", output,
                         input_csv);
        else if (input_dir && output_in_dir(output, input_dir))
            rc = ep_fail(st, EP_ERR_USAGE, "--output %s is inside --input-dir %s: write the results elsewhere", output,
                         input_dir);
    }
    ep_prepost pp;
    memset(&pp, 0, sizeof pp);
    ep_engine *e = NULL;
    if (!rc) rc = ep_prepost_load(&ep_spec, &pp, st);
    if (!rc) rc = ep_engine_open(&ep_spec, threads, &e, st);
    /* 2. results into a temporary file, renamed over the output only when complete */
    ep_outfile of;
    memset(&of, 0, sizeof of);
    FILE *out = stdout;
    if (!rc && !to_stdout(output)) {
        rc = ep_outfile_open(&of, output, st);
        out = of.f;
    }
    int failed_files = 0;
    if (!rc && input_csv) {
        rc = ep_predict_csv(&ep_spec, &pp, e, (const char *)csv, csv_len, out,
                            output && ends_with(output, ".csv") ? EP_ROWS_CSV : EP_ROWS_JSONL, st);
    } else if (!rc) {
        rc = run_dir(&pp, e, input_dir, names, n, out, output, st);
        failed_files = rc == EP_ERR_INPUT; /* the results (error lines included) are still kept */
    }
    if (of.f) {
        if (!rc || failed_files) {
            ep_status cst = {0, ""};
            if (ep_outfile_commit(&of, &cst)) {
                *st = cst;
                rc = cst.code;
            }
        } else {
            ep_outfile_abort(&of);
        }
    }
    free(csv);
    free_names(names, n);
    if (e) ep_engine_close(e);
    ep_prepost_free(&pp);
    return rc;
}

EP_SIZE_OPT_END
