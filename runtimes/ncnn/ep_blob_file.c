/* The NCNN engine reads its embedded .param, weights and weight map with pread on /proc/self/exe
 * rather than through the executable's mapping (issue 10 item 5). ncnn copies everything it loads, so
 * the mapping gave no zero-copy; but every page read through it counted in the process's RSS, and where
 * the kernel keeps files in large folios (6.18 here) a touch maps the whole folio: the .param shared a
 * 2 MiB folio with the golden outputs and the first weights, and handing pages back with madvise did not
 * hold. A pread copies from the page cache and maps nothing. Where /proc or the file is not there, the
 * engine reads through the mapping as before. */
#define _DEFAULT_SOURCE /* pread, major/minor */
#include "ep_blob_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

/* The read-only, file-backed mapping containing [lo, hi) from /proc/self/maps, with its device and
 * inode; 0 when there is none. */
static int mapping_of(uintptr_t lo, uintptr_t hi, ep_blob_file *f, unsigned *maj, unsigned *min, unsigned long *inode) {
    FILE *maps = fopen("/proc/self/maps", "r");
    if (!maps) return 0;
    char line[512];
    int found = 0;
    while (!found && fgets(line, sizeof line, maps)) {
        unsigned long a, b, ino;
        unsigned long long off;
        unsigned dmaj, dmin;
        char perms[8];
        if (sscanf(line, "%lx-%lx %7s %llx %x:%x %lu", &a, &b, perms, &off, &dmaj, &dmin, &ino) != 7) continue;
        if (a <= lo && hi <= b && perms[1] == '-' && ino != 0) {
            f->start = a;
            f->end = b;
            f->off = (off_t)off;
            *maj = dmaj;
            *min = dmin;
            *inode = ino;
            found = 1;
        }
    }
    fclose(maps);
    return found;
}

void ep_blob_file_open(ep_blob_file *f, const void *p, size_t n) {
    f->fd = -1;
    f->start = f->end = 0;
    f->off = 0;
    unsigned maj = 0, min = 0;
    unsigned long inode = 0;
    uintptr_t lo = (uintptr_t)p;
    if (!n || !mapping_of(lo, lo + n, f, &maj, &min, &inode)) return;
    int fd = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    struct stat st;
    /* the same file as the mapping (a read past its end falls short, and the caller reads the mapping) */
    if (fstat(fd, &st) != 0 || (unsigned long)st.st_ino != inode || major(st.st_dev) != maj || minor(st.st_dev) != min) {
        close(fd);
        return;
    }
    f->fd = fd;
}

int ep_blob_file_read(const ep_blob_file *f, void *buf, const void *src, size_t n) {
    uintptr_t s = (uintptr_t)src;
    if (f->fd < 0 || s < f->start || s > f->end || n > f->end - s) return 0;
    unsigned char *out = buf;
    off_t at = f->off + (off_t)(s - f->start);
    while (n) {
        ssize_t got = pread(f->fd, out, n, at);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return 0;
        out += got;
        n -= (size_t)got;
        at += got;
    }
    return 1;
}

void ep_blob_file_close(ep_blob_file *f) {
    if (f->fd >= 0) close(f->fd);
    f->fd = -1;
}
