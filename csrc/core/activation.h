/* Activations and their derivatives in double precision, shared by the CPU and CUDA training ops
 * (one source, so both backends compute the same gradients), and the inverse of GELU on either side
 * of its minimum: Tempo's in-place GELU keeps only the output y = GELU(x) (which the next GEMM's
 * backward needs anyway) plus one bit per element saying whether x lay left of the minimum, and
 * recovers x in the backward pass. The recovery is exact to double precision except near the
 * minimum, where y carries little information about x (GELU' is ~0 there, so the gradient error
 * stays of the order of fp32 rounding of y). */
#ifndef FT_CORE_ACTIVATION_H
#define FT_CORE_ACTIVATION_H
#include <math.h>

#include "fasttran.h"

#if defined(__CUDACC__)
#define FT_AHD __host__ __device__ __forceinline__
#else
#define FT_AHD static inline
#endif

/* GELU's minimum (x, y) and its curvature there: erf form, then tanh form */
#define FT_GELU_ERF_XMIN (-0.7517915246935645)
#define FT_GELU_ERF_YMIN (-0.16997120747990369)
#define FT_GELU_ERF_CURV 0.4314939960892161
#define FT_GELU_TANH_XMIN (-0.7524614220710163)
#define FT_GELU_TANH_YMIN (-0.170040750571254)
#define FT_GELU_TANH_CURV 0.43040008779193784

FT_AHD double ft_act_value(double x, int act) {
    switch (act) {
    case FT_ACT_GELU_ERF: return 0.5 * x * (1.0 + erf(x * 0.70710678118654752440));
    case FT_ACT_GELU_TANH: return 0.5 * x * (1.0 + tanh(0.79788456080286535588 * (x + 0.044715 * x * x * x)));
    case FT_ACT_RELU: return x > 0.0 ? x : 0.0;
    default: return tanh(x);
    }
}

FT_AHD double ft_act_grad(double x, int act) {
    switch (act) {
    case FT_ACT_GELU_ERF:
        return 0.5 * (1.0 + erf(x * 0.70710678118654752440)) + x * exp(-0.5 * x * x) * 0.39894228040143267794;
    case FT_ACT_GELU_TANH: {
        const double u = 0.79788456080286535588 * (x + 0.044715 * x * x * x), t = tanh(u);
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.79788456080286535588 * (1.0 + 3.0 * 0.044715 * x * x);
    }
    case FT_ACT_RELU: return x > 0.0 ? 1.0 : 0.0;
    default: {
        const double t = tanh(x);
        return 1.0 - t * t;
    }
    }
}

/* Outputs closer than this to GELU's minimum value do not pin the input down in fp32 (GELU' ~ 0
 * there: an output rounded by 1e-8 moves the recovered input by up to 2e-4); the in-place GELU's
 * backward recomputes those inputs from the layer's GEMM instead (about 5% of the elements of a
 * BERT FFN). Beyond it the recovery is accurate to fp32 rounding. */
#define FT_GELU_BAND 1e-3

/* 1 when x lies left of GELU's minimum (the branch bit of the in-place GELU) */
FT_AHD int ft_gelu_left(double x, int act) {
    return x < (act == FT_ACT_GELU_TANH ? FT_GELU_TANH_XMIN : FT_GELU_ERF_XMIN);
}

/* 1 when an output y of the activation needs its input recomputed (see FT_GELU_BAND) */
FT_AHD int ft_gelu_flat(double y, int act) {
    return (act == FT_ACT_GELU_ERF || act == FT_ACT_GELU_TANH) &&
           y - (act == FT_ACT_GELU_TANH ? FT_GELU_TANH_YMIN : FT_GELU_ERF_YMIN) < FT_GELU_BAND;
}

/* The x with GELU(x) = y on the given side of the minimum: safeguarded Newton from the quadratic
 * approximation around the minimum, inside a bracket that always holds the root. */
FT_AHD double ft_gelu_invert(double y, int left, int act) {
    const double xmin = act == FT_ACT_GELU_TANH ? FT_GELU_TANH_XMIN : FT_GELU_ERF_XMIN;
    const double ymin = act == FT_ACT_GELU_TANH ? FT_GELU_TANH_YMIN : FT_GELU_ERF_YMIN;
    const double curv = act == FT_ACT_GELU_TANH ? FT_GELU_TANH_CURV : FT_GELU_ERF_CURV;
    if (y <= ymin) return xmin;                        /* the minimum (y rounded below it) */
    double lo, hi;
    if (left) {
        if (y >= 0.0) return -40.0;                    /* GELU underflowed: far left, GELU' ~ 0 */
        lo = -40.0;
        hi = xmin;
    } else {
        lo = xmin;
        hi = y > 0.0 ? y + 1.0 : 0.0;                  /* x >= GELU(x) >= x - 0.17 for x >= 0 */
    }
    const double d = sqrt(2.0 * (y - ymin) / curv);
    double x = left ? xmin - d : xmin + d;
    if (!left && y > x) x = y;                         /* GELU(x) <= x */
    if (x <= lo || x >= hi) x = 0.5 * (lo + hi);
    for (int it = 0; it < 100; it++) {
        const double f = ft_act_value(x, act) - y, g = ft_act_grad(x, act);
        if (f == 0.0) break;
        /* the root is where f changes sign: GELU rises right of the minimum, falls left of it */
        if ((f > 0.0) != (left != 0)) hi = x;
        else lo = x;
        double nx = g != 0.0 ? x - f / g : 0.5 * (lo + hi);
        if (!(nx > lo && nx < hi)) nx = 0.5 * (lo + hi);
        if (fabs(nx - x) <= 1e-15 * (1.0 + fabs(x)) || hi - lo <= 1e-15 * (1.0 + fabs(x))) {
            x = nx;
            break;
        }
        x = nx;
    }
    return x;
}
#endif
