"""Triton building blocks shared by every kernel family: the logit transform and online softmax.

Imports triton only. Every helper works on one tile of a row held in registers as float32.
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def load_tile(row_ptr, cols, mask, inv_temp, softcap, HAS_SOFTCAP: tl.constexpr):
    """Loads a tile and returns (z, dz/dx) in float32; masked lanes get z = -inf.

    z = softcap * tanh(x * inv_temp / softcap) when HAS_SOFTCAP (accurate for every softcap
    > 0, see tanh_and_grad), else x * inv_temp. (Without a temperature, _ce_core.load_z saves
    the multiply.)
    """
    x = tl.load(row_ptr + cols, mask=mask, other=0.0)
    # The product rounded on its own (an explicit fma with 0): left as a multiply, the GPU
    # compiler contracts it with a later `z - max` into one fma, so z - max at a row's largest
    # entry would not be exactly 0 (a V=1 row's softmax not exactly 1; the interpreter, which
    # never contracts, gives 1).
    x = tl.fma(x.to(tl.float32), inv_temp, 0.0)
    if HAS_SOFTCAP:
        t, dt = tanh_and_grad(x / softcap)
        z = softcap * t
        dz = dt * inv_temp
    else:
        z = x
        dz = tl.zeros_like(x) + inv_temp
    z = tl.where(mask, z, float("-inf"))
    return z, dz


@triton.jit
def tanh_and_grad(u):
    """(tanh(u), 1 - tanh(u)**2) to a few ulp for every float32 u (+-inf give +-1 and 0).

    With e = exp(-2|u|) (never overflows): tanh|u| = (1 - e) / (1 + e) and
    1 - tanh**2 = 4e / (1 + e)**2, without the cancellation of 1 - 2 / (exp(2u) + 1). Below
    |u| = 1/4, where 1 - e would cancel, the odd Taylor series to u**9 (relative error < 1e-8).
    A NaN u gives NaN.
    """
    a = tl.abs(u)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    u2 = u * u
    small = a + a * u2 * (-1.0 / 3.0 + u2 * (2.0 / 15.0 + u2 * (-17.0 / 315.0
                                                                 + u2 * (62.0 / 2835.0))))
    t_abs = tl.where(a < 0.25, small, big)
    t = tl.where(u < 0.0, -t_abs, t_abs)
    dt = tl.where(a < 0.25, 1.0 - t_abs * t_abs, 4.0 * e / ((1.0 + e) * (1.0 + e)))
    return t, dt


@triton.jit
def safe_max(m):
    """The reference a sum is taken relative to: the running max m where it is finite, 0 where
    m is -inf (a row that has seen only -inf: exp(-inf - 0) = 0, never NaN) or +inf (exp(+inf
    - 0) = +inf, so the sum and the log-sum-exp become +inf, never NaN). A NaN m stays NaN."""
    return tl.where((m == float("-inf")) | (m == float("inf")), 0.0, m)


@triton.jit
def load_partials(part_ptr, row, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Pointers to field 0 of a row's NUM_SPLITS partials (layout float32 [N, NUM_SPLITS, 4],
    field f at +f) and the mask of real splits; load field f with `load_field`."""
    idx = tl.arange(0, BLOCK_S)
    return part_ptr + (row * NUM_SPLITS + idx) * 4, idx < NUM_SPLITS


@triton.jit
def load_field(base, valid, FIELD: tl.constexpr, IS_MAX: tl.constexpr, CACHE: tl.constexpr):
    """Field FIELD of every split; padding lanes get the merge identity (-inf for a max, else
    0). CACHE: the load's cache modifier, ".cg" for partials that other programs of the same
    launch wrote (never a stale L1 line), else ""."""
    return tl.load(base + FIELD, mask=valid, other=float("-inf") if IS_MAX else 0.0,
                   cache_modifier=CACHE)


@triton.jit
def store_partials(part_ptr, row, split, num_splits, f0, f1, f2, f3):
    """Stores one split's four partial statistics at part_ptr[row, split] (layout float32
    [N, num_splits, 4], as load_partials reads them)."""
    out = part_ptr + (row * num_splits + split) * 4
    tl.store(out, f0)
    tl.store(out + 1, f1)
    tl.store(out + 2, f2)
    tl.store(out + 3, f3)


@triton.jit
def merge_stats(m_i, s_i):
    """Merges partials (max m_i, sum s_i of exp(z - m_i)) over a vector of slices into
    (max, sum); the identity is (-inf, 0) and the result's sum is relative to safe_max(max)."""
    m = tl.max(m_i, axis=0)
    return m, tl.sum(s_i * tl.exp(m_i - safe_max(m)), axis=0)


@triton.jit
def tile_update(m, s, z):
    """One online-softmax step: folds a tile z (float32, -inf at masked lanes) into (m, s)."""
    m_new = tl.maximum(m, tl.max(z, axis=0))
    ms = safe_max(m_new)
    s = s * tl.exp(m - ms) + tl.sum(tl.exp(z - ms), axis=0)
    return m_new, s


@triton.jit
def stats_to_lse(m, s):
    """log-sum-exp from (max, sum relative to safe_max(max)): -inf for a row with no entry
    above -inf (s == 0), +inf for a row with a +inf entry and no NaN (s == +inf), NaN for a row
    with a NaN entry (s is NaN: whatever a NaN-dropping max did, exp(NaN - m) reached s)."""
    return tl.where(s == 0.0, float("-inf"), safe_max(m) + tl.log(s))


@triton.jit
def lse_parts(m, s):
    """The log-sum-exp as an unevaluated sum hi + lo of two float32 from (max, sum relative to
    safe_max(max)): hi = stats_to_lse(m, s) (the float32 lse) and lo = (safe_max(m) + log(s))
    - hi exactly (Knuth's TwoSum; 0 where hi is not finite).

    A softmax entry exp((z - hi) - lo) is then as accurate as at small logits: z - hi is exact
    for z within a factor 2 of hi and lo (|lo| <= ulp(hi) / 2) restores what rounding hi lost,
    where exp(z - hi) is off by up to |hi| * 2**-24 relative (0.4% at |lse| = 1e5)."""
    ms = safe_max(m)
    ls = tl.log(s)
    hi = tl.where(s == 0.0, float("-inf"), ms + ls)
    back = hi - ms
    lo = (ms - (hi - back)) + (ls - back)
    return hi, tl.where((hi > float("-inf")) & (hi < float("inf")), lo, 0.0)


@triton.jit
def poison_inf(lse):
    """lse with +inf replaced by NaN: a loss or gradient built on it is NaN (the NaN/+inf policy:
    a row with a +inf logit has lse +inf but NaN loss and gradient; -inf and NaN unchanged)."""
    return tl.where(lse == float("inf"), float("nan"), lse)


@triton.jit
def hint_multiple(x, ALIGN: tl.constexpr):
    """Returns x (a size or stride the caller guarantees is a multiple of ALIGN) in a form the
    compiler knows is a multiple of ALIGN, so row starts and tile masks allow 16-byte vector
    loads. jax-triton passes scalars without the divisibility specialisation that Triton's own
    launcher infers; (x // ALIGN) * ALIGN carries it (tl.multiple_of on a scalar does not)."""
    return (x // ALIGN) * ALIGN


# Aligned tile walks. A row walk loads 16-byte vectors only where the compiler can prove a
# tile's address is a multiple of 16 bytes and its mask constant over each group of
# VEC = 16 bytes / itemsize elements. With a vocabulary whose row starts are not multiples of
# VEC (gpt2's V=50257: ALIGN=1) every load was 2 bytes wide (~70% of copy bandwidth on H100).
# So a row's slice [start, stop) is walked as a vector span, whose absolute offset and length
# are multiples of VEC (tiles loaded and stored as 16-byte vectors), plus an edge tile holding
# the at most VEC - 1 columns before and after the span. A kernel walks a slice as
#     VEC: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth
#     k0, k1, lo = vector_span(row_off, start, stop, ALIGN, VEC)
#     if ALIGN < VEC:
#         cols, mask = edge_tile(start, stop, lo, k1, VEC)
#         ... the tile at x_ptr + row_off + cols under mask
#     base = span_ptr(x_ptr, row_off, lo, ALIGN, VEC)
#     for k in range(k0, k1, BLOCK_V):
#         t = k + tl.arange(0, BLOCK_V)
#         ... the tile at base + t under t < k1, columns lo + t
# (BLOCK_V a multiple of VEC; VEC annotated tl.constexpr: the interpreter makes a plain local a
# tensor). An aligned vocabulary (ALIGN >= VEC) has no edge and its span is the slice itself
# (k0, k1, lo = start, stop, 0): the plain walk, the same instructions as before the span
# existed. A pass that also writes a row walks its output with the same span (span_ptr of the
# output's row offset), so the output's row offsets must be congruent to the input's modulo
# VEC: the plans pass stride_row = V. A buffer that is not 16-byte aligned (a torch view) gets
# no pointer alignment from Triton's launcher: scalar accesses, still correct.
# tests/sm90_compile.py checks the compiled vectors, tests/test_aligned_tiles.py the walk.
@triton.jit
def vector_span(row_off, start, stop, ALIGN: tl.constexpr, VEC: tl.constexpr):
    """(k0, k1, lo): the vector span of the slice [start, stop) of a row at element offset
    row_off (int64) of a 16-byte aligned buffer is the columns lo + [k0, k1). With ALIGN < VEC:
    lo is the first column >= start with row_off + lo a multiple of VEC (lo <= stop), k0 = 0
    and k1 the largest multiple of VEC with lo + k1 <= stop (0 for a slice that holds no whole
    aligned group). With ALIGN >= VEC (every row offset and slice bound is a multiple of VEC)
    the whole slice: (start, stop, 0)."""
    if ALIGN >= VEC:
        k0 = start
        k1 = stop
        lo = 0
    else:
        k0 = 0
        lo = tl.minimum(start + (VEC - (row_off + start) % VEC) % VEC, stop).to(tl.int32)
        k1 = hint_multiple(tl.maximum((stop - (row_off + stop) % VEC) - lo, 0).to(tl.int32),
                           VEC)
    return k0, k1, lo


@triton.jit
def span_ptr(ptr, row_off, lo, ALIGN: tl.constexpr, VEC: tl.constexpr):
    """ptr + row_off + lo, the base of a vector span's tiles, in a form the compiler knows is a
    multiple of VEC elements past ptr (jax-triton passes 16-byte aligned arrays)."""
    if ALIGN >= VEC:
        base = ptr + row_off
    else:
        base = ptr + hint_multiple(row_off + lo, VEC)
    return base


@triton.jit
def edge_tile(start, stop, lo, n, VEC: tl.constexpr):
    """(cols, mask): the columns of [start, stop) outside its vector span lo + [0, n), i.e.
    [start, lo) and [lo + n, stop) (each shorter than VEC), as one [2 * VEC] tile."""
    e = tl.arange(0, 2 * VEC)
    head = e < VEC
    cols = tl.where(head, start + e, lo + n + (e - VEC))
    return cols, tl.where(head, cols < lo, cols < stop)
