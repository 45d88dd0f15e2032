/* Y = X·Wᵀ (+ bias) for a few rows of X, reading W once at memory speed: treespec.native_matmul.
 *
 * X: [M, K] row-major, W: [N, K] row-major (a torch Linear's weight), Y: [M, N] row-major, float32.
 * A tile is R rows of W times up to 4 rows of X: 4·R vector accumulators, each W vector loaded once
 * and multiplied into every X row (X stays in L1), so the product streams W from memory once for any
 * M ≤ 4 and re-reads the tile from L1 for each further 4 rows. The next tiles' rows are prefetched
 * while this one is summed. Vectors are GCC/Clang vector extensions: 16 floats, lowered to whatever
 * the compiling machine has (AVX-512, AVX2, NEON). Threads: OpenMP over tiles of W rows, as many as
 * the caller passes (torch's own thread count; torch's libgomp is the one loaded in the process).
 */
#include <stddef.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

#define R 4 /* rows of W per tile */
#define PREFETCH 1 /* tiles ahead */

static inline float hsum(v16 v) {
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

/* Y[m0 .. m0+mm, n .. n+rr] from a tile's accumulators (plus the products of the K % 16 remainder: float
 * W only, W NULL for blocks, whose K is a multiple of 32) */
static inline __attribute__((always_inline)) void finish(v16 acc[4][R], const float *X, const float *W, float *Y,
                                                         const float *bias, long n, long m0, int mm, int rr, long N,
                                                         long K, long K16) {
  if (rr == R && K16 == K) {
    /* a whole tile: each X row's 4 sums (one per W row) at once, by the same additions as hsum's (halves,
     * quarters, then pairs), so every output has the same bits as through hsum */
    for (int j = 0; j < mm; j++) {
      v16 t0 = __builtin_shufflevector(acc[j][0], acc[j][1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(acc[j][0], acc[j][1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
      v16 t1 = __builtin_shufflevector(acc[j][2], acc[j][3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(acc[j][2], acc[j][3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
      /* t0: W row 0's 8 partial sums, then W row 1's; t1: W rows 2 and 3 */
      v16 u = __builtin_shufflevector(t0, t1, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
              __builtin_shufflevector(t0, t1, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
      /* u: the 4 partial sums b0..b3 of each W row */
      v8 w = __builtin_shufflevector(u, u, 0, 1, 4, 5, 8, 9, 12, 13) + __builtin_shufflevector(u, u, 2, 3, 6, 7, 10, 11, 14, 15);
      /* w: (b0 + b2, b1 + b3) per W row; z: their sums */
      v4 z = __builtin_shufflevector(w, w, 0, 2, 4, 6) + __builtin_shufflevector(w, w, 1, 3, 5, 7);
      float *y = Y + (m0 + j) * N + n;
      for (int r = 0; r < R; r++) y[r] = z[r] + (bias ? bias[n + r] : 0.0f);
    }
    return;
  }
  for (int j = 0; j < mm; j++)
    for (int r = 0; r < rr; r++) {
      float s = hsum(acc[j][r]);
      for (long k = K16; k < K; k++) s += W[(n + r) * K + k] * X[(m0 + j) * K + k];
      Y[(m0 + j) * N + n + r] = s + (bias ? bias[n + r] : 0.0f);
    }
}


/* Y[m0 .. m0+mm, n .. n+rr] for constant mm ≤ 4, rr ≤ R (inlined per pair: accumulators in registers) */
static inline __attribute__((always_inline)) void tile(const float *X, const float *W, float *Y,
                                                       const float *bias, long n, long m0, int mm, int rr,
                                                       long N, long K, int prefetch) {
  v16 acc[4][R];
  long K16 = K & ~15L;
  for (int j = 0; j < mm; j++)
    for (int r = 0; r < rr; r++) acc[j][r] = (v16){0};
  for (long k = 0; k < K16; k += 16) {
    v16 w[R];
    for (int r = 0; r < rr; r++) w[r] = *(const v16 *)(W + (n + r) * K + k);
    if (prefetch)
      for (int r = 0; r < rr; r++) __builtin_prefetch(W + (n + PREFETCH * R + r) * K + k);
    for (int j = 0; j < mm; j++) {
      v16 x = *(const v16 *)(X + (m0 + j) * K + k);
      for (int r = 0; r < rr; r++) acc[j][r] += w[r] * x;
    }
  }
  finish(acc, X, W, Y, bias, n, m0, mm, rr, N, K, K16);
}

static inline __attribute__((always_inline)) void rows(const float *X, const float *W, float *Y,
                                                       const float *bias, long n, int rr, long M, long N,
                                                       long K) {
  long m0 = 0;
  for (; m0 + 4 <= M; m0 += 4) tile(X, W, Y, bias, n, m0, 4, rr, N, K, m0 == 0);
  switch (M - m0) {
  case 1: tile(X, W, Y, bias, n, m0, 1, rr, N, K, m0 == 0); break;
  case 2: tile(X, W, Y, bias, n, m0, 2, rr, N, K, m0 == 0); break;
  case 3: tile(X, W, Y, bias, n, m0, 3, rr, N, K, m0 == 0); break;
  }
}

/* the entry point: every pointer to contiguous float32 memory, bias NULL for none */
void treespec_few_rows(const float *X, const float *W, float *Y, const float *bias, long M, long N, long K,
                       int threads) {
  long tiles = N / R;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long t = 0; t < tiles; t++) rows(X, W, Y, bias, t * R, R, M, N, K);
  for (long n = tiles * R; n < N; n++) rows(X, W, Y, bias, n, 1, M, N, K);
}

/* ------------------------------------------------------------------ W as GGUF blocks, read as stored
 * A GGUF block holds 32 consecutive weights of one W row: Q4_1 as a scale d, a minimum m and 16 bytes
 * (byte i: weight i in its low nibble, weight 16 + i in its high one), w = d·q + m; Q8_0 as d and 32
 * signed bytes, w = d·q. d and m come as float32 arrays [N, K/32] beside q. d·q is exact in float32
 * (11 + 4 or 8 significant bits), so d·q + m rounds once however it is computed: each w has the bits of
 * the float32 weight gguf dequantises, and each block's two 16-weight halves are multiplied and summed
 * in the float kernel's order, so every output has the bits treespec_few_rows gives on those weights.
 * Reading 5 or 8.5 bits a weight instead of 32 is what makes it faster. */
enum { Q4_1 = 3, Q8_0 = 8 }; /* ggml's type numbers */
typedef unsigned char u8x16 __attribute__((vector_size(16), aligned(1)));
typedef int i32x16 __attribute__((vector_size(64)));
/* 16 bytes to 16 floats through 32-bit integers: a widening and a conversion (GCC converts a signed
 * byte vector lane by lane, so Q8_0's bytes are widened unsigned with their sign bit flipped) */
#define U8F(b) __builtin_convertvector(__builtin_convertvector((b), i32x16), v16)
#define S8F(b) __builtin_convertvector(__builtin_convertvector((b) ^ 128, i32x16) - 128, v16)

/* Y[m0 .. m0+mm, n .. n+rr] for W rows n .. n+rr given as blocks of `kind` */
static inline __attribute__((always_inline)) void block_tile(int kind, const float *X, const unsigned char *Q,
                                                             const float *D, const float *Mn, float *Y,
                                                             const float *bias, long n, long m0, int mm, int rr,
                                                             long N, long K, int prefetch) {
  v16 acc[4][R];
  long B = K / 32, row = kind == Q4_1 ? K / 2 : K; /* blocks and bytes per W row */
  const unsigned char *q0 = Q + n * row;
  for (int j = 0; j < mm; j++)
    for (int r = 0; r < rr; r++) acc[j][r] = (v16){0};
  for (long b = 0; b < B; b++) {
    v16 xa[4], xb[4]; /* the block's two halves of each X row */
    for (int j = 0; j < mm; j++) {
      xa[j] = *(const v16 *)(X + (m0 + j) * K + 32 * b);
      xb[j] = *(const v16 *)(X + (m0 + j) * K + 32 * b + 16);
    }
    for (int r = 0; r < rr; r++) {
      const unsigned char *q = q0 + r * row + (kind == Q4_1 ? 16 : 32) * b;
      float d = D[(n + r) * B + b];
      v16 lo, hi; /* the block's weights 0..15 and 16..31 */
      if (kind == Q4_1) {
        float m = Mn[(n + r) * B + b];
        u8x16 bytes = *(const u8x16 *)q;
        lo = d * U8F(bytes & 15) + m;
        hi = d * U8F(bytes >> 4) + m;
      } else {
        lo = d * S8F(*(const u8x16 *)q);
        hi = d * S8F(*(const u8x16 *)(q + 16));
      }
      for (int j = 0; j < mm; j++) {
        acc[j][r] += lo * xa[j];
        acc[j][r] += hi * xb[j];
      }
    }
    if (prefetch && (b & (kind == Q4_1 ? 3 : 1)) == 0) /* one 64-byte line ahead per W row */
      for (int r = 0; r < rr; r++) __builtin_prefetch(q0 + (PREFETCH * R + r) * row + (kind == Q4_1 ? 16 : 32) * b);
  }
  finish(acc, X, NULL, Y, bias, n, m0, mm, rr, N, K, K);
}

static inline __attribute__((always_inline)) void block_rows(int kind, const float *X, const unsigned char *Q,
                                                             const float *D, const float *Mn, float *Y,
                                                             const float *bias, long n, int rr, long M, long N,
                                                             long K) {
  long m0 = 0;
  for (; m0 + 4 <= M; m0 += 4) block_tile(kind, X, Q, D, Mn, Y, bias, n, m0, 4, rr, N, K, m0 == 0);
  switch (M - m0) {
  case 1: block_tile(kind, X, Q, D, Mn, Y, bias, n, m0, 1, rr, N, K, m0 == 0); break;
  case 2: block_tile(kind, X, Q, D, Mn, Y, bias, n, m0, 2, rr, N, K, m0 == 0); break;
  case 3: block_tile(kind, X, Q, D, Mn, Y, bias, n, m0, 3, rr, N, K, m0 == 0); break;
  }
}

/* the entry point for W as blocks: kind Q4_1 (Q: [N, K/2] bytes, D and Mn: [N, K/32]) or Q8_0 (Q: [N, K],
 * D: [N, K/32], Mn unused); K a multiple of 32; X, Y, bias as in treespec_few_rows */
void treespec_block_rows(int kind, const float *X, const unsigned char *Q, const float *D, const float *Mn, float *Y,
                         const float *bias, long M, long N, long K, int threads) {
  long tiles = N / R;
  /* one loop per kind, spelled out: GCC outlines an OpenMP loop before it inlines, so a loop in a helper
   * taking the kind as a constant compiles once, with the kind tested in the innermost loop */
  if (kind == Q4_1) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < tiles; t++) block_rows(Q4_1, X, Q, D, Mn, Y, bias, t * R, R, M, N, K);
    for (long n = tiles * R; n < N; n++) block_rows(Q4_1, X, Q, D, Mn, Y, bias, n, 1, M, N, K);
  } else {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < tiles; t++) block_rows(Q8_0, X, Q, D, Mn, Y, bias, t * R, R, M, N, K);
    for (long n = tiles * R; n < N; n++) block_rows(Q8_0, X, Q, D, Mn, Y, bias, n, 1, M, N, K);
  }
}
