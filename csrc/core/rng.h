/* Counter-based random numbers for dropout: the keep/drop decision of element i is a pure
 * function of (key, i), so the backward pass recomputes the mask instead of storing it (Tempo's
 * dropout recomputation), the CPU and CUDA backends draw the same masks, and a run is
 * reproducible whatever the thread count. splitmix64's finaliser is a strong enough mixer for
 * this (it passes BigCrush as a counter-mode generator). */
#ifndef FT_CORE_RNG_H
#define FT_CORE_RNG_H
#include <stdint.h>

#if defined(__CUDACC__)
#define FT_HD __host__ __device__ __forceinline__
#else
#define FT_HD static inline
#endif

FT_HD uint64_t ft_mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The key of one dropout site in one step: different seeds, steps and sites give unrelated
 * streams. */
FT_HD uint64_t ft_dropout_key(uint64_t seed, uint64_t step, uint64_t site) {
    return ft_mix64(ft_mix64(seed ^ 0x5851F42D4C957F2Dull) ^ ft_mix64(step * 0x2545F4914F6CDD1Dull + site));
}

/* Keep element i with probability 1 - p: threshold = p * 2^32 (ft_dropout_threshold). */
FT_HD int ft_dropout_keep(uint64_t key, uint64_t i, uint32_t threshold) {
    return (uint32_t)(ft_mix64(key + i) >> 32) >= threshold;
}

FT_HD uint32_t ft_dropout_threshold(float p) {
    double t = (double)p * 4294967296.0;
    return t >= 4294967295.0 ? 0xFFFFFFFFu : (uint32_t)t;
}
#endif
