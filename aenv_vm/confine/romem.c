/*
 * LD_PRELOAD shim for a QEMU mapping a template's RAM copy-on-write
 * (aenv_vm/confine/romem.py).
 *
 * QEMU 7.2 opens a memory-backend-file O_RDWR even with share=off, where the
 * mapping is MAP_PRIVATE and the kernel needs only read access to the file.
 * A confined QEMU must not be able to write the template memory file every
 * clone of the template maps, so for the one path named by AENV_READONLY_RAM
 * this turns that open into O_RDONLY: the mapping stays writable copy-on-write,
 * a write(2) on the file fails (EBADF). QEMU 8.2's "readonly=on,rom=off" does
 * the same natively, but then also refuses to discard the RAM (free page
 * reporting); QEMU does not know of this one, and its hole punch never reaches
 * the file (a seccomp filter answers it: aenv_vm/confine/discard.py).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

static const char *ro_path;

__attribute__((constructor)) static void aenv_romem_init(void)
{
    ro_path = getenv("AENV_READONLY_RAM");
}

static int fix_flags(const char *path, int flags)
{
    if (ro_path && path && (flags & O_ACCMODE) == O_RDWR && !(flags & (O_CREAT | O_TRUNC))
        && strcmp(path, ro_path) == 0)
        return (flags & ~O_ACCMODE) | O_RDONLY;
    return flags;
}

#define NEEDS_MODE(f) (((f) & O_CREAT) || (((f) & O_TMPFILE) == O_TMPFILE))

typedef int (*open_fn)(const char *, int, ...);
typedef int (*openat_fn)(int, const char *, int, ...);
typedef int (*open2_fn)(const char *, int);
typedef int (*openat2_fn)(int, const char *, int);

/* the optional third argument of open(2): only there with O_CREAT or O_TMPFILE */
#define MODE_ARG(flags, mode)                                                  \
    mode_t mode = 0;                                                           \
    if (NEEDS_MODE(flags)) {                                                   \
        va_list ap;                                                            \
        va_start(ap, flags);                                                   \
        mode = va_arg(ap, mode_t);                                             \
        va_end(ap);                                                            \
    }

#define DEFINE_OPEN(name)                                                      \
    int name(const char *path, int flags, ...)                                 \
    {                                                                          \
        static open_fn real;                                                   \
        MODE_ARG(flags, mode)                                                  \
        if (!real)                                                             \
            real = (open_fn)dlsym(RTLD_NEXT, #name);                           \
        return real(path, fix_flags(path, flags), mode);                       \
    }

#define DEFINE_OPENAT(name)                                                    \
    int name(int dirfd, const char *path, int flags, ...)                      \
    {                                                                          \
        static openat_fn real;                                                 \
        MODE_ARG(flags, mode)                                                  \
        if (!real)                                                             \
            real = (openat_fn)dlsym(RTLD_NEXT, #name);                         \
        return real(dirfd, path, fix_flags(path, flags), mode);                \
    }

/* _FORTIFY_SOURCE builds call these when the flags are not a constant */
#define DEFINE_OPEN_2(name)                                                    \
    int name(const char *path, int flags)                                      \
    {                                                                          \
        static open2_fn real;                                                  \
        if (!real)                                                             \
            real = (open2_fn)dlsym(RTLD_NEXT, #name);                          \
        return real(path, fix_flags(path, flags));                             \
    }

#define DEFINE_OPENAT_2(name)                                                  \
    int name(int dirfd, const char *path, int flags)                           \
    {                                                                          \
        static openat2_fn real;                                                \
        if (!real)                                                             \
            real = (openat2_fn)dlsym(RTLD_NEXT, #name);                        \
        return real(dirfd, path, fix_flags(path, flags));                      \
    }

DEFINE_OPEN(open)
DEFINE_OPEN(open64)
DEFINE_OPENAT(openat)
DEFINE_OPENAT(openat64)
DEFINE_OPEN_2(__open_2)
DEFINE_OPEN_2(__open64_2)
DEFINE_OPENAT_2(__openat_2)
DEFINE_OPENAT_2(__openat64_2)
