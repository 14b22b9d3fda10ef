/* Loading the embedded ncnn weights in place, handing consumed pages back (issue 10 item 5).
 *
 * ncnn's C API takes a custom reader with read() only, so every weight would be copied; this C++
 * reader also answers reference(): ncnn then uses fp32 weights where they lie in the executable and
 * converts fp16 ones straight from there (no copy). ncnn loads and repacks one layer at a time and, in
 * light mode, drops the layer's unpacked weights, so the pages behind the reader are not needed: they
 * are handed back with MADV_DONTNEED, which keeps the embedded copy out of the peak RSS. Only pages of a read-only, file-backed mapping are handed back: anything that
 * touches one later (a layer that kept its weights by reference) gets it again from the executable,
 * so no weight can change. */
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ncnn/c_api.h"
#include "ncnn/datareader.h"
#include "ncnn/net.h"

namespace {

class ReleasingReader : public ncnn::DataReader {
public:
    ReleasingReader(const unsigned char *data, size_t n, bool may_release)
        : cur_(data), end_(data + n), page_((uintptr_t)sysconf(_SC_PAGESIZE)), may_release_(may_release) {
        released_ = ((uintptr_t)data + page_ - 1) & ~(page_ - 1);
    }

    size_t read(void *buf, size_t size) const override {
        size_t left = (size_t)(end_ - cur_);
        if (size > left) size = left;
        memcpy(buf, cur_, size);
        flag_ = 0;
        if (size == 4) memcpy(&flag_, buf, 4);  /* ModelBin reads an array's 4-byte type tag first */
        advance(size);
        return size;
    }

    /* Only fp16/bf16 arrays are lent: ncnn converts them into fresh fp32 buffers at once. Raw fp32 (and
     * int8) arrays would be kept by reference and touched at run time, bringing the embedded pages back
     * into the RSS; refusing makes ncnn read (copy) them instead. */
    size_t reference(size_t size, const void **buf) const override {
        uint32_t flag = flag_;
        flag_ = 0;
        if ((flag != 0x01306B47u && flag != 0x01348B83u) || size > (size_t)(end_ - cur_)) return 0;
        *buf = cur_;
        advance(size);
        return size;
    }

    size_t consumed(const unsigned char *data) const { return (size_t)(cur_ - data); }

private:
    /* Every array is in its own buffer by the time the reader moves on (copied by read(), converted
     * from fp16/bf16 by ModelBin right after reference()), so the pages behind the reader go back.
     * One madvise per MiB at most. */
    void advance(size_t size) const {
        cur_ += size;
        uintptr_t upto = (uintptr_t)cur_ & ~(page_ - 1);
        if (!may_release_ || upto < released_ + ((uintptr_t)1 << 20)) return;
        madvise((void *)released_, upto - released_, MADV_DONTNEED);
        released_ = upto;
    }

    mutable const unsigned char *cur_;
    mutable uint32_t flag_ = 0;
    const unsigned char *end_;
    uintptr_t page_;
    mutable uintptr_t released_;
    bool may_release_;
};

}  // namespace

/* Loads the weights at data[0, n) into net; returns the bytes consumed, or (size_t)-1 when ncnn
 * refused them. may_release: the bytes lie in a read-only file-backed mapping (see the engine). */
extern "C" size_t ep_ncnn_load_weights(ncnn_net_t net, const unsigned char *data, size_t n, int may_release) {
    ReleasingReader reader(data, n, may_release != 0);
    int rc = ((ncnn::Net *)net->pthis)->load_model(reader);
    return rc == 0 ? reader.consumed(data) : (size_t)-1;
}
