/* Fused CPU kernels for delta weight sync (built on first use by sync/native.py).
 *
 * Each kernel makes one pass over its data, so a delta costs one read of the
 * two weight copies on the sender and one pass over the changed cache lines on
 * the receiver, instead of a chain of numpy temporaries:
 *
 *   enc_W    compare old/new a 64-bit word at a time (enc_bf16_f32: new is
 *            fp32, cast to bf16 on the way, in cache); for every changed element
 *            emit its varint gap, bitmask bit, diff8 byte (or escape), new and
 *            old value, and the (sum, index-weighted sum) of old and new values;
 *            optionally write new into old (the sender's last-sent copy).
 *   apply_W  decode a piece's streams and write them in one pass over the
 *            changed positions: new = old + diff8 (or escape / raw value),
 *            keeping the old values (undo) and summing old and new, checking
 *            the streams as it goes (a bad one stops it: the caller writes
 *            back what it wrote); mode 2 writes kept old values back.
 *
 * W is the element width (u16: bf16/fp16, u32: fp32). Sums use the signed
 * integer view of each element and piece-local positions, wrapping mod 2**64,
 * exactly as sync.checksum defines them. Plain C99, no dependencies: the
 * Python side splits work into parts and runs them on threads (ctypes drops
 * the GIL for the call). The receiver's pass is one thread: it is bound by
 * the scattered cache lines it touches, which a second core barely speeds up.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define ESCAPE (-128)
/* apply: changes are sparse but in order, too irregular for the hardware
 * prefetcher; fetch the lines this far ahead of the current one (never faults) */
#define PREFETCH_BYTES 4096
#define BLOCK 8192 /* elements per block (a multiple of 64): both sides stay in cache */

/* bf16 bits of an fp32 value, rounding to nearest even like torch's cast;
 * NaN becomes `nan_bits` (what torch's cast gives for NaN on this build). */
static inline uint16_t bf16_of(uint32_t x, uint16_t nan_bits) {
    if ((x & 0x7fffffffu) > 0x7f800000u) return nan_bits;
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* Bit j set when a[j] != b[j], for 64 elements (vector compares where the
 * compiler targets them; the scalar loop is the portable fallback). */
static inline uint64_t neq64_u16(const uint16_t *a, const uint16_t *b) {
#if defined(__AVX512BW__)
    __m512i a0 = _mm512_loadu_si512((const void *)a), b0 = _mm512_loadu_si512((const void *)b);
    __m512i a1 = _mm512_loadu_si512((const void *)(a + 32)), b1 = _mm512_loadu_si512((const void *)(b + 32));
    return (uint64_t)_mm512_cmpneq_epi16_mask(a0, b0) | (uint64_t)_mm512_cmpneq_epi16_mask(a1, b1) << 32;
#elif defined(__AVX2__)
    uint64_t m = 0;
    for (int h = 0; h < 2; h++) {
        __m256i e0 = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)(a + 32 * h)),
                                        _mm256_loadu_si256((const __m256i *)(b + 32 * h)));
        __m256i e1 = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)(a + 32 * h + 16)),
                                        _mm256_loadu_si256((const __m256i *)(b + 32 * h + 16)));
        __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi16(e0, e1), 0xD8);
        m |= (uint64_t)(uint32_t)~_mm256_movemask_epi8(p) << (32 * h);
    }
    return m;
#else
    uint64_t m = 0;
    for (int j = 0; j < 64; j++) m |= (uint64_t)(a[j] != b[j]) << j;
    return m;
#endif
}

static inline uint64_t neq64_u32(const uint32_t *a, const uint32_t *b) {
#if defined(__AVX512F__)
    uint64_t m = 0;
    for (int q = 0; q < 4; q++)
        m |= (uint64_t)_mm512_cmpneq_epi32_mask(_mm512_loadu_si512((const void *)(a + 16 * q)),
                                                _mm512_loadu_si512((const void *)(b + 16 * q))) << (16 * q);
    return m;
#elif defined(__AVX2__)
    uint64_t m = 0;
    for (int q = 0; q < 8; q++) {
        __m256i e = _mm256_cmpeq_epi32(_mm256_loadu_si256((const __m256i *)(a + 8 * q)),
                                       _mm256_loadu_si256((const __m256i *)(b + 8 * q)));
        m |= (uint64_t)(uint8_t)~_mm256_movemask_ps(_mm256_castsi256_ps(e)) << (8 * q);
    }
    return m;
#else
    uint64_t m = 0;
    for (int j = 0; j < 64; j++) m |= (uint64_t)(a[j] != b[j]) << j;
    return m;
#endif
}

/* out[]: k, num_escapes, varint_len, varint_overflow, s0_old, s1_old, s0_new, s1_new, first_pos, last_pos
 * Works block by block (BLOCK elements, in cache): the new values are cast
 * into a block buffer when they come in the trainer's dtype (CAST); each
 * 64-element group's change mask is one vector compare, is stored as 8 bytes
 * of the bitmask as it is, and its set bits are visited by count-trailing-zeros. */
#define DEFINE_ENC(NAME, UT, ST, NEQ, NT, CAST)                                                           \
int64_t NAME(UT *restrict old, const NT *restrict new_, int64_t n, int write_old, int64_t base,           \
             uint8_t *restrict vbuf, int64_t vcap, uint8_t *restrict bm, int8_t *restrict d8,             \
             UT *restrict vals, UT *restrict olds, UT *restrict esc, int64_t nan_bits, int64_t *out) {     \
    int64_t k = 0, nesc = 0, vlen = 0, last = -1, first = -1;                                             \
    int overflow = 0;                                                                                     \
    uint64_t s0o = 0, s1o = 0, s0n = 0, s1n = 0;                                                          \
    UT nb[CAST ? BLOCK : 1];                                                                              \
    (void)nan_bits; (void)nb;                                                                             \
    for (int64_t e0 = 0; e0 < n; e0 += BLOCK) {                                                           \
        int64_t e1 = e0 + BLOCK < n ? e0 + BLOCK : n;                                                     \
        const UT *nv;                                                                                     \
        if (CAST) {                                                                                       \
            const uint32_t *src = (const uint32_t *)new_ + e0;                                            \
            for (int64_t i = 0; i < e1 - e0; i++) nb[i] = (UT)bf16_of(src[i], (uint16_t)nan_bits);        \
            nv = nb;                                                                                      \
        } else {                                                                                          \
            nv = (const UT *)new_ + e0;                                                                   \
        }                                                                                                 \
        for (int64_t g0 = e0; g0 < e1; g0 += 64) {                                                        \
            int64_t len = e1 - g0 < 64 ? e1 - g0 : 64;                                                    \
            uint64_t m;                                                                                   \
            if (len == 64) {                                                                              \
                m = NEQ(old + g0, nv + (g0 - e0));                                                        \
                memcpy(bm + g0 / 8, &m, 8);                                                               \
            } else {                                                                                      \
                m = 0;                                                                                    \
                for (int64_t j = 0; j < len; j++) m |= (uint64_t)(old[g0 + j] != nv[g0 - e0 + j]) << j;  \
                memcpy(bm + g0 / 8, &m, (size_t)((len + 7) / 8));                                         \
            }                                                                                             \
            if (m && first < 0) first = g0 + __builtin_ctzll(m);                                          \
            while (m) {                                                                                   \
                int64_t i = g0 + __builtin_ctzll(m);                                                      \
                m &= m - 1;                                                                               \
                UT o = old[i], v = nv[i - e0];                                                            \
                uint64_t g = (uint64_t)(i - last - 1);                                                    \
                last = i;                                                                                 \
                if (g < 128 && vlen < vcap) {                                                             \
                    vbuf[vlen++] = (uint8_t)g;                                                            \
                } else if (!overflow && vlen + 10 <= vcap) {                                              \
                    while (g >= 128) { vbuf[vlen++] = (uint8_t)((g & 127) | 128); g >>= 7; }              \
                    vbuf[vlen++] = (uint8_t)g;                                                            \
                } else {                                                                                  \
                    overflow = 1;                                                                         \
                    vlen++;                                                                               \
                    while (g >= 128) { vlen++; g >>= 7; }                                                 \
                }                                                                                         \
                int64_t so = (ST)o, sn = (ST)v, d = sn - so;                                              \
                int fits = d > ESCAPE && d <= 127;                                                        \
                d8[k] = fits ? (int8_t)d : (int8_t)ESCAPE;                                                \
                esc[nesc] = v;                                                                            \
                nesc += !fits;                                                                            \
                vals[k] = v;                                                                              \
                olds[k] = o;                                                                              \
                uint64_t p = (uint64_t)(base + i);                                                        \
                s0o += (uint64_t)so; s1o += p * (uint64_t)so;                                             \
                s0n += (uint64_t)sn; s1n += p * (uint64_t)sn;                                             \
                k++;                                                                                      \
                if (write_old) old[i] = v;                                                                \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
    out[0] = k; out[1] = nesc; out[2] = vlen; out[3] = overflow;                                          \
    out[4] = (int64_t)s0o; out[5] = (int64_t)s1o; out[6] = (int64_t)s0n; out[7] = (int64_t)s1n;          \
    out[8] = first; out[9] = last;                                                                        \
    return k;                                                                                             \
}

DEFINE_ENC(enc_u16, uint16_t, int16_t, neq64_u16, uint16_t, 0)
DEFINE_ENC(enc_u32, uint32_t, int32_t, neq64_u32, uint32_t, 0)
DEFINE_ENC(enc_bf16_f32, uint16_t, int16_t, neq64_u16, float, 1)

/* One change at position p: mode 0 new = old + diff8 (or the next escape
 * value), 1 new = the raw value, 2 write the kept old value back. */
#define APPLY_ONE(UT, ST)                                                                                 \
    do {                                                                                                  \
        __builtin_prefetch(flat + p + PREFETCH_BYTES / sizeof(UT), 1, 0);                                 \
        UT o = flat[p], v;                                                                                \
        if (mode == 2) { flat[p] = olds[j]; j++; break; }                                                 \
        if (mode == 1) v = vals[j];                                                                       \
        else if (d8[j] != ESCAPE) v = (UT)((ST)o + d8[j]);                                                \
        else if (e < nvals) v = vals[e++];                                                                \
        else { rc = -4; goto done; }                                                                      \
        flat[p] = v;                                                                                      \
        olds[j] = o;                                                                                      \
        int64_t so = (ST)o, sn = (ST)v;                                                                   \
        s0o += (uint64_t)so; s1o += (uint64_t)p * (uint64_t)so;                                           \
        s0n += (uint64_t)sn; s1n += (uint64_t)p * (uint64_t)sn;                                           \
        j++;                                                                                              \
    } while (0)

/* Decode an index stream (codec 0: varint gaps, 1: bitmask of n bits) and
 * write the k changes into flat[0, n) in one pass, checking the streams as
 * it goes: mode 0 new = old + d8[j] or the next of the nvals escape values,
 * mode 1 new = vals[j], mode 2 new = olds[j] (rollback). Keeps the old
 * values in olds and sums[4] = (sum old, sum pos * old, sum new, sum pos * new).
 * Returns 0, or a negative code with *written = the changes already written
 * (the caller puts them back): -1 stream ends early / has extra bytes,
 * -2 position out of range, -3 wrong number of changes, -4 escape count,
 * -5 varint too long. */
#define DEFINE_APPLY(NAME, UT, ST)                                                                        \
int64_t NAME(UT *restrict flat, int64_t n, const uint8_t *restrict s, int64_t slen, int codec, int64_t k, \
             const int8_t *restrict d8, const UT *restrict vals, int64_t nvals, UT *restrict olds,        \
             int mode, int64_t *sums, int64_t *written) {                                                 \
    uint64_t s0o = 0, s1o = 0, s0n = 0, s1n = 0;                                                          \
    int64_t j = 0, e = 0, rc = 0, at = 0;                                                                 \
    if (codec == 0) {                                                                                     \
        int64_t last = -1;                                                                                \
        while (at < slen) {                                                                               \
            uint64_t g = s[at++];                                                                         \
            if (g & 128) {                                                                                \
                g &= 127;                                                                                 \
                int shift = 7;                                                                            \
                for (;;) {                                                                                \
                    if (at >= slen) { rc = -1; goto done; }                                               \
                    if (shift > 56) { rc = -5; goto done; }                                               \
                    uint8_t b = s[at++];                                                                  \
                    g |= (uint64_t)(b & 127) << shift;                                                    \
                    if (!(b & 128)) break;                                                                \
                    shift += 7;                                                                           \
                }                                                                                         \
            }                                                                                             \
            if (g >= (uint64_t)n) { rc = -2; goto done; }                                                 \
            int64_t p = last + 1 + (int64_t)g;                                                            \
            if (p >= n) { rc = -2; goto done; }                                                           \
            if (j >= k) { rc = -3; goto done; }                                                           \
            last = p;                                                                                     \
            APPLY_ONE(UT, ST);                                                                            \
        }                                                                                                 \
    } else {                                                                                              \
        if (slen != (n + 7) / 8) { rc = -1; goto done; }                                                  \
        if (n % 8 && slen && (s[slen - 1] >> (n % 8))) { rc = -2; goto done; }                            \
        for (; at < slen; at += 8) {                                                                      \
            uint64_t w = 0;                                                                               \
            memcpy(&w, s + at, (size_t)(slen - at < 8 ? slen - at : 8));                                 \
            while (w) {                                                                                   \
                int64_t p = at * 8 + __builtin_ctzll(w);                                                  \
                w &= w - 1;                                                                               \
                if (j >= k) { rc = -3; goto done; }                                                       \
                APPLY_ONE(UT, ST);                                                                        \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
    if (j != k) rc = -3;                                                                                  \
    else if (mode == 0 && e != nvals) rc = -4;                                                            \
done:                                                                                                     \
    sums[0] = (int64_t)s0o; sums[1] = (int64_t)s1o; sums[2] = (int64_t)s0n; sums[3] = (int64_t)s1n;      \
    *written = j;                                                                                         \
    return rc;                                                                                            \
}

DEFINE_APPLY(apply_u16, uint16_t, int16_t)
DEFINE_APPLY(apply_u32, uint32_t, int32_t)

/* sync.checksum.bytes_checksum of buf[0, n): its 8-byte little-endian words
 * w_j at positions j + 1, then its last n % 8 bytes b_t at nw + t + 1;
 * out = (sum w + sum b, sum pos * w + sum pos * b), wrapping mod 2**64.
 * The sparse payload's checksum: numpy's row/column-sum trick costs several
 * passes and a call per piece, this one pass over data usually still in cache. */
void bytes_sums(const uint8_t *restrict buf, int64_t n, int64_t *out) {
    int64_t nw = n / 8;
    uint64_t s0 = 0, s1 = 0;
    for (int64_t j = 0; j < nw; j++) {
        uint64_t w;
        memcpy(&w, buf + 8 * j, 8);
        s0 += w;
        s1 += (uint64_t)(j + 1) * w;
    }
    for (int64_t t = 0; t < n % 8; t++) {
        uint64_t b = buf[8 * nw + t];
        s0 += b;
        s1 += (uint64_t)(nw + t + 1) * b;
    }
    out[0] = (int64_t)s0;
    out[1] = (int64_t)s1;
}

/* Copy num chunks (srcs[c], lens[c] bytes) one after another into dst, then
 * bytes_sums of what was written: a sparse piece's streams become its
 * payload and payload checksum in one call. */
void pack_bytes(uint8_t *restrict dst, const int64_t *srcs, const int64_t *lens, int64_t num, int64_t *out) {
    int64_t at = 0;
    for (int64_t c = 0; c < num; c++) {
        memcpy(dst + at, (const void *)(intptr_t)srcs[c], (size_t)lens[c]);
        at += lens[c];
    }
    bytes_sums(dst, at, out);
}

/* bytes_sums of num buffers (ptrs[c], lens[c] bytes) into out[2 * c]: the
 * receiver checks every sparse payload of an update in one call. */
void bytes_sums_many(const int64_t *ptrs, const int64_t *lens, int64_t num, int64_t *out) {
    for (int64_t c = 0; c < num; c++) bytes_sums((const uint8_t *)(intptr_t)ptrs[c], lens[c], out + 2 * c);
}
