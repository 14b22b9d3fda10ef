/* Reading the artifact's embedded blobs with pread on the executable instead of through its mapping
 * (ep_blob_file.c). */
#ifndef EP_BLOB_FILE_H
#define EP_BLOB_FILE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef struct {
    int fd;                   /* the executable; -1: read through the mapping */
    uintptr_t start, end;     /* the read-only file mapping holding the blobs; end 0: none found */
    off_t off;                /* the file offset of start */
} ep_blob_file;

/* Finds the read-only file mapping holding [p, p + n) and opens the executable when that mapping is its
 * own. Never fails: f->fd is -1 and f->end 0 when nothing was found. */
void ep_blob_file_open(ep_blob_file *f, const void *p, size_t n);
/* n bytes of the blob stretch at src (inside the mapping) into buf; 0 when the file cannot give them
 * (then read them from src). */
int ep_blob_file_read(const ep_blob_file *f, void *buf, const void *src, size_t n);
void ep_blob_file_close(ep_blob_file *f);

#endif
