/* Activations and their derivatives in double precision, shared by the CPU and CUDA training ops
 * (one source, so both backends compute the same gradients), and the inverse of GELU on either side
 * of its minimum in float32: Tempo's in-place GELU keeps only the output y = GELU(x) (which the next
 * GEMM's backward needs anyway) plus one bit per element saying whether x lay left of the minimum,
 * and recovers x in the backward pass (ft_gelu_invertf: within 3.5 ulps of the float64 root). Near
 * the minimum y carries little information about x (GELU' is ~0 there): those inputs are recomputed
 * from the GEMM instead (FT_GELU_BAND). */
#ifndef FT_CORE_ACTIVATION_H
#define FT_CORE_ACTIVATION_H
#include <math.h>

#include "fasttran.h"

#if defined(__CUDACC__)
#define FT_AHD __host__ __device__ __forceinline__
#else
#define FT_AHD static inline
#endif

/* GELU's minimum x: erf form, then tanh form (its value: FT_GELU_*_YMIN_HI + _LO below) */
#define FT_GELU_ERF_XMIN (-0.7517915246935645)
#define FT_GELU_TANH_XMIN (-0.7524614220710163)

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
 * BERT FFN). Beyond it the recovery is accurate to fp32 rounding. The limit is y's own rounding,
 * not the inverse's: measured over float32 inputs near the minimum, GELU'(recovered x) - GELU'(x)
 * reaches 1.2e-7 for y - ymin in [1e-3, 1e-2), 3.5e-7 in [1e-4, 1e-3), 1.1e-6 in [1e-5, 1e-4),
 * the same with the float32 inverse as with a float64 one -- so the band stays where it was. */
#define FT_GELU_BAND 1e-3f

/* 1 when x lies left of GELU's minimum (the branch bit of the in-place GELU) */
FT_AHD int ft_gelu_left(double x, int act) {
    return x < (act == FT_ACT_GELU_TANH ? FT_GELU_TANH_XMIN : FT_GELU_ERF_XMIN);
}

/* GELU's minimum value as float32 hi + lo (tools/gelu_inverse_fit.py) */
#define FT_GELU_ERF_YMIN_HI (-0.16997121274471283f)
#define FT_GELU_ERF_YMIN_LO 5.264809033178608e-09f
#define FT_GELU_TANH_YMIN_HI (-0.17004075646400452f)
#define FT_GELU_TANH_YMIN_LO 5.892750287728177e-09f

/* y - ymin in float32 without cancellation error (y - hi is exact near the minimum: Sterbenz) */
FT_AHD float ft_gelu_above_min(float y, int act) {
    return act == FT_ACT_GELU_TANH ? (y - FT_GELU_TANH_YMIN_HI) - FT_GELU_TANH_YMIN_LO
                                   : (y - FT_GELU_ERF_YMIN_HI) - FT_GELU_ERF_YMIN_LO;
}

/* 1 when an output y of the activation needs its input recomputed (see FT_GELU_BAND) */
FT_AHD int ft_gelu_flat(float y, int act) {
    return (act == FT_ACT_GELU_ERF || act == FT_ACT_GELU_TANH) && ft_gelu_above_min(y, act) < FT_GELU_BAND;
}

/* ---- the inverse of GELU in float32 (Tempo's in-place GELU's backward) --------------------------
 * Per form, with d = y - ymin and s = sqrt(d) (x - xmin is analytic in s at the minimum):
 *   near the minimum (x in [-1.2, -0.4]): x = xmin + s P(s), P of degree 8 per branch, no iteration
 *     -- the only way to stay accurate where GELU' -> 0: a Newton step there would divide the
 *     float32 rounding of GELU(x) by GELU'(x);
 *   right of it (x > -0.4): a first guess x = y P(u) (y <= 1), y + P(u) (y <= 8), then two Newton
 *     steps on (x/2 - y) + T x/2 = 0, T = erf(x / sqrt 2) or tanh(u) (x/2 - y exact near x = 0, the
 *     product fused); above y = 8, x = y (x - y < 1e-14 x);
 *   left of it (x < -1.2): a first guess in L = log(-log(-y)), then two Newton steps on
 *     (GELU(x) - y) / y = 0 in log space (the step divides by GELU'(x) / GELU(x), which does not
 *     vanish as x -> -inf), and where GELU(x) is subnormal (y > -1e-36) on log(-GELU(x)) - log(-y)
 *     with log(-GELU(x)) written without underflow (erf: -x^2/2 - log sqrt(2 pi) + log h, h the
 *     asymptotic series of erfcx; tanh: log(-x) + 2u - log1p(exp(2u))).
 * Polynomials: least squares in double with float32 coefficients, each refitted after the rounding
 * of the ones before it (tools/gelu_inverse_fit.py writes the tables); Horner with fmaf, so both
 * backends evaluate them the same way. Accuracy, over every float32 output outside the flat band on
 * either branch of either form, against the float64 root: at most 3.5 units in the last place of
 * the float32 input (3.40 at worst, tanh form left of -1.2; enumerated: tests/test_gelu_inverse.py). */
typedef struct {
    float xmin_hi, xmin_lo;
    float dr, ar[9], dl, al[9];                        /* near the minimum, right / left: d < dr / dl */
    float s1, o1, g1[9], s2, o2, g2[9], s3, o3, g3[9]; /* first guesses: u = v s + o, v = y or L */
} ft_gelu_inv_k;

/* the tables (tools/gelu_inverse_fit.py) */
#define FT_GELU_INV_ERF \
    -0.7517915368080139f, 1.211444988769017e-08f, 0.03213990479707718f, {2.152918577194214f, \
    -1.3902933597564697f, 2.3492250442504883f, -3.8956851959228516f, 7.1071248054504395f, \
    -12.089431762695312f, 15.322722434997559f, -7.448228359222412f, -6.606141090393066f}, \
    0.03188760206103325f, {-2.1529178619384766f, -1.3904341459274292f, -2.3426191806793213f, \
    -4.09984016418457f, -4.656863212585449f, -35.307823181152344f, 51.697872161865234f, -140.3446807861328f, \
    -421.6762390136719f}, 1.7577297687530518f, -0.7577298283576965f, {1.3834095001220703f, \
    -0.37232914566993713f, 0.14833232760429382f, -0.4166155755519867f, 0.8282428979873657f, \
    0.6424814462661743f, -1.4138096570968628f, -0.7159117460250854f, 1.0709714889526367f}, \
    0.2857142984867096f, -1.2857142686843872f, {8.533836808055639e-05f, -0.0015492003876715899f, \
    -0.0014023571275174618f, 0.016600480303168297f, 0.044043272733688354f, -0.19472062587738037f, \
    0.12520964443683624f, 0.10741976648569107f, -0.09606480598449707f}, 0.5059036612510681f, \
    -1.3455545902252197f, {-5.163977146148682f, -5.479751110076904f, -2.523833990097046f, \
    -0.976440966129303f, 0.0869157686829567f, 0.06182020530104637f, -0.48267918825149536f, \
    -0.15121029317378998f, 0.3340960741043091f}

#define FT_GELU_INV_TANH \
    -0.7524614334106445f, 1.1339627903339533e-08f, 0.032201919704675674f, {2.1556527614593506f, \
    -1.39461088180542f, 2.346931219100952f, -3.8679089546203613f, 7.015110969543457f, -11.849576950073242f, \
    14.807868003845215f, -6.656260967254639f, -7.221378803253174f}, 0.03174351900815964f, \
    {-2.1556520462036133f, -1.394749402999878f, -2.340491533279419f, -4.06731653213501f, \
    -4.628795623779297f, -34.63356018066406f, 51.50434875488281f, -143.1648406982422f, -397.5841369628906f}, \
    1.7577182054519653f, -0.7577182054519653f, {1.3834881782531738f, -0.372208833694458f, \
    0.14851130545139313f, -0.41636836528778076f, 0.8271251320838928f, 0.6415765285491943f, \
    -1.4114909172058105f, -0.7152354121208191f, 1.0695397853851318f}, 0.2857142984867096f, \
    -1.2857142686843872f, {9.453407255932689e-05f, -0.0012713437899947166f, -0.0033624719362705946f, \
    0.018418360501527786f, 0.049111299216747284f, -0.20096302032470703f, 0.1221512034535408f, \
    0.11155317723751068f, -0.09607318043708801f}, 0.5104271769523621f, -1.3482457399368286f, \
    {-4.806959629058838f, -4.336177825927734f, -1.1686490774154663f, -0.30923715233802795f, \
    0.2020106017589569f, 0.10950722545385361f, -0.4576687812805176f, -0.1597994714975357f, \
    0.33176103234291077f}

/* c[0] + u (c[1] + u (c[2] + ...)) */
FT_AHD float ft_hornerf(const float *c, int n, float u) {
    float p = c[n - 1];
    for (int j = n - 2; j >= 0; j--) p = fmaf(p, u, c[j]);
    return p;
}

FT_AHD float ft_gelu_invert_core(float y, int left, const ft_gelu_inv_k *k, int tanh_form) {
    const float d = ft_gelu_above_min(y, tanh_form ? FT_ACT_GELU_TANH : FT_ACT_GELU_ERF);
    if (!(d > 0.0f)) return y != y ? y : k->xmin_hi;   /* NaN; the minimum (y rounded below it) */
    if (d < (left ? k->dl : k->dr)) {   /* each table indexed by constants only: no local copy on a GPU */
        const float sd = sqrtf(d), p = left ? ft_hornerf(k->al, 9, sd) : ft_hornerf(k->ar, 9, sd);
        return k->xmin_hi + fmaf(sd, p, k->xmin_lo);
    }
    float x;
    if (!left) {
        if (y > 8.0f) return y;
        x = y <= 1.0f ? y * ft_hornerf(k->g1, 9, fmaf(y, k->s1, k->o1)) : y + ft_hornerf(k->g2, 9, fmaf(y, k->s2, k->o2));
        for (int it = 0; it < 2; it++) {
            /* GELU(x) = x/2 + T x/2, T = tanh(u) or erf(x / sqrt 2): GELU(x) - y = (x/2 - y) + T x/2,
             * x/2 - y exact where y ~ x/2 (x ~ 0), the product exact (fmaf), T accurate near 0 */
            float t, fp;
            if (tanh_form) {
                t = tanhf(fmaf(0.7978845608028654f, x, 0.035677408136300125f * x * x * x));
                fp = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 0.134145f * x * x);
            } else {
                t = erff(x * 0.70710678118654752f);
                fp = 0.5f * (1.0f + t) + x * 0.39894228040143268f * expf(-0.5f * x * x);
            }
            x -= fmaf(0.5f * x, t, 0.5f * x - y) / fp;
        }
        return x;
    }
    if (!(y < 0.0f)) return -40.0f;                    /* GELU underflowed: far left, GELU' ~ 0 */
    const float lam = logf(-y);
    x = ft_hornerf(k->g3, 9, fmaf(logf(-lam), k->s3, k->o3));
    for (int it = 0; it < 2; it++) {
        float r, gp;   /* (GELU(x) - y) / y or its log form, and d log(-GELU(x)) / dx */
        if (tanh_form) {
            const float u2 = fmaf(1.5957691216057308f, x, 0.07135481627260025f * x * x * x), e = expf(u2);
            gp = 1.0f / x + 1.5957691216057308f * (1.0f + 0.134145f * x * x) / (1.0f + e);
            r = y < -1e-36f ? (x / (1.0f + 1.0f / e) - y) / y : (logf(-x) + u2 - log1pf(e)) - lam;
        } else if (y < -1e-36f) {
            const float p = 0.5f * erfcf(x * -0.70710678118654752f);
            gp = 1.0f / x + 0.39894228040143268f * expf(-0.5f * x * x) / p;
            r = (x * p - y) / y;
        } else {
            const float w = 2.0f / (x * x), h = 1.0f + w * (-0.5f + w * (0.75f + w * (-1.875f + w * 6.5625f)));
            const float e = x * x, elo = fmaf(x, x, -e);
            gp = 1.0f / x - x / h;
            r = ((-0.5f * e - 0.91893853320467274f) - lam) + (logf(h) - 0.5f * elo);
        }
        x -= r / gp;
    }
    return x;
}

/* The x with GELU(x) = y on the given side of the minimum, in float32 only. Meant for y outside the
 * flat band; inside it the polynomials still give the root, but y's rounding no longer pins x down. */
FT_AHD float ft_gelu_invertf(float y, int left, int act) {
    if (act == FT_ACT_GELU_TANH) {
        const ft_gelu_inv_k k = {FT_GELU_INV_TANH};
        return ft_gelu_invert_core(y, left, &k, 1);
    }
    const ft_gelu_inv_k k = {FT_GELU_INV_ERF};
    return ft_gelu_invert_core(y, left, &k, 0);
}
#endif
