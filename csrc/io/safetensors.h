/* safetensors: a little-endian u64 header length N, N bytes of JSON describing every tensor
 * (dtype, shape, [begin, end) byte offsets into the data section), then the data section.
 * The file is untrusted: every size, offset and name is checked before a byte is used. */
#ifndef FT_IO_SAFETENSORS_H
#define FT_IO_SAFETENSORS_H
#include "fasttran.h"

#define FT_ST_MAX_HEADER (100u * 1024u * 1024u)   /* the reference implementation's limit */

typedef struct {
    char *name;
    char dtype_name[16];   /* as written in the file ("F32", "I64", ...) */
    int dtype;             /* ft_dtype, or -1 for a dtype we can bounds-check but not convert */
    int ndim;
    int64_t shape[8];
    uint64_t begin, end;   /* offsets into the data section */
} ft_st_entry;

typedef struct {
    const char *path;
    void *map;             /* whole file, read-only mapping */
    size_t file_size;
    const uint8_t *data;   /* start of the data section */
    size_t data_size;
    ft_st_entry *entries;
    size_t n_entries;
} ft_st_file;

ft_status ft_st_open(const char *path, ft_st_file *out);
/* Same, first checking the file's size and CRC-32C against values recorded by its writer
 * (-1: not checked), so a damaged file is refused before its header is read. */
ft_status ft_st_open_expect(const char *path, int64_t expect_bytes, int64_t expect_crc, ft_st_file *out);
void ft_st_close(ft_st_file *f);
const ft_st_entry *ft_st_find(const ft_st_file *f, const char *name);

#endif
