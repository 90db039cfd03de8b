/* Preload library for 32-bit ARM Debian trixie boards (armhf).
 *
 * Debian trixie builds armhf for a 64-bit time_t, but its python3-grpcio
 * (1.51.1) still reads the clock with
 *     syscall(SYS_clock_gettime, clock, &ts)
 * SYS_clock_gettime (263 on 32-bit ARM) is the old system call that writes a
 * timespec with 32-bit seconds and nanoseconds; the 64-bit timespec grpc
 * passes gets its nanoseconds filled with whatever was on the stack, and grpc
 * core aborts as it starts ("time_posix.cc: assertion failed: ts.tv_nsec >= 0
 * && ts.tv_nsec < 1e9"). Newer grpc releases call clock_gettime() instead.
 *
 * This library replaces syscall(): number 263 goes to the C library's
 * clock_gettime(), which fills the caller's 64-bit timespec correctly; every
 * other number is passed unchanged to the C library's own syscall().
 *
 * Build on the board:   cc -shared -fPIC -O2 -o grpc_time64_fix.so grpc_time64_fix.c -ldl
 * Use:                  LD_PRELOAD=/path/to/grpc_time64_fix.so python3 ...
 */
#define _GNU_SOURCE
/* The caller's timespec has 64-bit seconds: use the 64-bit time interfaces
 * whatever the compiler's default is. */
#define _FILE_OFFSET_BITS 64
#define _TIME_BITS 64

#include <dlfcn.h>
#include <stdarg.h>
#include <time.h>

#if !defined(__arm__)
#error "only 32-bit ARM (armhf) needs this library"
#endif

/* The 32-bit-time clock_gettime system call number on 32-bit ARM. */
#define ARM_NR_CLOCK_GETTIME32 263

typedef long (*syscall_fn)(long, ...);

long syscall(long number, ...)
{
    static syscall_fn next;
    long arg[6];
    va_list ap;
    int i;

    /* syscall() takes up to six word-sized arguments after the number; read
     * them all, as the C library's own syscall() passes all six registers. */
    va_start(ap, number);
    for (i = 0; i < 6; i++)
        arg[i] = va_arg(ap, long);
    va_end(ap);

    if (number == ARM_NR_CLOCK_GETTIME32)
        return clock_gettime((clockid_t)arg[0], (struct timespec *)arg[1]);

    if (!next)
        next = (syscall_fn)dlsym(RTLD_NEXT, "syscall");
    return next(number, arg[0], arg[1], arg[2], arg[3], arg[4], arg[5]);
}
