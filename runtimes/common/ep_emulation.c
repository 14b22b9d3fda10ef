/* Is this process running under qemu-user (binfmt or explicit)? Benchmarks taken there are the
 * emulator's speed, not the device's, and `bench` says so.
 *
 * qemu-user passes the host kernel's /proc/cpuinfo through while it emulates the CPU itself:
 *  - an Arm artifact then reads an x86 host's cpuinfo ("vendor_id", "flags"), which no Arm kernel writes;
 *  - an x86_64 artifact under qemu-x86_64 -cpu MODEL sees CPUID describe MODEL while cpuinfo, which
 *    the kernel fills from the real CPUID, names the host's CPU: a mismatch of the brand strings.
 * A false "native" is possible (qemu -cpu host on a same-model host); a false "emulated" is not
 * expected on real kernels, where both come from the same CPUID. */
#include "ep_runtime.h"
#include <ctype.h>
#include <stdio.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

/* The value of the first "key<ws>: value" line of /proc/cpuinfo, trimmed; 0 when absent. */
static int cpuinfo_value(const char *key, char *out, size_t n) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return 0;
    char line[512];
    size_t klen = strlen(key);
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) {
        if (strncmp(line, key, klen) != 0) continue;
        const char *p = line + klen;
        while (*p == ' ' || *p == '\t') p++;
        if (*p != ':') continue;
        p++;
        while (*p == ' ' || *p == '\t') p++;
        snprintf(out, n, "%s", p);
        size_t len = strlen(out);
        while (len && isspace((unsigned char)out[len - 1])) out[--len] = 0;
        found = 1;
    }
    fclose(f);
    return found;
}

#if defined(__x86_64__) || defined(__i386__)
static void cpuid_brand(char *out, size_t n) {
    unsigned r[12] = {0};
    unsigned max = __get_cpuid_max(0x80000000u, NULL);
    out[0] = 0;
    if (max < 0x80000004u) return;
    for (unsigned i = 0; i < 3; i++) __get_cpuid(0x80000002u + i, &r[4 * i], &r[4 * i + 1], &r[4 * i + 2], &r[4 * i + 3]);
    char brand[49];
    memcpy(brand, r, 48);
    brand[48] = 0;
    const char *p = brand;
    while (*p == ' ') p++;
    snprintf(out, n, "%s", p);
    size_t len = strlen(out);
    while (len && isspace((unsigned char)out[len - 1])) out[--len] = 0;
}
#endif

int ep_emulated(char *why, size_t n) {
    char v[256];
    why[0] = 0;
#if defined(__aarch64__) || defined(__arm__)
    if (cpuinfo_value("vendor_id", v, sizeof v) || cpuinfo_value("flags", v, sizeof v)) {
        snprintf(why, n, "an Arm executable reading an x86 host's /proc/cpuinfo (qemu-user)");
        return 1;
    }
#elif defined(__x86_64__) || defined(__i386__)
    char brand[64];
    cpuid_brand(brand, sizeof brand);
    if (brand[0] && cpuinfo_value("model name", v, sizeof v) && strcmp(brand, v) != 0) {
        snprintf(why, n, "CPUID names \"%s\" but the kernel's /proc/cpuinfo \"%s\" (qemu-user -cpu)", brand, v);
        return 1;
    }
#endif
    return 0;
}
