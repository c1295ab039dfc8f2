/* Internal error helpers: the first failure on a thread writes the message, later callers
 * up the stack just return the status (FT_TRY). */
#ifndef FT_CORE_STATUS_H
#define FT_CORE_STATUS_H
#include "fasttran.h"

#if defined(__GNUC__)
#define FT_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define FT_PRINTF(a, b)
#endif

/* Record `msg` for status `s` and return `s`. */
ft_status ft_error(ft_status s, const char *fmt, ...) FT_PRINTF(2, 3);
/* Same, appending strerror(errno). */
ft_status ft_error_errno(ft_status s, int err, const char *fmt, ...) FT_PRINTF(3, 4);

#define FT_TRY(expr) do { ft_status _st = (expr); if (_st != FT_OK) return _st; } while (0)

#endif
