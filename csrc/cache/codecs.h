/* The activation cache's codecs, declared once (C and CUDA both read this list):
 *   X(code, "name", NumPy storage, scaled, lossless, tag)
 * code: the ft_dtype stored; NumPy storage: the type string the Python layer stores values as
 * (float16 and bfloat16 as uint16); scaled: one float32 scale per row (int8); lossless: decoding
 * gives back the float32 row encoded (a recomputed row needs no round trip); tag: the name of the
 * codec's row coders -- ft_codec_<tag> in cache/codec.c (encode, decode, 16-value decode) and
 * codec_<tag> in cuda/cache.cu (the device decoder). Everything that lists codecs -- which codes
 * are codecs, the binding's CACHE_CODECS, the encoder and decoders, the device tier's kernel --
 * follows from this list: a new codec is one line here plus its row coders. */
#ifndef FT_CACHE_CODECS_H
#define FT_CACHE_CODECS_H

#define FT_CACHE_CODECS(X)                        \
    X(FT_F32, "float32", "<f4", 0, 1, f32)        \
    X(FT_F16, "float16", "<u2", 0, 0, f16)        \
    X(FT_BF16, "bfloat16", "<u2", 0, 0, bf16)     \
    X(FT_I8, "int8", "|i1", 1, 0, i8)

#endif
