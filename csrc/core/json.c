#include "json.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define JSON_MAX_DEPTH 64

typedef struct {
    const char *s;
    size_t n, i;
    char *err;
    size_t err_len;
    int failed;
} parser;

static void fail(parser *p, const char *fmt, ...) {
    if (p->failed) return;
    p->failed = 1;
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(p->err, p->err_len, "%s at byte %zu", msg, p->i);
}

static void skip_ws(parser *p) {
    while (p->i < p->n && (p->s[p->i] == ' ' || p->s[p->i] == '\t' || p->s[p->i] == '\n' ||
                           p->s[p->i] == '\r'))
        p->i++;
}

static void node_free(ft_json *v) {
    if (!v) return;
    free(v->str);
    free(v->key);
    for (size_t k = 0; k < v->n_items; k++) node_free(&v->items[k]);
    free(v->items);
}

static int hex4(parser *p, unsigned *out) {
    if (p->n - p->i < 4) { fail(p, "truncated \\u escape"); return 0; }
    unsigned v = 0;
    for (int k = 0; k < 4; k++) {
        char c = p->s[p->i++];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else { fail(p, "bad \\u escape"); return 0; }
    }
    *out = v;
    return 1;
}

/* Length of the valid UTF-8 sequence at s[0..avail) (RFC 3629: no overlongs, no surrogates,
 * nothing above U+10FFFF), or 0 if it is not one. */
static size_t utf8_len(const unsigned char *s, size_t avail) {
    unsigned char c = s[0];
    size_t n;
    unsigned char lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) n = 2;
    else if (c >= 0xe0 && c <= 0xef) { n = 3; if (c == 0xe0) lo = 0xa0; if (c == 0xed) hi = 0x9f; }
    else if (c >= 0xf0 && c <= 0xf4) { n = 4; if (c == 0xf0) lo = 0x90; if (c == 0xf4) hi = 0x8f; }
    else return 0;
    if (avail < n || s[1] < lo || s[1] > hi) return 0;
    for (size_t k = 2; k < n; k++)
        if (s[k] < 0x80 || s[k] > 0xbf) return 0;
    return n;
}

/* Parses a string starting at the opening quote; returns malloc'd decoded text (valid UTF-8,
 * no NUL: names and values are used as C strings). */
static char *parse_string(parser *p, size_t *out_len) {
    p->i++; /* opening quote */
    size_t cap = 16, len = 0;
    char *buf = malloc(cap);
    if (!buf) { fail(p, "out of memory"); return NULL; }
    for (;;) {
        if (p->i >= p->n) { fail(p, "unterminated string"); break; }
        unsigned char c = (unsigned char)p->s[p->i++];
        unsigned cp;
        if (c == '"') { buf[len] = '\0'; if (out_len) *out_len = len; return buf; }
        if (c < 0x20) { fail(p, "control character in string"); break; }
        if (len + 5 >= cap) {
            cap *= 2;
            char *nb = realloc(buf, cap);
            if (!nb) { fail(p, "out of memory"); break; }
            buf = nb;
        }
        if (c >= 0x80) {
            size_t u = utf8_len((const unsigned char *)p->s + p->i - 1, p->n - p->i + 1);
            if (!u) { p->i--; fail(p, "invalid UTF-8 in string"); break; }
            memcpy(buf + len, p->s + p->i - 1, u);
            len += u;
            p->i += u - 1;
            continue;
        }
        if (c != '\\') { buf[len++] = (char)c; continue; }
        if (p->i >= p->n) { fail(p, "unterminated escape"); break; }
        char e = p->s[p->i++];
        switch (e) {
        case '"': buf[len++] = '"'; continue;
        case '\\': buf[len++] = '\\'; continue;
        case '/': buf[len++] = '/'; continue;
        case 'b': buf[len++] = '\b'; continue;
        case 'f': buf[len++] = '\f'; continue;
        case 'n': buf[len++] = '\n'; continue;
        case 'r': buf[len++] = '\r'; continue;
        case 't': buf[len++] = '\t'; continue;
        case 'u':
            if (!hex4(p, &cp)) break;
            if (cp >= 0xd800 && cp < 0xdc00) {     /* surrogate pair */
                unsigned lo;
                if (p->n - p->i < 6 || p->s[p->i] != '\\' || p->s[p->i + 1] != 'u') {
                    fail(p, "lone surrogate"); break;
                }
                p->i += 2;
                if (!hex4(p, &lo)) break;
                if (lo < 0xdc00 || lo > 0xdfff) { fail(p, "bad surrogate pair"); break; }
                cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            } else if (cp >= 0xdc00 && cp <= 0xdfff) { fail(p, "lone surrogate"); break; }
            if (cp == 0) { fail(p, "NUL character (\\u0000) in string"); break; }
            if (cp < 0x80) buf[len++] = (char)cp;
            else if (cp < 0x800) { buf[len++] = (char)(0xc0 | (cp >> 6)); buf[len++] = (char)(0x80 | (cp & 0x3f)); }
            else if (cp < 0x10000) { buf[len++] = (char)(0xe0 | (cp >> 12)); buf[len++] = (char)(0x80 | ((cp >> 6) & 0x3f)); buf[len++] = (char)(0x80 | (cp & 0x3f)); }
            else { buf[len++] = (char)(0xf0 | (cp >> 18)); buf[len++] = (char)(0x80 | ((cp >> 12) & 0x3f)); buf[len++] = (char)(0x80 | ((cp >> 6) & 0x3f)); buf[len++] = (char)(0x80 | (cp & 0x3f)); }
            continue;
        default: fail(p, "bad escape '\\%c'", e); break;
        }
        break;
    }
    free(buf);
    return NULL;
}

static int parse_value(parser *p, ft_json *out, int depth);

static int push_item(parser *p, ft_json **items, size_t *n, size_t *cap, ft_json *v) {
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 8;
        ft_json *ni = realloc(*items, nc * sizeof **items);
        if (!ni) { fail(p, "out of memory"); return 0; }
        *items = ni;
        *cap = nc;
    }
    (*items)[(*n)++] = *v;
    return 1;
}

static int parse_container(parser *p, ft_json *out, int depth, int is_obj) {
    char close = is_obj ? '}' : ']';
    size_t cap = 0;
    out->type = is_obj ? FT_JSON_OBJECT : FT_JSON_ARRAY;
    p->i++;
    skip_ws(p);
    if (p->i < p->n && p->s[p->i] == close) { p->i++; return 1; }
    for (;;) {
        ft_json item;
        memset(&item, 0, sizeof item);
        char *key = NULL;
        skip_ws(p);
        if (is_obj) {
            if (p->i >= p->n || p->s[p->i] != '"') { fail(p, "expected a member name"); return 0; }
            key = parse_string(p, NULL);
            if (!key) return 0;
            skip_ws(p);
            if (p->i >= p->n || p->s[p->i] != ':') { free(key); fail(p, "expected ':'"); return 0; }
            p->i++;
        }
        if (!parse_value(p, &item, depth + 1)) { free(key); node_free(&item); return 0; }
        item.key = key;
        if (!push_item(p, &out->items, &out->n_items, &cap, &item)) { node_free(&item); return 0; }
        skip_ws(p);
        if (p->i >= p->n) { fail(p, "unterminated %s", is_obj ? "object" : "array"); return 0; }
        if (p->s[p->i] == ',') { p->i++; continue; }
        if (p->s[p->i] == close) { p->i++; return 1; }
        fail(p, "expected ',' or '%c'", close);
        return 0;
    }
}

static int parse_number(parser *p, ft_json *out) {
    size_t start = p->i;
    int is_int = 1;
    if (p->s[p->i] == '-') p->i++;
    if (p->i >= p->n || p->s[p->i] < '0' || p->s[p->i] > '9') { fail(p, "bad number"); return 0; }
    if (p->s[p->i] == '0') p->i++;
    else while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') p->i++;
    if (p->i < p->n && p->s[p->i] == '.') {
        is_int = 0;
        p->i++;
        if (p->i >= p->n || p->s[p->i] < '0' || p->s[p->i] > '9') { fail(p, "bad number"); return 0; }
        while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') p->i++;
    }
    if (p->i < p->n && (p->s[p->i] == 'e' || p->s[p->i] == 'E')) {
        is_int = 0;
        p->i++;
        if (p->i < p->n && (p->s[p->i] == '+' || p->s[p->i] == '-')) p->i++;
        if (p->i >= p->n || p->s[p->i] < '0' || p->s[p->i] > '9') { fail(p, "bad number"); return 0; }
        while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') p->i++;
    }
    char tmp[64];
    size_t len = p->i - start;
    if (len >= sizeof tmp) { fail(p, "number too long"); return 0; }
    memcpy(tmp, p->s + start, len);
    tmp[len] = '\0';
    if (is_int) {
        /* exact int64 parse with overflow detection */
        const char *c = tmp;
        int neg = *c == '-';
        if (neg) c++;
        uint64_t v = 0;
        for (; *c; c++) {
            uint64_t d = (uint64_t)(*c - '0');
            if (v > (UINT64_MAX - d) / 10) { fail(p, "integer overflows int64"); return 0; }
            v = v * 10 + d;
        }
        if ((!neg && v > (uint64_t)INT64_MAX) || (neg && v > (uint64_t)INT64_MAX + 1)) {
            fail(p, "integer overflows int64");
            return 0;
        }
        out->type = FT_JSON_INT;
        out->integer = neg ? (int64_t)(0 - v) : (int64_t)v;
    } else {
        out->type = FT_JSON_REAL;
        out->real = strtod(tmp, NULL);
    }
    return 1;
}

static int match_word(parser *p, const char *w) {
    size_t l = strlen(w);
    if (p->n - p->i >= l && memcmp(p->s + p->i, w, l) == 0) { p->i += l; return 1; }
    fail(p, "unexpected token");
    return 0;
}

static int parse_value(parser *p, ft_json *out, int depth) {
    if (depth > JSON_MAX_DEPTH) { fail(p, "nesting deeper than %d", JSON_MAX_DEPTH); return 0; }
    skip_ws(p);
    if (p->i >= p->n) { fail(p, "unexpected end of input"); return 0; }
    char c = p->s[p->i];
    switch (c) {
    case '{': return parse_container(p, out, depth, 1);
    case '[': return parse_container(p, out, depth, 0);
    case '"':
        out->type = FT_JSON_STRING;
        out->str = parse_string(p, &out->str_len);
        return out->str != NULL;
    case 't': out->type = FT_JSON_BOOL; out->integer = 1; return match_word(p, "true");
    case 'f': out->type = FT_JSON_BOOL; out->integer = 0; return match_word(p, "false");
    case 'n': out->type = FT_JSON_NULL; return match_word(p, "null");
    default:
        if (c == '-' || (c >= '0' && c <= '9')) return parse_number(p, out);
        fail(p, "unexpected character 0x%02x", (unsigned char)c);
        return 0;
    }
}

ft_json *ft_json_parse(const char *text, size_t len, char *err, size_t err_len) {
    parser p = {text, len, 0, err, err_len, 0};
    ft_json *root = calloc(1, sizeof *root);
    if (!root) { snprintf(err, err_len, "out of memory"); return NULL; }
    if (parse_value(&p, root, 0)) {
        skip_ws(&p);
        if (p.i == p.n) return root;
        fail(&p, "trailing data after the JSON value");
    }
    node_free(root);
    free(root);
    return NULL;
}

void ft_json_free(ft_json *root) {
    if (!root) return;
    node_free(root);
    free(root);
}

const ft_json *ft_json_get(const ft_json *obj, const char *key) {
    if (!obj || obj->type != FT_JSON_OBJECT) return NULL;
    for (size_t k = 0; k < obj->n_items; k++)
        if (obj->items[k].key && strcmp(obj->items[k].key, key) == 0) return &obj->items[k];
    return NULL;
}
