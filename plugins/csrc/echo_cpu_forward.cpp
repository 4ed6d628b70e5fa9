// The target's row-wise forward work on the CPU in one pass per call: the RMS norm and the rotary embedding of q and
// k. Each replaces a chain of PyTorch operations (7 for the norm, 6 per rotated tensor) that read and write the
// rows again at every step; echo_trtllm/models/cpu_kernels.py calls them, and the eager PyTorch code stays the
// oracle (tests/models/test_cpu_kernels.py).
//
// Every element is rounded where the eager code rounds it (bfloat16: each product and sum computed in float32 and
// rounded to nearest even, as PyTorch's CPU kernels do; no fused multiply-adds), so the rotary embedding equals the
// eager one to the bit. The norm's sum of squares is the one reduction: summed here in 16 float32 lanes, then the
// lanes in pairs, so it can differ from PyTorch's order in the last bit of the mean (the tests bound it). Rows are
// independent: a row's result never depends on the other rows or on how many there are (batch-invariant mode).
//
// Built by scripts/setup.sh for the machine it runs on (-O3 -march=native -ffp-contract=off); without it the eager
// code runs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

enum Dtype : int32_t { kFloat32 = 0, kBFloat16 = 1 };

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// round to nearest even, NaN to the canonical quiet NaN (PyTorch's c10::BFloat16 conversion)
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);  // branch-free: vectorised
}

template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static float load(const float* p, int64_t i) { return p[i]; }
  static void store(float* p, int64_t i, float v) { p[i] = v; }
  static float round(float v) { return v; }
};

template <>
struct Elem<uint16_t> {
  static float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
  static void store(uint16_t* p, int64_t i, float v) { p[i] = float_to_bf16(v); }
  static float round(float v) { return bf16_to_float(float_to_bf16(v)); }
};

constexpr int kLanes = 16;

// out[r] = (x[r] * rsqrt(mean(x[r]^2) + eps)), rounded to T, times w, rounded to T: RMSNorm.forward's order. Each
// row is read twice (its sum of squares, then the output), no buffer: nothing here allocates or throws
template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* w, T* out, int64_t first, int64_t last, int64_t dim,
                   float eps) {
  for (int64_t r = first; r < last; ++r) {
    const T* __restrict xr = x + r * x_stride;
    float lanes[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= dim; i += kLanes)
      for (int j = 0; j < kLanes; ++j) {
        const float f = Elem<T>::load(xr, i + j);
        lanes[j] += f * f;
      }
    for (; i < dim; ++i) {
      const float f = Elem<T>::load(xr, i);
      lanes[i % kLanes] += f * f;
    }
    for (int half = kLanes / 2; half >= 1; half /= 2)
      for (int j = 0; j < half; ++j) lanes[j] += lanes[j + half];
    const float scale = 1.0f / std::sqrt(lanes[0] / static_cast<float>(dim) + eps);
    T* __restrict o = out + r * dim;
    for (i = 0; i < dim; ++i) Elem<T>::store(o, i, Elem<T>::round(Elem<T>::load(xr, i) * scale) * Elem<T>::load(w, i));
  }
}

// x (T, H, D): token t's heads at x + t * stride, head h at + h * D; cos, sin (T, D) contiguous; out (T, H, D)
// contiguous. out = x * cos + rotate_half(x) * sin, each product and the sum rounded to T (apply_rope's order)
template <typename T>
void rope_rows(const T* x, int64_t stride, int64_t heads, const T* cos, const T* sin, T* out, int64_t first,
               int64_t last, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t t = first; t < last; ++t) {
    const T* c = cos + t * dim;
    const T* s = sin + t * dim;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xh = x + t * stride + h * dim;
      T* o = out + (t * heads + h) * dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = Elem<T>::round(Elem<T>::load(xh, i) * Elem<T>::load(c, i));
        const float b = Elem<T>::round(-Elem<T>::load(xh, i + half) * Elem<T>::load(s, i));
        Elem<T>::store(o, i, a + b);
      }
      for (int64_t i = half; i < dim; ++i) {
        const float a = Elem<T>::round(Elem<T>::load(xh, i) * Elem<T>::load(c, i));
        const float b = Elem<T>::round(Elem<T>::load(xh, i - half) * Elem<T>::load(s, i));
        Elem<T>::store(o, i, a + b);
      }
    }
  }
}

// fn(first, last) over [0, rows) in `threads` contiguous parts (the caller's thread runs the first, and any part
// whose thread could not be started)
template <typename F>
void split_rows(int64_t rows, int32_t threads, F fn) {
  if (threads <= 1 || rows < 2) {
    fn(int64_t{0}, rows);
    return;
  }
  const int64_t parts = std::min<int64_t>(threads, rows);
  std::vector<std::thread> pool;
  int64_t started = 1;
  try {
    pool.reserve(static_cast<size_t>(parts - 1));
    for (; started < parts; ++started) pool.emplace_back(fn, rows * started / parts, rows * (started + 1) / parts);
  } catch (...) {  // no thread to be had: this thread runs the rest
  }
  fn(int64_t{0}, rows / parts);
  for (int64_t p = started; p < parts; ++p) fn(rows * p / parts, rows * (p + 1) / parts);
  for (auto& th : pool) th.join();
}

// fn(T{}) with T the element type of dtype (float, or bfloat16's bits as uint16_t); false for any other dtype
template <typename F>
bool by_dtype(int32_t dtype, F fn) {
  if (dtype == kFloat32) {
    fn(float{});
  } else if (dtype == kBFloat16) {
    fn(uint16_t{});
  } else {
    return false;
  }
  return true;
}

}  // namespace

extern "C" {

int echo_cpu_forward_version(void) { return 2; }

// 1 where this CPU has the instruction sets this build was compiled for (-march=native on another machine: a
// library copied there would stop the process on its first vector instruction), else 0. Compiled for the baseline
// x86-64 so that calling it is safe anywhere; other architectures: 1
#if defined(__GNUC__) && defined(__x86_64__)
__attribute__((target("arch=x86-64"))) int echo_cpu_forward_supported(void) {
  __builtin_cpu_init();
  int ok = 1;
#ifdef __SSE4_2__
  ok &= __builtin_cpu_supports("sse4.2") != 0;
#endif
#ifdef __AVX__
  ok &= __builtin_cpu_supports("avx") != 0;
#endif
#ifdef __AVX2__
  ok &= __builtin_cpu_supports("avx2") != 0;
#endif
#ifdef __FMA__
  ok &= __builtin_cpu_supports("fma") != 0;
#endif
#ifdef __BMI2__
  ok &= __builtin_cpu_supports("bmi2") != 0;
#endif
#ifdef __AVX512F__
  ok &= __builtin_cpu_supports("avx512f") != 0;
#endif
#ifdef __AVX512BW__
  ok &= __builtin_cpu_supports("avx512bw") != 0;
#endif
#ifdef __AVX512VL__
  ok &= __builtin_cpu_supports("avx512vl") != 0;
#endif
#ifdef __AVX512DQ__
  ok &= __builtin_cpu_supports("avx512dq") != 0;
#endif
  return ok;
}
#else
int echo_cpu_forward_supported(void) { return 1; }
#endif

// 0: done; -1: a bad argument (the Python wrapper checks them first, and runs the eager code on any other answer).
// Nothing below throws: the parts run on threads only where one can be started
int echo_rms_norm(const void* x, int64_t x_row_stride, const void* weight, void* out, int64_t rows, int64_t dim,
                  float eps, int32_t dtype, int32_t threads) {
  if (!x || !weight || !out || rows < 0 || dim < 1 || (rows > 1 && x_row_stride < dim)) return -1;
  const bool known = by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    split_rows(rows, threads, [&](int64_t a, int64_t b) {
      rms_norm_rows(static_cast<const T*>(x), x_row_stride, static_cast<const T*>(weight), static_cast<T*>(out), a, b,
                    dim, eps);
    });
  });
  return known ? 0 : -1;
}

// q (T, Hq, D) and k (T, Hk, D) rotated into q_out, k_out (contiguous), as apply_rope does each
int echo_rope_qk(const void* q, int64_t q_stride, int64_t q_heads, const void* k, int64_t k_stride, int64_t k_heads,
                 const void* cos, const void* sin, void* q_out, void* k_out, int64_t tokens, int64_t dim,
                 int32_t dtype, int32_t threads) {
  if (!q || !k || !cos || !sin || !q_out || !k_out || tokens < 0 || dim < 2 || dim % 2 || q_heads < 1 ||
      k_heads < 1 || q_stride < q_heads * dim || k_stride < k_heads * dim)
    return -1;
  const bool known = by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    split_rows(tokens, threads, [&](int64_t a, int64_t b) {
      rope_rows(static_cast<const T*>(q), q_stride, q_heads, static_cast<const T*>(cos), static_cast<const T*>(sin),
                static_cast<T*>(q_out), a, b, dim);
      rope_rows(static_cast<const T*>(k), k_stride, k_heads, static_cast<const T*>(cos), static_cast<const T*>(sin),
                static_cast<T*>(k_out), a, b, dim);
    });
  });
  return known ? 0 : -1;
}

}  // extern "C"
