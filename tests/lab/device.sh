#!/bin/sh
# One simulated device: runs as the first process of a fresh user+mount namespace (started by lab.py with
# `unshare --user --mount --propagation private`), sets up that namespace, then becomes sshd.
# Everything here is private to the namespace: the host's mounts and binfmt_misc registry are untouched.
# Inputs come from the environment (set by lab.py):
#   LAB_SSHD, LAB_CONFIG          sshd binary and its config
#   LAB_HOME                      bind-mounted over $HOME: each device has its own home
#   LAB_QEMU, LAB_QEMU_MAGIC      register qemu-aarch64 in the private binfmt_misc (arm64 devices)
#   LAB_ROOTFS, LAB_CHROOT_MNT    overlay of the shared read-only rootfs, mounted where sshd chroots
#   LAB_TMPFS_DIR, LAB_TMPFS_SIZE a small tmpfs (the "disk full" device)
set -eu

# lab.py writes our uid/gid maps from outside; wait (bounded: 5 s) until it has.
i=0
while [ -z "$(cat /proc/self/uid_map)" ]; do
    i=$((i + 1)); [ "$i" -le 500 ] || { echo "device.sh: uid_map never written" >&2; exit 97; }
    sleep 0.01
done

mount -t tmpfs -o mode=755,size=16m tmpfs /run
mkdir -p /run/sshd
chmod 755 /run/sshd

# A private binfmt_misc instance (kernel >= 6.7): empty unless this device emulates arm64, so an x86_64
# device refuses aarch64 executables even when the host registered qemu globally.
mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
if [ -n "${LAB_QEMU:-}" ]; then
    printf ':qemu-aarch64:M::%s:%s:F' "$LAB_QEMU_MAGIC" "$LAB_QEMU" > /proc/sys/fs/binfmt_misc/register
fi

if [ -n "${LAB_HOME:-}" ]; then
    mount --bind "$LAB_HOME" "$HOME"
fi

if [ -n "${LAB_TMPFS_DIR:-}" ]; then
    mkdir -p "$LAB_TMPFS_DIR"
    mount -t tmpfs -o "mode=755,size=$LAB_TMPFS_SIZE" tmpfs "$LAB_TMPFS_DIR"
fi

if [ -n "${LAB_ROOTFS:-}" ]; then
    # sshd's ChrootDirectory wants root-owned, non-group/world-writable components all the way down:
    # LAB_CHROOT_MNT sits in the root-owned cache folder; the overlay keeps the shared rootfs read-only.
    mount -t tmpfs -o mode=755,size=512m tmpfs "$LAB_CHROOT_MNT"
    mkdir -p "$LAB_CHROOT_MNT/upper" "$LAB_CHROOT_MNT/work" "$LAB_CHROOT_MNT/root"
    mount -t overlay overlay -o "lowerdir=$LAB_ROOTFS,upperdir=$LAB_CHROOT_MNT/upper,workdir=$LAB_CHROOT_MNT/work" \
        "$LAB_CHROOT_MNT/root"
    mount --rbind /dev "$LAB_CHROOT_MNT/root/dev"
    mount --rbind /sys "$LAB_CHROOT_MNT/root/sys"
    mount --rbind /proc "$LAB_CHROOT_MNT/root/proc"
    if [ -n "${LAB_CHROOT_TMPFS_DIR:-}" ]; then
        mkdir -p "$LAB_CHROOT_MNT/root$LAB_CHROOT_TMPFS_DIR"
        mount -t tmpfs -o "mode=755,size=$LAB_TMPFS_SIZE" tmpfs "$LAB_CHROOT_MNT/root$LAB_CHROOT_TMPFS_DIR"
    fi
fi

exec "$LAB_SSHD" -D -e -f "$LAB_CONFIG"
