#include "status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define FT_ERRBUF 1024
static _Thread_local char ft_errbuf[FT_ERRBUF];
static _Thread_local int ft_errnum;   /* errno of the last ft_error_errno, 0 after ft_error */

const char *ft_status_name(ft_status s) {
    switch (s) {
    case FT_OK: return "ok";
    case FT_ERR_INVALID_ARGUMENT: return "invalid argument";
    case FT_ERR_DTYPE: return "wrong dtype";
    case FT_ERR_OUT_OF_RANGE: return "out of range";
    case FT_ERR_NOMEM: return "out of memory";
    case FT_ERR_IO: return "I/O error";
    case FT_ERR_NOT_FOUND: return "not found";
    case FT_ERR_FORMAT: return "bad file format";
    case FT_ERR_UNSUPPORTED: return "unsupported";
    case FT_ERR_DEVICE: return "device error";
    case FT_ERR_INTERRUPTED: return "interrupted";
    case FT_ERR_INTERNAL: return "internal error";
    }
    return "unknown status";
}

const char *ft_last_error(void) { return ft_errbuf; }
int ft_last_errno(void) { return ft_errnum; }
void ft_clear_error(void) { ft_errbuf[0] = '\0'; ft_errnum = 0; }

ft_status ft_error(ft_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ft_errbuf, FT_ERRBUF, fmt, ap);
    va_end(ap);
    ft_errnum = 0;
    return s;
}

ft_status ft_error_errno(ft_status s, int err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(ft_errbuf, FT_ERRBUF, fmt, ap);
    va_end(ap);
    if (n >= 0 && n < FT_ERRBUF)
        snprintf(ft_errbuf + n, (size_t)(FT_ERRBUF - n), ": %s", strerror(err));
    ft_errnum = err;
    return s;
}
