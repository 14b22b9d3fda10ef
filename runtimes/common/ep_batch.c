/* Batch runs: `run --input-dir DIR --output results.jsonl` (one line per file; a bad file is an
 * error line, not a stop) and `run --input rows.csv --output out.csv|out.jsonl`. */
#define _GNU_SOURCE
#include "ep_io.h"

#include <dirent.h>
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

static int open_out(const char *output, FILE **f, ep_status *st) {
    if (!output || strcmp(output, "-") == 0) {
        *f = stdout;
        return EP_OK;
    }
    *f = fopen(output, "w");
    if (!*f) return ep_fail(st, EP_ERR_IO, "%s: cannot write", output);
    return EP_OK;
}

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
        rc = ep_predict_csv(&ep_spec, pp, e, (const char *)buf, len, f, 0, st);
    } else {
        ep_tensor inputs[64], outputs[64];
        memset(outputs, 0, sizeof outputs);
        rc = ep_inputs_from_bytes(&ep_spec, pp, buf, len, kind, inputs, st);
        if (!rc) {
            rc = ep_alloc_outputs(&ep_spec, outputs, st);
            if (!rc) rc = ep_engine_run(e, inputs, outputs, st);
            if (!rc) ep_write_answer(f, &ep_spec, pp, outputs);
            ep_free_tensors(inputs, ep_spec.n_inputs);
            ep_free_tensors(outputs, ep_spec.n_outputs);
        }
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

int ep_run_batch(const char *input_dir, const char *input_csv, const char *output, int threads, ep_status *st) {
    ep_prepost pp;
    ep_engine *e = NULL;
    int rc = ep_prepost_load(&ep_spec, &pp, st);
    if (!rc) rc = ep_engine_open(&ep_spec, threads, &e, st);
    FILE *out = NULL;
    if (!rc) rc = open_out(output, &out, st);
    if (!rc && input_csv) {
        unsigned char *buf = NULL;
        size_t len = 0;
        rc = ep_read_file(input_csv, EP_BATCH_MAX_FILE, &buf, &len, st);
        if (!rc) rc = ep_predict_csv(&ep_spec, &pp, e, (const char *)buf, len, out,
                                     output && ends_with(output, ".csv") ? 1 : 2, st);
        free(buf);
    } else if (!rc) {
        DIR *d = opendir(input_dir);
        char **names = NULL;
        size_t n = 0, cap = 0;
        if (!d) rc = ep_fail(st, EP_ERR_IO, "%s: cannot read the directory", input_dir);
        struct dirent *de;
        while (!rc && (de = readdir(d)) != NULL) {
            if (de->d_name[0] == '.') continue;
            if (n == cap) {
                cap = cap ? cap * 2 : 64;
                char **nn = cap <= EP_BATCH_MAX_FILES ? realloc(names, cap * sizeof *nn) : NULL;
                if (!nn) {
                    rc = ep_fail(st, EP_ERR_NOMEM, "too many files in %s", input_dir);
                    break;
                }
                names = nn;
            }
            names[n] = strdup(de->d_name);
            if (!names[n]) rc = ep_fail(st, EP_ERR_NOMEM, "out of memory");
            else n++;
        }
        if (d) closedir(d);
        if (!rc) qsort(names, n, sizeof *names, cmp_str);
        long ok = 0, bad = 0;
        for (size_t i = 0; !rc && i < n; i++) {
            char path[4096];
            struct stat sb;
            snprintf(path, sizeof path, "%s/%s", input_dir, names[i]);
            if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
            ep_status fst = {0, ""};
            if (one_file(&pp, e, path, names[i], out, &fst) == EP_OK) {
                ok++;
            } else {
                bad++;
                fputs("{\"file\": ", out);
                ep_json_string(out, names[i]);
                fputs(", \"error\": ", out);
                ep_json_string(out, fst.message);
                fputs("}\n", out);
            }
            fflush(out);
        }
        for (size_t i = 0; i < n; i++) free(names[i]);
        free(names);
        if (!rc) fprintf(stderr, "%ld files: %ld ok, %ld failed\n", ok + bad, ok, bad);
    }
    if (out && out != stdout) fclose(out);
    if (e) ep_engine_close(e);
    ep_prepost_free(&pp);
    return rc;
}

EP_SIZE_OPT_END
