"""The tables of csrc/core/activation.h's float32 inverse of GELU (Tempo's in-place GELU):
per form (erf, tanh), GELU's minimum xmin as float32 hi + lo, then

  dr, ar[9]   right of the minimum, d = y - ymin < dr: x = xmin + s (ar[0] + s ar[1] + ... ), s = sqrt(d)
  dl, al[9]   the same left of it
  s1, o1, g1  right, y <= 1: first guess x = y P(u), u = y s1 + o1
  s2, o2, g2  right, 1 < y <= 8: x = y + P(u), u = y s2 + o2
  s3, o3, g3  left, beyond dl: x = P(u), u = L s3 + o3, L = log(-log(-y))

Least squares in double over a dense grid of x (relative error in x), each coefficient rounded to
float32 in turn and the remaining ones refitted. Prints the C macros; paste them into activation.h.
Run: python tools/gelu_inverse_fit.py (needs numpy, scipy, mpmath)."""
import numpy as np, mpmath as mp
from scipy.special import erfc
from numpy.polynomial import Chebyshev as Ch, Polynomial as Poly
mp.mp.dps = 40
def f_erf(x): return 0.5 * x * erfc(-x / np.sqrt(2))
def f_tanh(x):
    u = 0.7978845608028654 * (x + 0.044715 * x ** 3)
    return x / (1 + np.exp(-2 * u))
XMIN = {"erf": mp.mpf("-0.75179152469356445746"), "tanh": mp.mpf("-0.75246142207101625849")}
YMIN = {"erf": mp.mpf("-0.16997120747990366169"), "tanh": mp.mpf("-0.17004075057125405064")}
XA_R, XA_L, NA = -0.4, -1.2, 9     # region A (direct polynomial in s): x in [XA_L, XA_R]
Y1, YBIG, NG = 1.0, 8.0, 9         # right guesses: y <= Y1: x = y P(u); Y1 < y <= YBIG: x = y + P(u)
XLO = {"erf": -14.3, "tanh": -10.6}
f32 = np.float32
def split(v):
    hi = f32(float(v)); return hi, f32(float(v - mp.mpf(float(hi))))
def seq_fit(B, t, W):
    """least squares, coefficients rounded to float32 one at a time (lowest first), the rest refitted"""
    n = B.shape[1]; c = np.zeros(n)
    for j in range(n):
        sol, *_ = np.linalg.lstsq(B[:, j:] * W[:, None], (t - B[:, :j] @ c[:j]) * W, rcond=None)
        c[j] = f32(sol[0])
    return c.astype(f32)
def scaled(v, lo, hi):
    s = f32(2.0 / (hi - lo)); o = f32(-(hi + lo) / (hi - lo)); return s, o, (v.astype(f32) * s + o).astype(np.float64)
def fmt(v): return repr(float(f32(v))) + "f"
out = {}
ydefs = []
for name, f in (("erf", f_erf), ("tanh", f_tanh)):
    xm, ym = float(XMIN[name]), float(YMIN[name])
    xh, xl = split(XMIN[name]); yh, yl = split(YMIN[name])
    vals = [xh, xl]
    ydefs.append((name, yh, yl))
    for side, xa in (("right", XA_R), ("left", XA_L)):
        x = np.linspace(xm, xa, 400001)[1:] if side == "right" else np.linspace(xa, xm, 400001)[:-1]
        s = np.sqrt(f(x) - ym); t = x - xm
        B = np.stack([s ** k for k in range(1, NA + 1)], 1)
        c = seq_fit(B, t, 1 / np.abs(x))
        vals += [f32(f(xa) - ym), list(c)]
    x = np.linspace(XA_R, 9, 800001); x = x[x != 0]; y = f(x)
    m = y <= Y1; s1, o1, u = scaled(y[m], y[m].min(), Y1)
    c1 = seq_fit(np.stack([u ** k for k in range(NG)], 1), x[m] / y[m], np.ones(m.sum()))
    m = (y > Y1) & (y <= YBIG); s2, o2, u = scaled(y[m], Y1, YBIG)
    c2 = seq_fit(np.stack([u ** k for k in range(NG)], 1), x[m] - y[m], np.ones(m.sum()))
    x = np.linspace(XLO[name], XA_L, 800001); y = f(x); m = y < -1e-45; x, y = x[m], y[m]
    L = np.log(-np.log(-y)); s3, o3, u = scaled(L, L.min(), L.max())
    c3 = seq_fit(np.stack([u ** k for k in range(NG)], 1), x, 1 / np.abs(x))
    vals += [s1, o1, list(c1), s2, o2, list(c2), s3, o3, list(c3)]
    out[name] = vals
    print("#define FT_GELU_INV_%s \\" % name.upper())
    tokens = []   # numbers and braces, wrapped at 110 columns
    for v in vals:
        if isinstance(v, list):
            tokens += ["{" + fmt(v[0]) + ","] + [fmt(e) + "," for e in v[1:-1]] + [fmt(v[-1]) + "},"]
        else:
            tokens.append(fmt(v) + ",")
    tokens[-1] = tokens[-1].rstrip(",")
    line = "   "
    for t in tokens:
        if len(line) + len(t) + 1 > 108:
            print(line + " \\")
            line = "   "
        line += " " + t
    print(line)
    print()
for name, yh, yl in ydefs:
    print("#define FT_GELU_%s_YMIN_HI (%s)" % (name.upper(), fmt(yh)))
    print("#define FT_GELU_%s_YMIN_LO %s" % (name.upper(), fmt(yl)))
