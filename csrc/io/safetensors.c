#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/dtype.h"
#include "core/json.h"
#include "core/status.h"

static const struct { const char *name; int dtype; size_t size; } st_dtypes[] = {
    {"F32", FT_F32, 4}, {"F16", FT_F16, 2}, {"BF16", FT_BF16, 2}, {"F64", FT_F64, 8},
    {"I64", FT_I64, 8}, {"I32", FT_I32, 4}, {"I16", FT_I16, 2}, {"I8", FT_I8, 1},
    {"U8", FT_U8, 1},   {"BOOL", FT_BOOL, 1}, {"U16", -1, 2}, {"U32", -1, 4},
    {"U64", -1, 8},     {"F8_E4M3", -1, 1}, {"F8_E5M2", -1, 1},
};

static const char *st_dtype_string(ft_dtype dt) {
    for (size_t k = 0; k < sizeof st_dtypes / sizeof *st_dtypes; k++)
        if (st_dtypes[k].dtype == (int)dt) return st_dtypes[k].name;
    return NULL;
}

void ft_st_close(ft_st_file *f) {
    if (!f) return;
    for (size_t k = 0; k < f->n_entries; k++) free(f->entries[k].name);
    free(f->entries);
    if (f->map) munmap(f->map, f->file_size);
    memset(f, 0, sizeof *f);
}

const ft_st_entry *ft_st_find(const ft_st_file *f, const char *name) {
    for (size_t k = 0; k < f->n_entries; k++)
        if (strcmp(f->entries[k].name, name) == 0) return &f->entries[k];
    return NULL;
}

static int cmp_begin(const void *a, const void *b) {
    const ft_st_entry *x = *(const ft_st_entry *const *)a, *y = *(const ft_st_entry *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : (x->end > y->end);
}

/* Fill one entry from its JSON description; every field is checked. */
static ft_status parse_entry(const char *path, const ft_json *v, size_t data_size,
                             ft_st_entry *e) {
    const char *nm = v->key;
    if (v->type != FT_JSON_OBJECT)
        return ft_error(FT_ERR_FORMAT, "%s: tensor '%s' is not described by a JSON object", path, nm);
    const ft_json *dt = ft_json_get(v, "dtype"), *sh = ft_json_get(v, "shape"),
                  *off = ft_json_get(v, "data_offsets");
    if (!dt || dt->type != FT_JSON_STRING)
        return ft_error(FT_ERR_FORMAT, "%s: tensor '%s' has no string 'dtype'", path, nm);
    if (!sh || sh->type != FT_JSON_ARRAY)
        return ft_error(FT_ERR_FORMAT, "%s: tensor '%s' has no 'shape' array", path, nm);
    if (!off || off->type != FT_JSON_ARRAY || off->n_items != 2 ||
        off->items[0].type != FT_JSON_INT || off->items[1].type != FT_JSON_INT)
        return ft_error(FT_ERR_FORMAT, "%s: tensor '%s' needs 'data_offsets' [begin, end] of integers", path, nm);
    size_t esize = 0;
    e->dtype = -2;
    for (size_t k = 0; k < sizeof st_dtypes / sizeof *st_dtypes; k++)
        if (strcmp(dt->str, st_dtypes[k].name) == 0) { e->dtype = st_dtypes[k].dtype; esize = st_dtypes[k].size; }
    if (e->dtype == -2)
        return ft_error(FT_ERR_FORMAT, "%s: tensor '%s' has unknown dtype '%.15s'", path, nm, dt->str);
    snprintf(e->dtype_name, sizeof e->dtype_name, "%s", dt->str);
    if (sh->n_items > 8)
        return ft_error(FT_ERR_FORMAT, "%s: tensor '%s' has %zu dimensions (at most 8)", path, nm, sh->n_items);
    e->ndim = (int)sh->n_items;
    uint64_t numel = 1;
    for (size_t k = 0; k < sh->n_items; k++) {
        const ft_json *d = &sh->items[k];
        if (d->type != FT_JSON_INT || d->integer < 0)
            return ft_error(FT_ERR_FORMAT, "%s: tensor '%s' shape[%zu] is not a non-negative integer", path, nm, k);
        e->shape[k] = d->integer;
        if (d->integer != 0 && numel > UINT64_MAX / (uint64_t)d->integer)
            return ft_error(FT_ERR_FORMAT, "%s: tensor '%s' shape overflows", path, nm);
        numel *= (uint64_t)d->integer;
    }
    int64_t b = off->items[0].integer, en = off->items[1].integer;
    if (b < 0 || en < b)
        return ft_error(FT_ERR_FORMAT, "%s: tensor '%s' has data_offsets [%lld, %lld] (need 0 <= begin <= end)",
                        path, nm, (long long)b, (long long)en);
    if ((uint64_t)en > data_size)
        return ft_error(FT_ERR_FORMAT, "%s: tensor '%s' ends at byte %lld of the data section, which has only %zu bytes (truncated file or lying header)",
                        path, nm, (long long)en, data_size);
    if (numel > UINT64_MAX / esize || (uint64_t)(en - b) != numel * esize)
        return ft_error(FT_ERR_FORMAT, "%s: tensor '%s' spans %lld bytes but dtype %s and its shape need %llu",
                        path, nm, (long long)(en - b), dt->str, (unsigned long long)(numel * esize));
    e->begin = (uint64_t)b;
    e->end = (uint64_t)en;
    return FT_OK;
}

static ft_status parse_header(ft_st_file *f, const char *hdr, size_t len) {
    char err[256];
    if (len == 0 || hdr[0] != '{')
        return ft_error(FT_ERR_FORMAT, "%s: the header is not a JSON object (first byte 0x%02x)", f->path,
                        len ? (unsigned char)hdr[0] : 0);
    ft_json *root = ft_json_parse(hdr, len, err, sizeof err);
    if (!root) return ft_error(FT_ERR_FORMAT, "%s: header is not valid JSON: %s", f->path, err);
    ft_status st = FT_OK;
    f->entries = calloc(root->n_items ? root->n_items : 1, sizeof *f->entries);
    if (!f->entries) { ft_json_free(root); return ft_error(FT_ERR_NOMEM, "out of memory reading %s", f->path); }
    for (size_t k = 0; k < root->n_items && st == FT_OK; k++) {
        const ft_json *v = &root->items[k];
        if (strcmp(v->key, "__metadata__") == 0) {
            if (v->type != FT_JSON_OBJECT) st = ft_error(FT_ERR_FORMAT, "%s: __metadata__ is not an object", f->path);
            for (size_t j = 0; st == FT_OK && j < v->n_items; j++)
                if (v->items[j].type != FT_JSON_STRING)
                    st = ft_error(FT_ERR_FORMAT, "%s: __metadata__ value '%s' is not a string", f->path, v->items[j].key);
            continue;
        }
        for (size_t j = 0; j < f->n_entries; j++)
            if (strcmp(f->entries[j].name, v->key) == 0) {
                st = ft_error(FT_ERR_FORMAT, "%s: tensor '%s' appears twice in the header", f->path, v->key);
                break;
            }
        if (st != FT_OK) break;
        ft_st_entry *e = &f->entries[f->n_entries];
        st = parse_entry(f->path, v, f->data_size, e);
        if (st != FT_OK) break;
        e->name = strdup(v->key);
        if (!e->name) { st = ft_error(FT_ERR_NOMEM, "out of memory"); break; }
        f->n_entries++;
    }
    ft_json_free(root);
    if (st != FT_OK) return st;

    /* No two tensors may share bytes, and (as the format requires) the data section must be
     * covered exactly: a hole or trailing bytes mean the header and the data disagree. */
    const ft_st_entry **order = malloc((f->n_entries ? f->n_entries : 1) * sizeof *order);
    if (!order) return ft_error(FT_ERR_NOMEM, "out of memory");
    for (size_t k = 0; k < f->n_entries; k++) order[k] = &f->entries[k];
    qsort(order, f->n_entries, sizeof *order, cmp_begin);
    uint64_t pos = 0;
    for (size_t k = 0; k < f->n_entries && st == FT_OK; k++) {
        if (order[k]->begin < pos)
            st = ft_error(FT_ERR_FORMAT, "%s: tensors '%s' and '%s' overlap (bytes %llu..%llu)", f->path,
                          order[k - 1]->name, order[k]->name, (unsigned long long)order[k]->begin,
                          (unsigned long long)pos);
        else if (order[k]->begin > pos)
            st = ft_error(FT_ERR_FORMAT, "%s: bytes %llu..%llu of the data section belong to no tensor", f->path,
                          (unsigned long long)pos, (unsigned long long)order[k]->begin);
        pos = order[k]->end > pos ? order[k]->end : pos;
    }
    free(order);
    if (st == FT_OK && pos != f->data_size)
        st = ft_error(FT_ERR_FORMAT, "%s: the data section has %zu bytes but the header describes %llu", f->path,
                      f->data_size, (unsigned long long)pos);
    return st;
}

ft_status ft_st_open(const char *path, ft_st_file *out) { return ft_st_open_expect(path, -1, -1, out); }

ft_status ft_st_open_expect(const char *path, int64_t expect_bytes, int64_t expect_crc, ft_st_file *out) {
    memset(out, 0, sizeof *out);
    out->path = path;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return ft_error_errno(errno == ENOENT ? FT_ERR_NOT_FOUND : FT_ERR_IO, errno, "cannot open '%s'", path);
    struct stat sb;
    if (fstat(fd, &sb) != 0) { int e = errno; close(fd); return ft_error_errno(FT_ERR_IO, e, "cannot stat '%s'", path); }
    if (!S_ISREG(sb.st_mode)) { close(fd); return ft_error(FT_ERR_IO, "'%s' is not a regular file", path); }
    size_t size = (size_t)sb.st_size;
    if (expect_bytes >= 0 && (uint64_t)sb.st_size != (uint64_t)expect_bytes) {
        close(fd);
        return ft_error(FT_ERR_FORMAT, "%s is truncated or altered: %lld bytes, expected %lld", path,
                        (long long)sb.st_size, (long long)expect_bytes);
    }
    if (size < 8) {
        close(fd);
        return ft_error(FT_ERR_FORMAT, "%s: file is %zu bytes, too short for a safetensors header (truncated?)", path, size);
    }
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) return ft_error_errno(FT_ERR_IO, e, "cannot map '%s'", path);
    out->map = map;
    out->file_size = size;
    const uint8_t *p = map;
    if (expect_crc >= 0 && ft_crc32c(0, p, size) != (uint32_t)expect_crc) {
        ft_st_close(out);
        return ft_error(FT_ERR_FORMAT, "%s is corrupt: its CRC-32C does not match the one recorded when it was written", path);
    }
    uint64_t n = 0;
    for (int k = 7; k >= 0; k--) n = (n << 8) | p[k];   /* little-endian u64 */
    ft_status st = FT_OK;
    if (n > FT_ST_MAX_HEADER)
        st = ft_error(FT_ERR_FORMAT, "%s: header length %llu is absurd (limit %u bytes): not a safetensors file?",
                      path, (unsigned long long)n, FT_ST_MAX_HEADER);
    else if (n > size - 8)
        st = ft_error(FT_ERR_FORMAT, "%s: header length %llu runs past the end of the %zu-byte file (truncated?)",
                      path, (unsigned long long)n, size);
    if (st == FT_OK) {
        out->data = p + 8 + n;
        out->data_size = size - 8 - (size_t)n;
        st = parse_header(out, (const char *)p + 8, (size_t)n);
    }
    if (st != FT_OK) ft_st_close(out);
    return st;
}

/* ---- writer ---------------------------------------------------------------------------- */

typedef struct { char *s; size_t len, cap; int oom; } strbuf;

static void sb_put(strbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t nc = (b->cap ? b->cap * 2 : 4096);
        while (nc < b->len + n + 1) nc *= 2;
        char *ns = realloc(b->s, nc);
        if (!ns) { b->oom = 1; return; }
        b->s = ns;
        b->cap = nc;
    }
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = '\0';
}
static void sb_str(strbuf *b, const char *s) { sb_put(b, s, strlen(s)); }
static void sb_json_string(strbuf *b, const char *s) {
    sb_put(b, "\"", 1);
    for (; *s; s++) {
        char esc[8];
        if (*s == '"' || *s == '\\') { esc[0] = '\\'; esc[1] = *s; sb_put(b, esc, 2); }
        else if ((unsigned char)*s < 0x20) { snprintf(esc, sizeof esc, "\\u%04x", (unsigned char)*s); sb_str(b, esc); }
        else sb_put(b, s, 1);
    }
    sb_put(b, "\"", 1);
}

ft_status ft_safetensors_write(const char *path, const ft_st_tensor *tensors, size_t n, const ft_st_meta *meta,
                               size_t n_meta, uint64_t *bytes_out, uint32_t *crc_out) {
    strbuf h = {0};
    uint64_t off = 0;
    for (size_t k = 0; k < n; k++)
        for (size_t j = 0; j < k; j++)
            if (strcmp(tensors[j].name, tensors[k].name) == 0)
                return ft_error(FT_ERR_INVALID_ARGUMENT, "tensor name '%s' appears twice", tensors[k].name);
    sb_str(&h, "{");
    if (n_meta) {
        sb_str(&h, "\"__metadata__\":{");
        for (size_t k = 0; k < n_meta; k++) {
            if (k) sb_str(&h, ",");
            sb_json_string(&h, meta[k].key);
            sb_str(&h, ":");
            sb_json_string(&h, meta[k].value);
        }
        sb_str(&h, "}");
    }
    uint64_t *sizes = calloc(n ? n : 1, sizeof *sizes);
    if (!sizes) { free(h.s); return ft_error(FT_ERR_NOMEM, "out of memory"); }
    for (size_t k = 0; k < n; k++) {
        const ft_st_tensor *t = &tensors[k];
        const char *dn = st_dtype_string(t->dtype);
        if (!dn || t->ndim < 0 || t->ndim > 8) {
            free(h.s);
            free(sizes);
            return ft_error(FT_ERR_INVALID_ARGUMENT, "tensor '%s': bad dtype or rank", t->name);
        }
        uint64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) {
            if (t->shape[d] < 0 || (t->shape[d] && numel > UINT64_MAX / 16 / (uint64_t)t->shape[d])) {
                free(h.s);
                free(sizes);
                return ft_error(FT_ERR_INVALID_ARGUMENT, "tensor '%s': bad shape", t->name);
            }
            numel *= (uint64_t)t->shape[d];
        }
        uint64_t bytes = sizes[k] = numel * ft_dtype_size(t->dtype);
        char num[96];
        if (k > 0 || n_meta) sb_str(&h, ",");
        sb_json_string(&h, t->name);
        sb_str(&h, ":{\"dtype\":\"");
        sb_str(&h, dn);
        sb_str(&h, "\",\"shape\":[");
        for (int d = 0; d < t->ndim; d++) {
            snprintf(num, sizeof num, "%s%lld", d ? "," : "", (long long)t->shape[d]);
            sb_str(&h, num);
        }
        snprintf(num, sizeof num, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                 (unsigned long long)(off + bytes));
        sb_str(&h, num);
        off += bytes;
    }
    sb_str(&h, "}");
    while (!h.oom && (h.len % 8) != 0) sb_str(&h, " ");   /* align the data section to 8 bytes */
    ft_chunk *chunks = h.oom ? NULL : malloc((n + 2) * sizeof *chunks);
    if (!chunks) { free(h.s); free(sizes); return ft_error(FT_ERR_NOMEM, "out of memory writing %s", path); }
    uint8_t len8[8];
    for (int k = 0; k < 8; k++) len8[k] = (uint8_t)((uint64_t)h.len >> (8 * k));
    chunks[0] = (ft_chunk){len8, 8};
    chunks[1] = (ft_chunk){h.s, h.len};
    for (size_t k = 0; k < n; k++) chunks[k + 2] = (ft_chunk){tensors[k].data, (size_t)sizes[k]};
    ft_status st = ft_atomic_write(path, chunks, n + 2, bytes_out, crc_out);
    free(chunks);
    free(sizes);
    free(h.s);
    return st;
}
