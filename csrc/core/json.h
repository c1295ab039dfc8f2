/* A small strict JSON reader (RFC 8259) for safetensors headers: untrusted input, so it
 * bounds every read, limits nesting depth and reports the byte offset of the first error. */
#ifndef FT_CORE_JSON_H
#define FT_CORE_JSON_H
#include <stddef.h>
#include <stdint.h>

typedef enum { FT_JSON_NULL, FT_JSON_BOOL, FT_JSON_INT, FT_JSON_REAL, FT_JSON_STRING,
               FT_JSON_ARRAY, FT_JSON_OBJECT } ft_json_type;

typedef struct ft_json {
    ft_json_type type;
    int64_t integer;          /* FT_JSON_INT, FT_JSON_BOOL */
    double real;              /* FT_JSON_REAL */
    char *str;                /* FT_JSON_STRING: decoded UTF-8, NUL-terminated */
    size_t str_len;
    char *key;                /* member name when inside an object */
    struct ft_json *items;    /* FT_JSON_ARRAY / FT_JSON_OBJECT */
    size_t n_items;
} ft_json;

/* Parse `len` bytes. On failure returns NULL and writes a message into err. */
ft_json *ft_json_parse(const char *text, size_t len, char *err, size_t err_len);
void ft_json_free(ft_json *root);
const ft_json *ft_json_get(const ft_json *obj, const char *key);

#endif
