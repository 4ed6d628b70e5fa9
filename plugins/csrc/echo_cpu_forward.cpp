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

// out[r] = (x[r] * rsqrt(mean(x[r]^2) + eps)), rounded to T, times w, rounded to T: RMSNorm.forward's order
template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* w, T* out, int64_t first, int64_t last, int64_t dim,
                   float eps) {
  thread_local std::vector<float> row;  // one row in float32, kept between calls
  row.resize(static_cast<size_t>(dim));
  for (int64_t r = first; r < last; ++r) {
    const T* xr = x + r * x_stride;
    float lanes[kLanes] = {};
    int64_t i = 0;
    for (; i < dim; ++i) row[i] = Elem<T>::load(xr, i);
    for (i = 0; i + kLanes <= dim; i += kLanes)
      for (int j = 0; j < kLanes; ++j) lanes[j] += row[i + j] * row[i + j];
    for (; i < dim; ++i) lanes[i % kLanes] += row[i] * row[i];
    for (int half = kLanes / 2; half >= 1; half /= 2)
      for (int j = 0; j < half; ++j) lanes[j] += lanes[j + half];
    const float scale = 1.0f / std::sqrt(lanes[0] / static_cast<float>(dim) + eps);
    T* o = out + r * dim;
    for (i = 0; i < dim; ++i) Elem<T>::store(o, i, Elem<T>::round(row[i] * scale) * Elem<T>::load(w, i));
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

// fn(first, last) over [0, rows) in `threads` contiguous parts (the caller's thread runs the first)
template <typename F>
void split_rows(int64_t rows, int32_t threads, F fn) {
  if (threads <= 1 || rows < 2) {
    fn(int64_t{0}, rows);
    return;
  }
  const int64_t parts = std::min<int64_t>(threads, rows);
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(parts - 1));
  for (int64_t p = 1; p < parts; ++p) pool.emplace_back(fn, rows * p / parts, rows * (p + 1) / parts);
  fn(int64_t{0}, rows / parts);
  for (auto& th : pool) th.join();
}

}  // namespace

extern "C" {

int echo_cpu_forward_version(void) { return 1; }

// 0: done; -1: a bad argument (the Python wrapper checks them first)
int echo_rms_norm(const void* x, int64_t x_row_stride, const void* weight, void* out, int64_t rows, int64_t dim,
                  float eps, int32_t dtype, int32_t threads) {
  if (!x || !weight || !out || rows < 0 || dim < 1 || x_row_stride < dim) return -1;
  if (dtype == kFloat32) {
    split_rows(rows, threads, [&](int64_t a, int64_t b) {
      rms_norm_rows(static_cast<const float*>(x), x_row_stride, static_cast<const float*>(weight),
                    static_cast<float*>(out), a, b, dim, eps);
    });
  } else if (dtype == kBFloat16) {
    split_rows(rows, threads, [&](int64_t a, int64_t b) {
      rms_norm_rows(static_cast<const uint16_t*>(x), x_row_stride, static_cast<const uint16_t*>(weight),
                    static_cast<uint16_t*>(out), a, b, dim, eps);
    });
  } else {
    return -1;
  }
  return 0;
}

// q (T, Hq, D) and k (T, Hk, D) rotated into q_out, k_out (contiguous), as apply_rope does each
int echo_rope_qk(const void* q, int64_t q_stride, int64_t q_heads, const void* k, int64_t k_stride, int64_t k_heads,
                 const void* cos, const void* sin, void* q_out, void* k_out, int64_t tokens, int64_t dim,
                 int32_t dtype, int32_t threads) {
  if (!q || !k || !cos || !sin || !q_out || !k_out || tokens < 0 || dim < 2 || dim % 2 || q_heads < 1 ||
      k_heads < 1 || q_stride < q_heads * dim || k_stride < k_heads * dim)
    return -1;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    split_rows(tokens, threads, [&](int64_t a, int64_t b) {
      rope_rows(static_cast<const T*>(q), q_stride, q_heads, static_cast<const T*>(cos), static_cast<const T*>(sin),
                static_cast<T*>(q_out), a, b, dim);
      rope_rows(static_cast<const T*>(k), k_stride, k_heads, static_cast<const T*>(cos), static_cast<const T*>(sin),
                static_cast<T*>(k_out), a, b, dim);
    });
  };
  if (dtype == kFloat32) {
    run(float{});
  } else if (dtype == kBFloat16) {
    run(uint16_t{});
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
