// CPU kernels of the `inkling` ops. The schemas are defined in Python (custom_ops/library.py); this
// file only registers CPU implementations. Built with -ffp-contract=off so that every product and sum
// rounds exactly as the plain-torch references do: the conv kernels are bit-identical to them.
#include <ATen/ATen.h>
#include <ATen/CPUFunctions.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <string>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <shared_mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

// Stream names, in the order of inkling_compiled/streams.py (STREAM_NAMES), which is the one place
// they are defined: library.native_kernels() passes them in as -DINKLING_STREAM_NAMES=k,v,...
#ifndef INKLING_STREAM_NAMES
#error "build through inkling_compiled.custom_ops.library.native_kernels(), which defines INKLING_STREAM_NAMES"
#endif
#define INKLING_STRINGIFY(...) #__VA_ARGS__
#define INKLING_EXPAND_STRINGIFY(...) INKLING_STRINGIFY(__VA_ARGS__)

const std::vector<std::string>& stream_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    const std::string all = INKLING_EXPAND_STRINGIFY(INKLING_STREAM_NAMES);
    size_t start = 0;
    while (start <= all.size()) {
      size_t end = all.find(',', start);
      if (end == std::string::npos) end = all.size();
      std::string name = all.substr(start, end - start);
      name.erase(0, name.find_first_not_of(' '));
      out.push_back(name);
      start = end + 1;
    }
    return out;
  }();
  return names;
}

// A `sconv S @ layer L` range for torch.profiler, also when the call comes from a compiled graph's
// replay (no Python runs per layer there). Costs one flag check when nothing is recording.
struct ConvRange {
  std::string label;
  at::RecordFunction guard{at::RecordScope::USER_SCOPE};
  ConvRange(int64_t layer_id, int64_t stream) {
    if (layer_id < 0 || !guard.isActive()) return;
    const auto& names = stream_names();
    const bool known = stream >= 0 && stream < static_cast<int64_t>(names.size());
    label = "sconv " + (known ? names[stream] : std::string("?")) + " @ layer " + std::to_string(layer_id);
    guard.before(std::string_view(label));
  }
};

// Items per task of the intra-op pool when each item costs `per_item` multiply-adds: enough that a
// task outweighs waking a thread. Every kernel splits over items whose results do not depend on one
// another, so the split (and the thread count) never changes a result.
int64_t task_grain(int64_t per_item) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, per_item)); }

// t in `dtype`: itself where it is already (Tensor::to would go through the dispatcher to say so, a few
// hundred nanoseconds a call, and a decode step passes some hundred index and weight tensors).
at::Tensor in_dtype(const at::Tensor& t, at::ScalarType dtype) { return t.scalar_type() == dtype ? t : t.to(dtype); }

// A tensor of int32 or int64 values as int64s, plus `offset`, read where it lies: a step's slot ids and
// lengths are int32, and a converted copy per call would be a tensor allocated and filled for each layer.
std::vector<int64_t> indices_of(const at::Tensor& t_in, int64_t offset) {
  const at::Tensor t = t_in.dim() == 1 ? t_in : t_in.reshape({-1});
  const int64_t n = t.size(0), stride = t.stride(0);
  std::vector<int64_t> out(n);
  if (t.scalar_type() == at::kInt) {
    const int32_t* p = t.data_ptr<int32_t>();
    for (int64_t i = 0; i < n; ++i) out[i] = p[i * stride] + offset;
  } else {
    const auto wide = in_dtype(t, at::kLong);  // (int64 as it is; anything else converted)
    const int64_t* p = wide.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) out[i] = p[i * wide.stride(0)] + offset;
  }
  return out;
}

void check_state(const at::Tensor& state, const at::Tensor& x) {
  TORCH_CHECK(state.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat,
              "inkling conv kernels take fp32 inputs and fp32 state");
  TORCH_CHECK(state.dim() == 3 && state.stride(2) == 1, "conv state must be [slots, K-1, D] with unit channel stride");
}

// The conv taps [D, K] by position ([K, D]: tap k of every channel together), so that the conv loops run
// along channels and vectorise. A weight stored by position (strides (1, D), as the loader stores the
// convs on CPU) is read where it lies; any other is transposed into `scratch` (a scalar gather that cost
// a batch-1 decode step about a third of its conv time).
const float* taps_by_position(const at::Tensor& weight, int64_t D, std::vector<float>& scratch) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == D, "inkling conv kernels take the weight as [channels, taps], ",
              D, " channels");
  const int64_t K = weight.size(1);
  if (weight.scalar_type() == at::kFloat && (D == 1 || weight.stride(0) == 1) && (K == 1 || weight.stride(1) == D))
    return weight.data_ptr<float>();
  const auto w = in_dtype(weight, at::kFloat).contiguous();
  const float* wp = w.data_ptr<float>();
  scratch.resize(K * D);
  for (int64_t d = 0; d < D; ++d)
    for (int64_t k = 0; k < K; ++k) scratch[k * D + d] = wp[d * K + k];
  return scratch.data();
}

// x [T, D] with its rows where they lie: only its channels need be contiguous. A conv's input is often a
// part of a stacked projection's output (k or v of the q/k/v/r rows), a view whose rows are strided, and
// copying it would cost a tensor allocated and filled per call.
at::Tensor rows_in_place(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "inkling conv kernels take x as [tokens, channels]");
  return x.stride(1) == 1 ? x : x.contiguous();
}

// y[b] = sum over the window [state[slot] (K-1 rows), x[b]] of tap * weight; then the window shifts in x[b].
at::Tensor sconv_decode(const at::Tensor& x_in, at::Tensor state, const at::Tensor& weight_in,
                        const at::Tensor& cache_indices, int64_t layer_id, int64_t stream) {
  ConvRange range(layer_id, stream);
  check_state(state, x_in);
  const auto x = rows_in_place(x_in);
  const auto idx = in_dtype(cache_indices, at::kInt).contiguous();
  const int64_t B = x.size(0), D = x.size(1), K = weight_in.size(1), xs = x.stride(0);
  auto y = at::empty({B, D}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  const int32_t* ip = idx.data_ptr<int32_t>();
  const int64_t s0 = state.stride(0), s1 = state.stride(1);
  thread_local std::vector<float> by_position;  // kept with the thread: a decode step allocates nothing
  const float* taps = taps_by_position(weight_in, D, by_position);
  // Channels are independent: split over the intra-op pool by channel ranges.
  at::parallel_for(0, D, task_grain(B * K), [&](int64_t d0, int64_t d1) {
    for (int64_t b = 0; b < B; ++b) {
      float* __restrict win = sp + ip[b] * s0;
      const float* __restrict xb = xp + b * xs;
      float* __restrict yb = yp + b * D;
      const float* __restrict last = taps + (K - 1) * D;
      for (int64_t d = d0; d < d1; ++d) yb[d] = xb[d] * last[d];
      for (int64_t back = 1; back < K; ++back) {  // each channel's terms in the reference's order
        const float* __restrict held = win + (K - 1 - back) * s1;
        const float* __restrict tap = taps + (K - 1 - back) * D;
        for (int64_t d = d0; d < d1; ++d) yb[d] = yb[d] + held[d] * tap[d];
      }
      for (int64_t j = 0; j + 1 < K - 1; ++j) {
        float* __restrict to = win + j * s1;
        const float* __restrict from = win + (j + 1) * s1;
        for (int64_t d = d0; d < d1; ++d) to[d] = from[d];
      }
      if (K > 1) std::memcpy(win + (K - 2) * s1 + d0, xb + d0, (d1 - d0) * sizeof(float));
    }
  });
  return y;
}

// Packed varlen conv with each sequence's history (its slot window where has_initial_state, else zeros);
// afterwards the slot holds the last K-1 inputs of [history ++ tokens].
at::Tensor sconv_extend(const at::Tensor& x_in, at::Tensor state, const at::Tensor& weight_in,
                        const at::Tensor& query_start_loc, const at::Tensor& has_initial_state,
                        const at::Tensor& cache_indices, int64_t layer_id, int64_t stream) {
  ConvRange range(layer_id, stream);
  check_state(state, x_in);
  const auto x = rows_in_place(x_in);
  const std::vector<int64_t> qsl = indices_of(query_start_loc, 0);
  const auto his = in_dtype(has_initial_state, at::kBool).contiguous();
  const auto idx = in_dtype(cache_indices, at::kInt).contiguous();
  const int64_t B = idx.size(0), D = x.size(1), K = weight_in.size(1), H = K - 1, xs = x.stride(0);
  TORCH_CHECK(static_cast<int64_t>(qsl.size()) > B,
              "sconv_extend: query_start_loc needs an entry per sequence and one more");
  auto y = at::empty({x.size(0), D}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  const int64_t* qp = qsl.data();
  const bool* hp = his.data_ptr<bool>();
  const int32_t* ip = idx.data_ptr<int32_t>();
  const int64_t s0 = state.stride(0), s1 = state.stride(1);
  const int64_t tokens = x.size(0);
  std::vector<float> by_position;
  const float* taps = taps_by_position(weight_in, D, by_position);
  at::parallel_for(0, D, task_grain(std::max<int64_t>(1, tokens) * K), [&](int64_t d0, int64_t d1) {
    std::vector<float> hist(H * D);  // each sequence's history, for this task's channels
    for (int64_t b = 0; b < B; ++b) {
      float* win = sp + ip[b] * s0;
      for (int64_t j = 0; j < H; ++j)
        for (int64_t d = d0; d < d1; ++d) hist[j * D + d] = hp[b] ? win[j * s1 + d] : 0.0f;
      const int64_t start = qp[b], end = qp[b + 1];
      // The input row at token src: this chunk's own, or the history before it.
      auto row = [&](int64_t src) -> const float* {
        return src >= start ? xp + src * xs : hist.data() + (H - (start - src)) * D;
      };
      for (int64_t t = start; t < end; ++t) {
        const float* __restrict xt = xp + t * xs;
        const float* __restrict last = taps + (K - 1) * D;
        float* __restrict yt = yp + t * D;
        for (int64_t d = d0; d < d1; ++d) yt[d] = xt[d] * last[d];
        for (int64_t back = 1; back < K; ++back) {
          const float* __restrict held = row(t - back);
          const float* __restrict tap = taps + (K - 1 - back) * D;
          for (int64_t d = d0; d < d1; ++d) yt[d] = yt[d] + held[d] * tap[d];
        }
      }
      for (int64_t j = 0; j < H; ++j) std::memcpy(win + j * s1 + d0, row(end - H + j) + d0, (d1 - d0) * sizeof(float));
    }
  });
  return y;
}

// Speculative verify: each row's T tokens continue its slot's window, which is only read; windows[b, t]
// receives the K-1 inputs ending at the row's token t. Same tap order as sconv_decode.
at::Tensor sconv_verify(const at::Tensor& x_in, const at::Tensor& state, const at::Tensor& weight_in,
                        const at::Tensor& cache_indices, at::Tensor windows, int64_t layer_id, int64_t stream) {
  ConvRange range(layer_id, stream);
  check_state(state, x_in);
  TORCH_CHECK(windows.scalar_type() == at::kFloat && windows.dim() == 4 && windows.stride(3) == 1,
              "sconv_verify: windows must be fp32 [rows, T, K-1, D] with unit channel stride");
  const auto x = rows_in_place(x_in);
  const auto idx = in_dtype(cache_indices, at::kInt).contiguous();
  const int64_t B = idx.size(0), T = windows.size(1), D = x.size(1), K = weight_in.size(1), H = K - 1, xs = x.stride(0);
  TORCH_CHECK(x.size(0) == B * T && windows.size(0) >= B && windows.size(2) == H && windows.size(3) == D,
              "sconv_verify: x must hold T tokens per row and windows one [K-1, D] window per (row, token)");
  TORCH_CHECK(state.size(1) == H && state.size(2) == D, "sconv_verify: state windows must be [K-1, D] = [", H, ", ",
              D, "]");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t slot = idx.data_ptr<int32_t>()[b];
    TORCH_CHECK(slot >= 0 && slot < state.size(0), "sconv_verify: bad slot ", slot);
  }
  auto y = at::empty({x.size(0), D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* sp = state.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* vp = windows.data_ptr<float>();
  const int32_t* ip = idx.data_ptr<int32_t>();
  const int64_t s0 = state.stride(0), s1 = state.stride(1);
  const int64_t v0 = windows.stride(0), v1 = windows.stride(1), v2 = windows.stride(2);
  thread_local std::vector<float> by_position;  // kept with the thread: a verify step allocates nothing here
  const float* taps = taps_by_position(weight_in, D, by_position);
  // Rows are independent: split over the intra-op pool by rows. Each token's terms are summed along
  // channels (vectorised) in sconv_decode's order, reading the slot's window and the row's tokens where
  // they lie.
  at::parallel_for(0, B, task_grain(T * D * K), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* win = sp + ip[b] * s0;
      const float* xb = xp + b * T * xs;
      // The input at token src of the row: its own for src >= 0, else the slot's window (H rows before).
      auto input = [&](int64_t src) -> const float* { return src >= 0 ? xb + src * xs : win + (H + src) * s1; };
      for (int64_t t = 0; t < T; ++t) {
        const float* __restrict xt = xb + t * xs;
        const float* __restrict last = taps + (K - 1) * D;
        float* __restrict yt = yp + (b * T + t) * D;
        for (int64_t d = 0; d < D; ++d) yt[d] = xt[d] * last[d];
        for (int64_t back = 1; back < K; ++back) {
          const float* __restrict held = input(t - back);
          const float* __restrict tap = taps + (K - 1 - back) * D;
          for (int64_t d = 0; d < D; ++d) yt[d] = yt[d] + held[d] * tap[d];
        }
        for (int64_t j = 0; j < H; ++j)
          std::memcpy(vp + b * v0 + t * v1 + j * v2, input(t + 1 + j - H), D * sizeof(float));
      }
    }
  });
  return y;
}

// After a verify: for each row i with steps[i] >= 0, the window of slots[i] in each (stream, layer) tensor
// becomes the one saved after token steps[i] (states[s] [slots, K-1, D], windows[s] [rows, T, K-1, D]: the
// pool's own per-layer tensors, so a caller passes them as they are).
void commit_conv_windows(at::TensorList states, at::TensorList windows, const at::Tensor& slots_in,
                         const at::Tensor& steps_in) {
  TORCH_CHECK(states.size() == windows.size(), "commit_conv_windows: one window tensor per state tensor");
  TORCH_CHECK(slots_in.numel() == steps_in.numel(), "commit_conv_windows: one step per slot");
  const auto slots = in_dtype(slots_in, at::kLong).contiguous();
  const auto steps = in_dtype(steps_in, at::kLong).contiguous();
  const int64_t n = slots.numel();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* step = steps.data_ptr<int64_t>();
  // Every check before any copy: a refused commit leaves every slot as it was.
  for (size_t s = 0; s < states.size(); ++s) {
    const at::Tensor& state = states[s];
    const at::Tensor& saved = windows[s];
    TORCH_CHECK(state.scalar_type() == at::kFloat && saved.scalar_type() == at::kFloat && state.dim() == 3 &&
                saved.dim() == 4, "commit_conv_windows: fp32 states [slots, K-1, D] and windows [rows, T, K-1, D]");
    TORCH_CHECK(saved.size(2) == state.size(1) && saved.size(3) == state.size(2),
                "commit_conv_windows: windows and states disagree on the window shape");
    const int64_t D = state.size(2);
    TORCH_CHECK(state.stride(2) == 1 && state.stride(1) == D && saved.stride(3) == 1 && saved.stride(2) == D,
                "commit_conv_windows: each window must be one contiguous run of (K-1)*D values");
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(step[i] < 0 || (slot[i] >= 0 && slot[i] < state.size(0) && step[i] < saved.size(1) &&
                                  i < saved.size(0)),
                  "commit_conv_windows: slot ", slot[i], " or step ", step[i], " out of range");
  }
  for (size_t s = 0; s < states.size(); ++s) {
    at::Tensor state = states[s];
    const at::Tensor& saved = windows[s];
    const int64_t window = state.size(1) * state.size(2);
    float* sp = state.data_ptr<float>();
    const float* wp = saved.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      if (step[i] < 0) continue;
      std::memcpy(sp + slot[i] * state.stride(0), wp + i * saved.stride(0) + step[i] * saved.stride(1),
                  window * sizeof(float));
    }
  }
}

// A conv stream's prefix-cache checkpoints (custom_ops/checkpoint.py has the reference): checkpoint i of
// row r saves in saved[layer, checkpoint_indices[i]] the K-1 inputs before packed token
// checkpoint_ends[i], the row's own from query_start_loc[r] on and its slot's window before them (zeros
// for a row without initial state). One row copy per saved input, split over the checkpoints. The
// reference's dozen small gathers and selects cost 0.3-0.45 ms a call, and a 1,024-token prompt
// prefilled in chunks of 256 makes 128 of them.
void sconv_checkpoint(const at::Tensor& x_in, const at::Tensor& state_in, at::Tensor saved, int64_t layer,
                      const at::Tensor& cache_indices, const at::Tensor& has_initial_state,
                      const at::Tensor& query_start_loc, const at::Tensor& checkpoint_rows,
                      const at::Tensor& checkpoint_ends, const at::Tensor& checkpoint_indices) {
  const int64_t n = checkpoint_rows.size(0), K1 = state_in.size(1), T = x_in.size(0);
  if (n == 0 || K1 == 0) return;
  const auto longs = [](const at::Tensor& t) { return in_dtype(t, at::kLong).contiguous(); };
  const auto rows_t = longs(checkpoint_rows), ends_t = longs(checkpoint_ends), into_t = longs(checkpoint_indices),
             qsl_t = longs(query_start_loc), slots_t = longs(cache_indices);
  const auto initial_t = in_dtype(has_initial_state, at::kBool).contiguous();
  const int64_t *rows = rows_t.data_ptr<int64_t>(), *ends = ends_t.data_ptr<int64_t>(),
                *into = into_t.data_ptr<int64_t>(), *qsl = qsl_t.data_ptr<int64_t>(), *slots = slots_t.data_ptr<int64_t>();
  const bool* initial = initial_t.data_ptr<bool>();
  TORCH_CHECK(x_in.dim() == 2 && state_in.dim() == 3 && saved.dim() == 4 && state_in.size(2) == x_in.size(1) &&
                  saved.size(2) == K1 && saved.size(3) == x_in.size(1),
              "sconv_checkpoint: x [T, D], state [slots, K-1, D] and saved [layers, checkpoints, K-1, D] expected");
  TORCH_CHECK(ends_t.size(0) == n && into_t.size(0) == n, "sconv_checkpoint: one end and one index per checkpoint");
  TORCH_CHECK(layer >= 0 && layer < saved.size(0), "sconv_checkpoint: layer ", layer, " out of range");
  // Everything checked before anything is written (as ring_checkpoint does).
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = rows[i];
    TORCH_CHECK(row >= 0 && row + 1 < qsl_t.size(0) && row < slots_t.size(0) && row < initial_t.size(0) &&
                    qsl[row] >= 0 && qsl[row] <= T,
                "sconv_checkpoint: checkpoint ", i, " names row ", row, ", which this chunk does not have");
    TORCH_CHECK(into[i] >= 0 && into[i] < saved.size(1), "sconv_checkpoint: checkpoint index ", into[i], " out of range");
    TORCH_CHECK(ends[i] - 1 < qsl[row] || T > 0, "sconv_checkpoint: checkpoint ", i, " reads a chunk of no tokens");
    TORCH_CHECK(ends[i] - K1 >= qsl[row] || !initial[row] || (slots[row] >= 0 && slots[row] < state_in.size(0)),
                "sconv_checkpoint: slot ", slots[row], " out of range");
  }
  const auto dtype = saved.scalar_type();
  // Inputs in the checkpoints' dtype: converting one directly gives what the reference's promotion to
  // fp32 (exact for the window's bf16) and cast give.
  const auto x = in_dtype(x_in, dtype).contiguous();
  const auto state = in_dtype(state_in, dtype).contiguous();
  TORCH_CHECK(saved.stride(3) == 1, "sconv_checkpoint: checkpoints of contiguous rows of D expected");
  const int64_t esize = saved.element_size(), bytes = x.size(1) * esize;
  const auto* from_chunk = static_cast<const char*>(x.data_ptr());
  const auto* from_state = static_cast<const char*>(state.data_ptr());
  auto* out = static_cast<char*>(saved.data_ptr()) + layer * saved.stride(0) * esize;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = rows[i], start = qsl[row];
      for (int64_t j = 0; j < K1; ++j) {
        const int64_t p = ends[i] - K1 + j;  // the packed token this entry holds
        char* dst = out + (into[i] * saved.stride(1) + j * saved.stride(2)) * esize;
        if (p >= start) {
          std::memcpy(dst, from_chunk + std::min(std::max<int64_t>(p, 0), T - 1) * bytes, bytes);
        } else if (initial[row]) {
          const int64_t w = std::min(std::max<int64_t>(K1 + p - start, 0), K1 - 1);
          std::memcpy(dst, from_state + (slots[row] * K1 + w) * bytes, bytes);
        } else {
          std::memset(dst, 0, bytes);
        }
      }
    }
  });
}

// A sliding layer's prefix-cache checkpoints (custom_ops/checkpoint.py has the reference): checkpoint i
// of row r saves in saved[layer] the ring as it stands at boundary b, laid out as a slot's ring holds
// it (position p at entry p % R): the `window` positions before b, from the row's ring before the
// chunk's first position and from the chunk's keys after it; every other entry zero. One row copy per
// entry, split over the checkpoints. The reference's gathers, selects and scatter of whole [n, R, heads,
// hd] tensors took about a sixth of a 32-prompt prefill of `small`.
void ring_checkpoint(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_ring, const at::Tensor& v_ring,
                     at::Tensor k_saved, at::Tensor v_saved, int64_t layer, const at::Tensor& query_start_loc,
                     const at::Tensor& positions, const at::Tensor& cache_indices, const at::Tensor& checkpoint_rows,
                     const at::Tensor& checkpoint_boundaries, const at::Tensor& checkpoint_indices, int64_t ring_size,
                     int64_t window) {
  const int64_t n = checkpoint_rows.size(0), R = ring_size, T = k.size(0);
  if (n == 0) return;
  const auto longs = [](const at::Tensor& t) { return in_dtype(t, at::kLong).contiguous(); };
  const auto rows_t = longs(checkpoint_rows), bounds_t = longs(checkpoint_boundaries), into_t = longs(checkpoint_indices),
             qsl_t = longs(query_start_loc), pos_t = longs(positions), slots_t = longs(cache_indices);
  const int64_t *rows = rows_t.data_ptr<int64_t>(), *bounds = bounds_t.data_ptr<int64_t>(),
                *into = into_t.data_ptr<int64_t>(), *qsl = qsl_t.data_ptr<int64_t>(), *pos = pos_t.data_ptr<int64_t>(),
                *slots = slots_t.data_ptr<int64_t>();
  // Everything checked before anything is written. Two checkpoints with one index would race (the
  // reference's scatter is as undefined there); the engine's checkpoints each have their own.
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = rows[i];
    TORCH_CHECK(row >= 0 && row + 1 < qsl_t.size(0) && row < slots_t.size(0) && qsl[row] >= 0 && qsl[row] < T,
                "ring_checkpoint: checkpoint ", i, " names row ", row, ", which has no tokens in this chunk");
    const int64_t start = qsl[row], slot = slots[row];
    TORCH_CHECK(start < pos_t.size(0), "ring_checkpoint: ", pos_t.size(0), " positions for a chunk of ", T, " tokens");
    TORCH_CHECK(into[i] >= 0 && (into[i] + 1) * R <= k_saved.size(1) && (into[i] + 1) * R <= v_saved.size(1),
                "ring_checkpoint: checkpoint index ", into[i], " out of range");
    TORCH_CHECK(bounds[i] - window >= pos[start] ||  // every entry from the chunk, or zero
                    (slot >= 0 && (slot + 1) * R <= k_ring.size(0) && (slot + 1) * R <= v_ring.size(0)),
                "ring_checkpoint: slot ", slot, " out of range");
  }
  TORCH_CHECK(layer >= 0 && layer < k_saved.size(0) && layer < v_saved.size(0), "ring_checkpoint: layer ", layer,
              " out of range");
  for (int kv = 0; kv < 2; ++kv) {
    at::Tensor saved = kv ? v_saved : k_saved;
    const auto dtype = saved.scalar_type();
    // Rows in the saved tensor's dtype: converting a key to it directly gives what the reference's
    // promotion and cast give.
    const auto chunk = in_dtype(kv ? v : k, dtype).contiguous();
    const auto& ring_in = kv ? v_ring : k_ring;
    const auto ring = in_dtype(ring_in, dtype);
    const int64_t row = chunk.size(1) * chunk.size(2), bytes = row * chunk.element_size();
    for (const at::Tensor& t : std::initializer_list<at::Tensor>{ring, saved})
      TORCH_CHECK(t.size(-1) * t.size(-2) == row && t.stride(-1) == 1 && t.stride(-2) == t.size(-1),
                  "ring_checkpoint: rings and checkpoints of contiguous [heads, head_dim] rows expected");
    const auto* from_chunk = static_cast<const char*>(chunk.data_ptr());
    const auto* from_ring = static_cast<const char*>(ring.data_ptr());
    const int64_t ring_stride = ring.stride(0) * ring.element_size(), saved_stride = saved.stride(1) * saved.element_size();
    auto* out = static_cast<char*>(saved.data_ptr()) + layer * saved.stride(0) * saved.element_size();
    at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t start = qsl[rows[i]], first = pos[start], oldest = bounds[i] - window;
        for (int64_t e = 0; e < R; ++e) {
          const int64_t offset = ((e - oldest) % R + R) % R, p = oldest + offset;
          char* dst = out + (into[i] * R + e) * saved_stride;
          if (offset >= window || p < 0) {
            std::memset(dst, 0, bytes);
          } else if (p >= first) {
            const int64_t t = std::min(std::max<int64_t>(start + p - first, 0), T - 1);
            std::memcpy(dst, from_chunk + t * bytes, bytes);
          } else {
            std::memcpy(dst, from_ring + (slots[rows[i]] * R + e) * ring_stride, bytes);
          }
        }
      }
    });
  }
}

// Copies rows k[t], v[t] to cache location locations[t]; negative locations are skipped.
void kv_write(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k_in, const at::Tensor& v_in,
              const at::Tensor& locations) {
  const auto loc = in_dtype(locations, at::kLong).contiguous();
  TORCH_CHECK(loc.numel() == k_in.size(0) && v_in.size(0) == k_in.size(0),
              "kv_write: one location per key and value row expected");
  const int64_t* at_row = loc.data_ptr<int64_t>();
  for (int64_t t = 0; t < loc.numel(); ++t)  // every row checked before any is written
    TORCH_CHECK(at_row[t] < k_cache.size(0) && at_row[t] < v_cache.size(0), "kv_write: row ", t,
                " goes to cache row ", at_row[t], " of ", std::min(k_cache.size(0), v_cache.size(0)));
  const bool rows_contiguous = k_cache.stride(2) == 1 && k_cache.stride(1) == k_cache.size(2) &&
                               v_cache.stride(2) == 1 && v_cache.stride(1) == v_cache.size(2) &&
                               k_cache.scalar_type() == k_in.scalar_type() &&
                               v_cache.scalar_type() == v_in.scalar_type() && k_in.dim() == 3 && v_in.dim() == 3 &&
                               k_in.size(1) == k_cache.size(1) && k_in.size(2) == k_cache.size(2) &&
                               v_in.size(1) == v_cache.size(1) && v_in.size(2) == v_cache.size(2);
  if (!rows_contiguous) {  // (index_copy_ refuses rows of another shape)
    const auto keep = loc.ge(0);
    const auto where = loc.masked_select(keep);
    k_cache.index_copy_(0, where, k_in.index({keep}));
    v_cache.index_copy_(0, where, v_in.index({keep}));
    return;
  }
  const auto k = k_in.contiguous(), v = v_in.contiguous();
  const int64_t k_row = k.size(1) * k.size(2) * k.element_size(), v_row = v.size(1) * v.size(2) * v.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks0 = k_cache.stride(0) * k_cache.element_size(), vs0 = v_cache.stride(0) * v_cache.element_size();
  for (int64_t t = 0; t < loc.numel(); ++t) {
    if (at_row[t] < 0) continue;
    std::memcpy(kc + at_row[t] * ks0, kp + t * k_row, k_row);
    std::memcpy(vc + at_row[t] * vs0, vp + t * v_row, v_row);
  }
}

// Decode attention of one query per row over its paged keys (global layers): the recipe of
// inkling_compiled/attention.py (band bias, log scale tau, 1/hd, fp32 softmax). fp32 or bf16 tensors;
// the arithmetic is fp32 either way. In bf16 each intermediate that attend() (and transformers) keeps
// in bf16 is rounded to bf16 where attend() rounds it: q*tau, the q.k dot (summed in fp32), its 1/hd
// product, bias*tau and the score sum; the softmax is ATen's fp32 softmax of the rounded scores, its
// probabilities rounded to bf16; p.v is summed in fp32 and the output rounded once, as ATen's bf16
// matmul does.
// fp32 decode attention's pieces (see group_dots_body and below), built per instruction set with the
// matmul.
void fp32_group_dots(const float* q, int64_t g, int64_t hd, const float* base, int64_t stride, const int64_t* loc,
                     int64_t n, float* s);
void fp32_group_values(const float* p, int64_t g, int64_t n, const float* base, int64_t stride, const int64_t* loc,
                       int64_t hd, float* acc);
void fp32_softmax_rows(float* s, const float* bias, int64_t g, int64_t n, float scale);
// fp32 prefill attention's tiles (see kTileLanes below), built for AVX-512 only: their 16 vectors of
// accumulators need its 32 registers (the AVX2 build, tried, took 726-821 ms a global layer of
// `small` at 1,024 tokens in tiles against 232-286 per query). Whether this CPU runs that build.
bool fp32_tiles_built();
void fp32_tile_scores(const float* qt, int64_t hd, const float* k, int64_t ks, int64_t n, float scale, float* s);
void fp32_tile_softmax_values(float* s, int64_t n, const float* v, int64_t vs, int64_t hd, float* ot);
constexpr int64_t kTileLanes = 32;

// Where a decode row's keys are: global layers read pages through the block table, positions 0..pos;
// sliding layers read positions pos-window+1..pos from the slot's ring (entry p % ring_size).
struct PagedKeys {
  const int32_t* block_table;
  int64_t pages, page_size;
  int64_t first(int64_t) const { return 0; }
  int64_t location(int64_t slot, int64_t p) const {
    return static_cast<int64_t>(block_table[slot * pages + p / page_size]) * page_size + p % page_size;
  }
};

// Prefill chunks: each query row reads its own sequence's keys, packed one sequence after another at
// consecutive positions (what the chunk reads from the cache, then its own), up to its own position,
// and with a window only the last `window` of them.
struct PackedKeys {
  const int64_t* key_start;  // where each sequence's keys begin
  int64_t window;            // 0: every earlier key
  int64_t first(int64_t pos) const { return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0; }
  int64_t location(int64_t sequence, int64_t p) const { return key_start[sequence] + p; }
};

struct RingKeys {
  int64_t window, ring_size;  // the ring holds ring_size >= window entries per slot
  int64_t first(int64_t pos) const { return pos - window + 1 > 0 ? pos - window + 1 : 0; }
  int64_t location(int64_t slot, int64_t p) const { return slot * ring_size + p % ring_size; }
};

// x rounded to scalar_t and back (round to nearest even, as torch's .to(bf16)); the identity in fp32.
template <typename scalar_t>
inline float rounded(float x) {
  if constexpr (std::is_same_v<scalar_t, float>) return x;
  else return static_cast<float>(static_cast<scalar_t>(x));
}

template <typename scalar_t, typename Keys>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& table, const at::Tensor& tau, const Keys& keys,
                           const std::vector<int64_t>& slots, const std::vector<int64_t>& positions,
                           int64_t rel_extent, at::Tensor& out) {
  constexpr bool fp32 = std::is_same_v<scalar_t, float>;
  const int64_t B = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k_cache.size(1), E = table.size(2);
  const int64_t group = nh / nkv;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* tp = table.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t k0 = k_cache.stride(0), k1 = k_cache.stride(1), v0 = v_cache.stride(0), v1 = v_cache.stride(1);
  const float inv_hd = 1.0f / static_cast<float>(hd);
  // Every row's first key and key count; a task lists a row's key locations when it takes the row
  // (a prefill chunk's rows together would hold chunk x history of them).
  std::vector<int64_t> first_key(B), start(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    first_key[b] = keys.first(positions[b]);
    start[b + 1] = start[b] + positions[b] - first_key[b] + 1;
  }
  auto row_locations = [&](int64_t b, std::vector<int64_t>& loc) {
    const int64_t slot = slots[b], pos = positions[b];
    loc.clear();
    for (int64_t p = first_key[b]; p <= pos; ++p) loc.push_back(keys.location(slot, p));
  };
  // bf16: the scores of (row b, head h) into sh[0..n), each step rounded as attend() rounds it.
  auto head_scores = [&](int64_t b, int64_t h, const int64_t* loc, float* qs, float* sh) {
    const int64_t pos = positions[b], first = first_key[b], n = start[b + 1] - start[b];
    const float t = tau.defined() ? tau.data_ptr<float>()[b] : 1.0f;
    const scalar_t* qh = qp + (b * nh + h) * hd;
    for (int64_t d = 0; d < hd; ++d)
      qs[d] = tau.defined() ? rounded<scalar_t>(static_cast<float>(qh[d]) * t) : static_cast<float>(qh[d]);
    const scalar_t* th = tp + (b * nh + h) * E;
    const int64_t kvh = h / group;
    for (int64_t j = 0; j < n; ++j) {
      const scalar_t* kj = kp + loc[j] * k0 + kvh * k1;
      float dot = 0.0f;
      for (int64_t d = 0; d < hd; ++d) dot += qs[d] * static_cast<float>(kj[d]);
      const int64_t dist = pos - (first + j);
      float bias = dist < rel_extent ? static_cast<float>(th[dist]) : 0.0f;
      if (tau.defined()) bias = rounded<scalar_t>(bias * t);
      sh[j] = rounded<scalar_t>(rounded<scalar_t>(rounded<scalar_t>(dot) * inv_hd) + bias);
    }
  };
  if constexpr (fp32) {
    // (row, kv head) pairs are independent: split over the intra-op pool by pairs, each reading its
    // keys and values once for the `group` query heads that share them.
    const int64_t mean_keys = std::max<int64_t>(1, start[B] / std::max<int64_t>(1, B));
    at::parallel_for(0, B * nkv, task_grain(2 * group * mean_keys * hd), [&](int64_t begin, int64_t end) {
      std::vector<float> qs(group * hd), scores, bias, acc(group * hd);
      std::vector<int64_t> locations;
      int64_t listed = -1;  // the row `locations` holds
      for (int64_t bk = begin; bk < end; ++bk) {
        const int64_t b = bk / nkv, kvh = bk % nkv, n = start[b + 1] - start[b];
        const int64_t pos = positions[b], first = first_key[b];
        if (listed != b) row_locations(b, locations), listed = b;
        const int64_t* loc = locations.data();
        const float t = tau.defined() ? tau.data_ptr<float>()[b] : 1.0f;
        const float* qg = qp + (b * nh + kvh * group) * hd;
        for (int64_t i = 0; i < group * hd; ++i) qs[i] = tau.defined() ? qg[i] * t : qg[i];
        scores.resize(group * n);
        fp32_group_dots(qs.data(), group, hd, kp + kvh * k1, k0, loc, n, scores.data());
        bias.resize(group * n);
        for (int64_t g = 0; g < group; ++g) {
          const float* th = tp + (b * nh + kvh * group + g) * E;
          for (int64_t j = 0; j < n; ++j) {
            const int64_t dist = pos - (first + j);
            bias[g * n + j] = (dist < rel_extent ? th[dist] : 0.0f) * t;
          }
        }
        fp32_softmax_rows(scores.data(), bias.data(), group, n, inv_hd);
        std::fill(acc.begin(), acc.end(), 0.0f);
        fp32_group_values(scores.data(), group, n, vp + kvh * v1, v0, loc, hd, acc.data());
        std::copy(acc.begin(), acc.end(), op + (b * nh + kvh * group) * hd);
      }
    });
  } else {
    // ATen's softmax takes a row's heads at once: split over the intra-op pool by rows.
    const int64_t mean_keys = std::max<int64_t>(1, start[B] / std::max<int64_t>(1, B));
    at::parallel_for(0, B, task_grain(2 * nh * mean_keys * hd), [&](int64_t b0, int64_t b1) {
      std::vector<float> qs(hd), scores, probs, acc(hd);
      std::vector<int64_t> locations;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n = start[b + 1] - start[b];
        row_locations(b, locations);
        const int64_t* loc = locations.data();
        scores.resize(nh * n);
        probs.resize(nh * n);
        for (int64_t h = 0; h < nh; ++h) head_scores(b, h, loc, qs.data(), scores.data() + h * n);
        // ATen's own CPU softmax kernel (called directly, once per row, on the row's buffers): its
        // vectorized exp differs from std::exp in the last fp32 bit now and then, which is enough to
        // move a probability's bf16 rounding.
        at::Tensor probs_out = at::from_blob(probs.data(), {nh, n}, at::kFloat);
        at::cpu::_softmax_out(probs_out, at::from_blob(scores.data(), {nh, n}, at::kFloat), 1, false);
        for (int64_t i = 0; i < nh * n; ++i) probs[i] = rounded<scalar_t>(probs[i]);
        for (int64_t h = 0; h < nh; ++h) {
          const float* ph = probs.data() + h * n;
          const int64_t kvh = h / group;
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int64_t j = 0; j < n; ++j) {
            const scalar_t* vj = vp + loc[j] * v0 + kvh * v1;
            for (int64_t d = 0; d < hd; ++d) acc[d] += ph[j] * static_cast<float>(vj[d]);
          }
          scalar_t* oh = op + (b * nh + h) * hd;
          for (int64_t d = 0; d < hd; ++d) oh[d] = static_cast<scalar_t>(acc[d]);
        }
      }
    });
  }
}

template <typename Keys>
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& table_in, const std::optional<at::Tensor>& tau_in, const Keys& keys,
                            const std::vector<int64_t>& slots, const std::vector<int64_t>& positions,
                            int64_t rel_extent, const char* name) {
  const auto dtype = q_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "the CPU ", name, " kernel takes fp32 or bf16");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              name, ": q and the caches must share a dtype");
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1, "caches need unit head_dim stride");
  const auto q = q_in.contiguous(), table = in_dtype(table_in, dtype).contiguous();
  const int64_t B = q.size(0);
  TORCH_CHECK(q.dim() == 3 && table.dim() == 3 && table.size(0) == B && table.size(1) == q.size(1),
              name, ": q [B, nh, hd] and table [B, nh, E] expected");
  TORCH_CHECK(rel_extent >= 0 && rel_extent <= table.size(2), name, ": rel_extent ", rel_extent,
              " exceeds the table's ", table.size(2), " distances");
  TORCH_CHECK(static_cast<int64_t>(slots.size()) == B && static_cast<int64_t>(positions.size()) == B, name,
              ": one slot and one position per row expected");
  TORCH_CHECK(k_cache.size(1) >= 1 && q.size(1) % k_cache.size(1) == 0 && k_cache.size(2) == q.size(2),
              name, ": cache heads must divide the query heads, with the same head_dim");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(positions[b] >= 0, name, ": negative position");
  at::Tensor tau;
  if (tau_in.has_value()) tau = tau_in->to(at::kFloat).contiguous();
  auto out = at::empty_like(q);
  if (dtype == at::kFloat)
    decode_attention_impl<float>(q, k_cache, v_cache, table, tau, keys, slots, positions, rel_extent, out);
  else
    decode_attention_impl<at::BFloat16>(q, k_cache, v_cache, table, tau, keys, slots, positions, rel_extent, out);
  return out;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& table, const std::optional<at::Tensor>& tau,
                           const at::Tensor& block_table, const at::Tensor& cache_indices,
                           const at::Tensor& seq_lens, int64_t page_size, int64_t rel_extent) {
  const auto bt = in_dtype(block_table, at::kInt).contiguous();
  const int64_t pages = bt.size(1);
  const std::vector<int64_t> slots = indices_of(cache_indices, 0), positions = indices_of(seq_lens, -1);
  for (const int64_t last : positions)
    TORCH_CHECK(last >= 0 && last / page_size < pages, "paged_attention: bad seq_len ", last + 1);
  return decode_attention(q, k_cache, v_cache, table, tau, PagedKeys{bt.data_ptr<int32_t>(), pages, page_size},
                          slots, positions, rel_extent, "paged_attention");
}

// Decode on a sliding layer: each row's slot keeps its recent keys in a ring of ring_size >= window entries
// (the current one included, already written).
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k_ring, const at::Tensor& v_ring,
                          const at::Tensor& table, const at::Tensor& positions, const at::Tensor& cache_indices,
                          int64_t window, int64_t rel_extent, int64_t ring_size) {
  const int64_t ring = ring_size > 0 ? ring_size : window;
  TORCH_CHECK(window >= 1 && ring >= window && k_ring.size(0) % ring == 0, "ring_attention: rings of ", ring,
              " keys (window ", window, ") expected");
  const std::vector<int64_t> slots = indices_of(cache_indices, 0);
  for (const int64_t slot : slots)
    TORCH_CHECK(slot >= 0 && (slot + 1) * ring <= k_ring.size(0), "ring_attention: bad slot ", slot);
  return decode_attention(q, k_ring, v_ring, table, std::nullopt, RingKeys{window, ring}, slots,
                          indices_of(positions, 0), rel_extent, "ring_attention");
}

// fp32 packed prefill chunks in tiles (see kTileLanes): a tile is (sequence, kv head, a few consecutive
// queries), its lanes those queries x the kv head's query heads, and it reads the keys from its first
// query's first to its last query's own once for all of them. Tiles are the intra-op pool's tasks and
// each writes outputs no other writes, in the same order at any thread count.
void extend_attention_tiled(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                            const at::Tensor& tau, const int64_t* qs, const int64_t* ks, int64_t B, int64_t window,
                            int64_t rel_extent, at::Tensor& out) {
  const int64_t nh = q.size(1), hd = q.size(2), nkv = k.size(1), group = nh / nkv, E = table.size(2);
  const int64_t per_tile = std::max<int64_t>(1, kTileLanes / group);
  const PackedKeys keys{ks, window};
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (sequence, its first query)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < qs[b + 1] - qs[b]; i += per_tile) tiles.emplace_back(b, i);
  const float* qp = q.data_ptr<float>();
  const float* tp = table.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* taup = tau.defined() ? tau.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t k0 = k.stride(0), k1 = k.stride(1), v0 = v.stride(0), v1 = v.stride(1);
  const float inv_hd = 1.0f / static_cast<float>(hd);
  const int64_t mean_keys = std::max<int64_t>(1, k.size(0) / std::max<int64_t>(1, B));
  const int64_t tasks = static_cast<int64_t>(tiles.size()) * nkv;
  at::parallel_for(0, tasks, task_grain(2 * kTileLanes * mean_keys * hd), [&](int64_t begin, int64_t end) {
    std::vector<float> qt(hd * kTileLanes), scores, ot(hd * kTileLanes);
    int32_t lo[kTileLanes], hi[kTileLanes];
    for (int64_t task = begin; task < end; ++task) {
      const auto [b, i0] = tiles[task / nkv];
      const int64_t kvh = task % nkv, L = qs[b + 1] - qs[b], S = ks[b + 1] - ks[b];
      const int64_t i1 = std::min(L, i0 + per_tile), lanes = (i1 - i0) * group;
      const int64_t key0 = keys.first(S - L + i0), n = S - L + i1 - key0;  // keys [key0, own key of the last query]
      std::fill(qt.begin(), qt.end(), 0.0f);
      for (int64_t m = 0; m < kTileLanes; ++m) lo[m] = 0, hi[m] = static_cast<int32_t>(n - 1);  // idle lanes: harmless
      for (int64_t m = 0; m < lanes; ++m) {
        const int64_t i = i0 + m / group, row = qs[b] + i, head = kvh * group + m % group, pos = S - L + i;
        const float t = taup ? taup[row] : 1.0f;
        const float* qh = qp + (row * nh + head) * hd;
        for (int64_t d = 0; d < hd; ++d) qt[d * kTileLanes + m] = taup ? qh[d] * t : qh[d];
        lo[m] = static_cast<int32_t>(keys.first(pos) - key0);
        hi[m] = static_cast<int32_t>(pos - key0);
      }
      scores.resize(n * kTileLanes);
      fp32_tile_scores(qt.data(), hd, kp + (ks[b] + key0) * k0 + kvh * k1, k0, n, inv_hd, scores.data());
      for (int64_t m = 0; m < lanes; ++m) {  // the relative bias: the band of distances < rel_extent
        const int64_t row = qs[b] + i0 + m / group, head = kvh * group + m % group;
        const float t = taup ? taup[row] : 1.0f;
        const float* th = tp + (row * nh + head) * E;
        const int64_t band = std::min<int64_t>(rel_extent, hi[m] - lo[m] + 1);
        for (int64_t dist = 0; dist < band; ++dist) scores[(hi[m] - dist) * kTileLanes + m] += th[dist] * t;
      }
      // Scores of keys hidden from a lane (past its query, or before its window) become -inf, NaN
      // included: a few per lane, the tile's queries being consecutive. Their probability is then
      // exactly 0 (the values are read over the tile's keys, as a masked softmax reads them).
      for (int64_t m = 0; m < lanes; ++m) {
        for (int64_t j = 0; j < lo[m]; ++j) scores[j * kTileLanes + m] = -INFINITY;
        for (int64_t j = hi[m] + 1; j < n; ++j) scores[j * kTileLanes + m] = -INFINITY;
      }
      fp32_tile_softmax_values(scores.data(), n, vp + (ks[b] + key0) * v0 + kvh * v1, v0, hd, ot.data());
      for (int64_t m = 0; m < lanes; ++m) {
        float* oh = op + ((qs[b] + i0 + m / group) * nh + kvh * group + m % group) * hd;
        for (int64_t d = 0; d < hd; ++d) oh[d] = ot[d * kTileLanes + m];
      }
    }
  });
}

// Packed prefill chunks, each over its sequence's keys (see PackedKeys). fp32 goes in tiles (above);
// bf16, which rounds as attend() does at every step, takes every query as a decode row whose keys are
// contiguous, split over (query, kv head) pairs.
// (the start locations as int64s: the step's own are int32, read in place by the callers)
at::Tensor extend_attention_at(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                               const std::optional<at::Tensor>& tau, const std::vector<int64_t>& qsl,
                               const std::vector<int64_t>& ksl, int64_t window, int64_t rel_extent) {
  const int64_t B = static_cast<int64_t>(qsl.size()) - 1, T = q.size(0);
  const int64_t* qs = qsl.data();
  const int64_t* ks = ksl.data();
  TORCH_CHECK(B >= 0 && static_cast<int64_t>(ksl.size()) == B + 1,
              "extend_attention: query_start_loc and key_start_loc of one length");
  TORCH_CHECK(window >= 0, "extend_attention: negative window");
  TORCH_CHECK(B == 0 || (qs[0] == 0 && ks[0] == 0 && qs[B] == T && ks[B] == k.size(0)),
              "extend_attention: the start locations must cover q and k");
  TORCH_CHECK(!tau.has_value() || tau->numel() == T, "extend_attention: one tau per query expected, got ",
              tau.has_value() ? tau->numel() : 0, " for ", T);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = qs[b + 1] - qs[b], S = ks[b + 1] - ks[b];
    TORCH_CHECK(L >= 0 && S >= L, "extend_attention: sequence ", b, " has ", L, " queries but ", S, " keys");
  }
  const bool shaped = q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && table.dim() == 3;  // else decode's checks name it
  const int64_t group = shaped && k.size(1) >= 1 && q.size(1) % k.size(1) == 0 ? q.size(1) / k.size(1) : 0;
  // A tile reads its queries' windows and the keys between them: past an eighth of the window that
  // costs more than it shares, and each query reads only its own (small: a 64-key window, 16
  // queries a tile, 4.4 ms against 5.0 in tiles for 1,024 tokens; tools/bench_prefill_ops.py).
  const bool tiles_pay = (window == 0 || (group >= 1 && 8 * std::max<int64_t>(1, kTileLanes / group) <= window)) &&
                         fp32_tiles_built();
  if (tiles_pay && q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
      group >= 1 && group <= kTileLanes && k.size(2) == q.size(2) && k.stride(2) == 1 && v.stride(2) == 1 &&
      table.size(0) == T && table.size(1) == q.size(1) && rel_extent >= 0 && rel_extent <= table.size(2)) {
    const auto qc = q.contiguous(), tc = in_dtype(table, at::kFloat).contiguous();
    at::Tensor tc_tau;
    if (tau.has_value()) tc_tau = tau->to(at::kFloat).contiguous();
    auto out = at::empty_like(qc);
    extend_attention_tiled(qc, k, v, tc, tc_tau, qs, ks, B, window, rel_extent, out);
    return out;
  }
  // Per query: each a decode row of its sequence, at its own key (the last it sees).
  std::vector<int64_t> sequence(T), positions(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < qs[b + 1] - qs[b]; ++i) {
      sequence[qs[b] + i] = b;
      positions[qs[b] + i] = ks[b + 1] - ks[b] - (qs[b + 1] - qs[b]) + i;
    }
  return decode_attention(q, k, v, table, tau, PackedKeys{ks, window}, sequence, positions, rel_extent,
                          "extend_attention");
}

at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                            const std::optional<at::Tensor>& tau, const at::Tensor& query_start_loc,
                            const at::Tensor& key_start_loc, int64_t window, int64_t rel_extent) {
  return extend_attention_at(q, k, v, table, tau, indices_of(query_start_loc, 0), indices_of(key_start_loc, 0), window,
                             rel_extent);
}

// Packed prefill chunks over the caches (custom_ops/attention.py has the reference): each row's history
// as the cache holds it before the chunk is written (a global layer's pages through block_table, or the
// last window-1 positions of a sliding layer's ring), then its chunk's keys, gathered into packed keys
// for extend_attention; the chunk's keys are written (kv_write) last, since a ring may reuse an entry
// the chunk's first queries still read. The reference's whole-tensor index arithmetic
// cost about 0.8 ms a call on `small` in chunks of 256; here each key is one row copy.
at::Tensor cached_extend_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                                   at::Tensor v_cache, const at::Tensor& table, const std::optional<at::Tensor>& tau,
                                   const at::Tensor& query_start_loc, const at::Tensor& positions,
                                   const at::Tensor& cache_indices, const at::Tensor& kv_locations,
                                   const at::Tensor& block_table, int64_t page_size, int64_t ring_size, int64_t window,
                                   int64_t rel_extent) {
  const std::vector<int64_t> qsl = indices_of(query_start_loc, 0), slots_v = indices_of(cache_indices, 0);
  const auto pos_t = in_dtype(positions, at::kLong).contiguous();  // (the step's are int64: no copy)
  const int64_t rows = static_cast<int64_t>(qsl.size()) - 1, T = k.size(0);
  const int64_t *qs = qsl.data(), *pos = pos_t.data_ptr<int64_t>(), *slots = slots_v.data();
  TORCH_CHECK(rows >= 0 && (rows == 0 || (qs[0] == 0 && qs[rows] == T)),
              "cached_extend_attention: query_start_loc must cover the chunk's ", T, " tokens");
  TORCH_CHECK(v.sizes() == k.sizes(), "cached_extend_attention: k and v of one shape expected");
  const int64_t cache_rows = std::min(k_cache.size(0), v_cache.size(0));
  const bool sliding = window > 0;
  // The step's block table is int32, read as it is; any other integer table is read as int64 (never
  // narrowed: a page id past int32 must fail the cache-row check, not wrap into range).
  const auto bt_type = block_table.scalar_type() == at::kInt ? at::kInt : at::kLong;
  const auto bt = sliding ? block_table : in_dtype(block_table, bt_type).contiguous();
  TORCH_CHECK(sliding ? ring_size > 0 : (page_size > 0 && bt.dim() == 2),
              "cached_extend_attention: a ring size (sliding) or a page size and block table (global) expected");
  std::vector<int64_t> history(std::max<int64_t>(rows, 0), 0);
  const int32_t* pages32 = !sliding && bt.scalar_type() == at::kInt ? bt.data_ptr<int32_t>() : nullptr;
  const int64_t* pages64 = sliding || pages32 ? nullptr : bt.data_ptr<int64_t>();
  auto page_of = [&](int64_t i) { return pages32 ? int64_t{pages32[i]} : pages64[i]; };
  // Rows of one token with a history (a running request's decode in a mixed step, a prompt's last
  // token alone) attend as a decode row does, over the cache in place, once their key is written: packed
  // with their history, a tile of such a row would use `group` of its lanes and read a gathered copy of
  // every key it sees. Their packed rows below see only their own key, and are overwritten.
  std::vector<int64_t> single_tokens, single_slots, single_positions;
  const bool singles_allowed = (sliding || pages32) && rows <= static_cast<int64_t>(slots_v.size());
  bool any_history = false;
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(qs[b] <= qs[b + 1], "cached_extend_attention: query_start_loc decreases at row ", b);
    if (qs[b] == qs[b + 1]) continue;
    TORCH_CHECK(qs[b] < pos_t.numel() && pos[qs[b]] >= 0, "cached_extend_attention: row ", b, " has no position");
    // A global row's history is bounded by what its block table reaches, before anything is sized by it.
    TORCH_CHECK(sliding || pos[qs[b]] <= bt.size(1) * page_size, "cached_extend_attention: row ", b,
                " starts at position ", pos[qs[b]], ", past the ", bt.size(1) * page_size, " its block table reaches");
    history[b] = sliding ? std::min(pos[qs[b]], window - 1) : pos[qs[b]];
    if (singles_allowed && qs[b + 1] - qs[b] == 1 && history[b] > 0) {
      const int64_t slot = slots[b], p = pos[qs[b]];
      // every cache row the decode-style read will reach, checked as the gather below checks its own
      if (sliding) {
        TORCH_CHECK(slot >= 0 && (slot + 1) * ring_size <= cache_rows, "cached_extend_attention: row ", b,
                    " (slot ", slot, ") reads a ring past the cache's ", cache_rows, " rows");
      } else {
        // (its own position is read too: the block table must reach it, not only its history)
        TORCH_CHECK(slot >= 0 && slot < bt.size(0) && p / page_size < bt.size(1), "cached_extend_attention: row ",
                    b, " (slot ", slot, ") has no page for position ", p);
        for (int64_t page = 0; page <= p / page_size; ++page) {
          const int64_t at_page = page_of(slot * bt.size(1) + page) * page_size;
          TORCH_CHECK(at_page >= 0 && at_page + page_size <= cache_rows, "cached_extend_attention: row ", b,
                      " (slot ", slot, ") reads cache row ", at_page, " of ", cache_rows);
        }
      }
      single_tokens.push_back(qs[b]), single_slots.push_back(slot), single_positions.push_back(p);
      history[b] = 0;
    }
    any_history = any_history || history[b] > 0;
  }
  at::Tensor keys = k, values = v;
  std::vector<int64_t> key_start_loc = qsl;
  if (any_history) {
    TORCH_CHECK(rows <= static_cast<int64_t>(slots_v.size()), "cached_extend_attention: one slot per row expected");
    int64_t* ks = key_start_loc.data();
    ks[0] = 0;
    for (int64_t b = 0; b < rows; ++b) ks[b + 1] = ks[b] + history[b] + qs[b + 1] - qs[b];
    // Each packed key's source: a cache row (>= 0) or a chunk token (-1 - t).
    std::vector<int64_t> source(ks[rows]);
    for (int64_t b = 0; b < rows; ++b) {
      const int64_t first = qs[b] < qs[b + 1] ? pos[qs[b]] : 0, slot = slots[b];
      for (int64_t j = 0; j < history[b]; ++j) {
        const int64_t p = first - history[b] + j;
        int64_t loc;
        if (sliding) {
          loc = slot * ring_size + p % ring_size;
        } else {
          TORCH_CHECK(slot >= 0 && slot < bt.size(0) && p / page_size < bt.size(1),
                      "cached_extend_attention: row ", b, " (slot ", slot, ") has no page for position ", p);
          loc = page_of(slot * bt.size(1) + p / page_size) * page_size + p % page_size;
        }
        TORCH_CHECK(slot >= 0 && loc >= 0 && loc < cache_rows, "cached_extend_attention: row ", b, " (slot ", slot,
                    ") reads cache row ", loc, " of ", cache_rows);
        source[ks[b] + j] = loc;
      }
      for (int64_t t = qs[b]; t < qs[b + 1]; ++t) source[ks[b] + history[b] + t - qs[b]] = -1 - t;
    }
    auto gather = [&](const at::Tensor& chunk, const at::Tensor& cache) {
      TORCH_CHECK(chunk.scalar_type() == cache.scalar_type() && chunk.dim() == 3 && cache.dim() == 3 &&
                      chunk.size(1) == cache.size(1) && chunk.size(2) == cache.size(2) && cache.stride(2) == 1 &&
                      cache.stride(1) == cache.size(2),
                  "cached_extend_attention: the chunk's keys and a cache of contiguous [heads, head_dim] rows of "
                  "their dtype expected");
      const auto c = chunk.contiguous();
      auto out = at::empty({static_cast<int64_t>(source.size()), c.size(1), c.size(2)}, c.options());
      const int64_t bytes = c.size(1) * c.size(2) * c.element_size(), cache_stride = cache.stride(0) * cache.element_size();
      const auto* from_chunk = static_cast<const char*>(c.data_ptr());
      const auto* from_cache = static_cast<const char*>(cache.data_ptr());
      auto* to = static_cast<char*>(out.data_ptr());
      for (size_t i = 0; i < source.size(); ++i)
        std::memcpy(to + i * bytes, source[i] >= 0 ? from_cache + source[i] * cache_stride : from_chunk + (-1 - source[i]) * bytes,
                    bytes);
      return out;
    };
    keys = gather(k, k_cache);
    values = gather(v, v_cache);
  }
  // The attention reads the gathered keys (or the chunk's own), never the caches: run first, its own
  // refusals (heads, tau) leave the caches as they were.
  auto out = extend_attention_at(q, keys, values, table, tau, qsl, key_start_loc, window, rel_extent);
  kv_write(k_cache, v_cache, k, v, kv_locations);  // checks every location before it writes
  if (!single_tokens.empty()) {
    // After the write: a one-token row's own key is in the cache now, and its slot's ring lost only an
    // entry outside the row's window (ring_size >= window).
    const auto index = at::from_blob(single_tokens.data(), {static_cast<int64_t>(single_tokens.size())}, at::kLong);
    std::optional<at::Tensor> single_tau;
    if (tau.has_value()) single_tau = tau->index_select(0, index);
    const auto single_q = q.index_select(0, index), single_table = table.index_select(0, index);
    const auto single_out =
        sliding ? decode_attention(single_q, k_cache, v_cache, single_table, single_tau, RingKeys{window, ring_size},
                                   single_slots, single_positions, rel_extent, "cached_extend_attention")
                : decode_attention(single_q, k_cache, v_cache, single_table, single_tau,
                                   PagedKeys{pages32, bt.size(1), page_size}, single_slots, single_positions,
                                   rel_extent, "cached_extend_attention");
    out.index_copy_(0, index, single_out);
  }
  return out;
}

// ---- small-M matmul: y[n, O] = x[n, H] @ W^T, W given as [O, H] in either memory layout ----------
// Decode multiplies a few to a few dozen rows by each weight: the weight should stream from memory
// once, at bandwidth, while every loaded weight vector is used for every row. Rows go in blocks of up
// to 4 that share each weight load, their accumulators in registers; the weight's outputs are split
// into ranges, one per task of ATen's intra-op pool, and each output is computed by one task with
// the same sequence of operations whatever the split: the result is the same at any thread count,
// bit for bit. Whether this kernel or ATen's GEMM serves a shape is measured per machine
// (inkling_compiled/kernel_choice.py) and set here through inkling_set_matmul_choice.
//
// Built once per instruction set (AVX-512, AVX2 + FMA, portable) and picked once, at load, for the
// CPU it runs on (INKLING_CPU_ISA=avx512|avx2|portable forces one); multiply-adds may fuse here,
// unlike in the conv kernels, which must round exactly as their references do.
#define INKLING_INLINE static inline __attribute__((always_inline))

// A vector of W floats, W the width of one register of the build that uses it: 16 for AVX-512 (zmm),
// 8 for AVX2 (ymm), 4 for the portable build (xmm). A wider vector than the build has registers for
// has no machine mode: GCC keeps it on the stack and every operation goes through memory (the AVX2
// build spent most of its time there when it used 16-float vectors). Loads and stores go through
// memcpy: nothing here is aligned.
#pragma GCC diagnostic ignored "-Wpsabi"  // vectors never cross a call: every helper is inlined
template <int W> struct Lanes;
template <> struct Lanes<16> {
  typedef float f __attribute__((vector_size(64)));
  typedef int32_t i __attribute__((vector_size(64)));
  typedef int16_t s __attribute__((vector_size(32)));
  typedef int8_t b __attribute__((vector_size(16)));
  typedef uint32_t u __attribute__((vector_size(64)));
};
template <> struct Lanes<8> {
  typedef float f __attribute__((vector_size(32)));
  typedef int32_t i __attribute__((vector_size(32)));
  typedef int16_t s __attribute__((vector_size(16)));
  typedef int8_t b __attribute__((vector_size(8)));
  typedef uint32_t u __attribute__((vector_size(32)));
};
template <> struct Lanes<4> {
  typedef float f __attribute__((vector_size(16)));
  typedef int32_t i __attribute__((vector_size(16)));
  typedef int16_t s __attribute__((vector_size(8)));
  typedef int8_t b __attribute__((vector_size(4)));
  typedef uint32_t u __attribute__((vector_size(16)));
};
template <int W> using vecf = typename Lanes<W>::f;
template <int W> using veci = typename Lanes<W>::i;
template <int W> using vecu = typename Lanes<W>::u;
typedef vecf<16> vec16;
typedef vecf<8> vec8;
typedef vecf<4> vec4;

template <int W>
INKLING_INLINE vecf<W> loadv(const float* p) {
  vecf<W> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <int W>
INKLING_INLINE void storev(float* p, vecf<W> v) {
  std::memcpy(p, &v, sizeof v);
}

// W weights as floats: fp32 as they are; int8 (weight-only quantized) widened in registers, so that
// the weight streams from memory at a quarter of the bytes. An int8 weight's scale, one per output,
// multiplies each output once its sum is done (scale_outputs).
template <int W>
INKLING_INLINE vecf<W> loadw(const float* p) {
  return loadv<W>(p);
}
// One sign-extending move (vpmovsxbd) per vector, in assembly: GCC's __builtin_convertvector widens
// int8 lane by lane, or in a chain of shuffles that saturates one port, and the intrinsics would need
// every helper above them marked for the instruction set. Only the AVX-512 and AVX2 builds inline the
// 16- and 8-lane forms; the 4-lane one (unused by the portable build's plain loops) stays generic.
template <int W>
INKLING_INLINE vecf<W> loadw(const int8_t* p) {
  veci<W> wide;
  // The bytes go in through a register, not a memory operand: with an "m" operand GCC kept the
  // callers' accumulators on the stack, loading and storing them around every multiply-add.
  if constexpr (W == 16) {
    typename Lanes<16>::b b;
    std::memcpy(&b, p, sizeof b);
    asm("vpmovsxbd %1, %0" : "=v"(wide) : "v"(b));
  } else if constexpr (W == 8) {
    typename Lanes<8>::b b;
    std::memcpy(&b, p, sizeof b);
    asm("vpmovsxbd %1, %0" : "=x"(wide) : "x"(b));
  } else {
    typename Lanes<W>::b b;
    std::memcpy(&b, p, sizeof b);
    wide = __builtin_convertvector(__builtin_convertvector(b, typename Lanes<W>::s), veci<W>);
  }
  return __builtin_convertvector(wide, vecf<W>);
}
// Whether a vector of W weights starting at element h begins a 64-byte line (one prefetch per line).
template <int W, typename T>
INKLING_INLINE bool starts_line(int64_t h) {
  return (h * static_cast<int64_t>(sizeof(T))) % 64 == 0;
}

// The low half plus the high half of a vector.
INKLING_INLINE vec8 fold(vec16 v) {
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
}
INKLING_INLINE vec4 fold(vec8 v) {
  return __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
}
// The lanes summed as a tree (halves, then quarters, then pairs): a fixed order, and a fraction of
// the dependent adds of a lane-by-lane sum, which at 8+ rows cost as much as the dot products.
INKLING_INLINE float sumv(vec4 q) { return (q[0] + q[2]) + (q[1] + q[3]); }
INKLING_INLINE float sumv(vec8 v) { return sumv(fold(v)); }
INKLING_INLINE float sumv(vec16 v) { return sumv(fold(v)); }

// sumv's tree for W vectors at once (the AVX-512 and AVX2 builds): a level of the tree adds the lanes
// S apart in a pair of vectors with one add over both, and the last level leaves one vector to store,
// where sumv ends each vector in scalar adds. Levels S = W/2 ... 1 take W vectors to one, whose lane
// 4 * (i % (W / 4)) + i / (W / 4) is vector i's sum, bit for bit what sumv gives it: every lane meets
// the same partner at every level.
template <int S>
INKLING_INLINE vec16 fold_pair(vec16 a, vec16 b) {
  if constexpr (S == 8)
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  else if constexpr (S == 4)
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  else if constexpr (S == 2)  // within each 128-bit lane from here on
    return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  else
    return __builtin_shufflevector(a, b, 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30) +
           __builtin_shufflevector(a, b, 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31);
}
template <int S>
INKLING_INLINE vec8 fold_pair(vec8 a, vec8 b) {
  if constexpr (S == 4)
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  else if constexpr (S == 2)
    return __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
  else
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}
// One level: N vectors to N / 2, in place.
template <int S, int N, class V>
INKLING_INLINE void fold_level(V* v) {
#pragma GCC unroll 8
  for (int i = 0; i < N / 2; ++i) v[i] = fold_pair<S>(v[2 * i], v[2 * i + 1]);
}
template <int W>
INKLING_INLINE vecf<W> sum_lanes(vecf<W>* v) {  // W (16 or 8) vectors, overwritten
  if constexpr (W == 16) fold_level<8, 16>(v);
  fold_level<4, 8>(v);
  fold_level<2, 4>(v);
  fold_level<1, 2>(v);
  return v[0];
}
// The lane of sum_lanes' result that holds vector i's sum.
template <int W>
constexpr int lane_of_sum(int i) {
  return 4 * (i % (W / 4)) + i / (W / 4);
}

// How far ahead (floats) the kernels ask for weights: memory latency here is long enough that the
// hardware prefetcher alone leaves a single thread well short of the bandwidth.
constexpr int64_t kPrefetch = 256;

// W rows contiguous ([O, H] row-major): R rows x C outputs of dot products, W-wide partial sums.
// T is the weight's element type (float, or int8 whose scale comes later). Output c's weight row starts
// at w + c * w_c and its sums go to y[r * O + c * y_c]; with `ahead` > 0, each of those rows asks for
// its weights `ahead` elements further on, one line at a time.
template <int W, int R, int C, typename T>
INKLING_INLINE void dot_block(const float* x, int64_t H, const T* w, int64_t w_c, int64_t O, float* y, int64_t y_c,
                               int64_t ahead) {
  vecf<W> acc[R][C] = {};
  int64_t h = 0;
  for (; h + W <= H; h += W) {
    if (ahead > 0 && starts_line<W, T>(h)) {
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) __builtin_prefetch(w + c * w_c + ahead + h, 0, 2);
    }
    vecf<W> xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xv[r] = loadv<W>(x + r * H + h);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const vecf<W> wv = loadw<W>(w + c * w_c + h);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][c] += xv[r] * wv;
    }
  }
  // With a panel of four outputs and two or more rows, the R x C sums are reduced W at a time by
  // sum_lanes (zeros pad the last group); they come out as sumv would give them.
  constexpr bool kTogether = C == 4 && R >= 2;
  constexpr int kSums = kTogether ? (R * C + W - 1) / W * W : 1;
  float sums[kSums];
  if constexpr (kTogether) {
#pragma GCC unroll 4
    for (int g = 0; g < kSums; g += W) {
      vecf<W> group[W];
#pragma GCC unroll 16
      for (int i = 0; i < W; ++i) group[i] = g + i < R * C ? acc[(g + i) / C][(g + i) % C] : vecf<W>{};
      const vecf<W> total = sum_lanes<W>(group);
#pragma GCC unroll 16
      for (int i = 0; i < W; ++i) sums[g + i] = total[lane_of_sum<W>(i)];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float total = kTogether ? sums[r * C + c] : sumv(acc[r][c]);
      // Fused one term at a time, the same for either weight type: GCC vectorises a plain `+=` here
      // (unfused) for float weights and not for int8 ones.
      for (int64_t t = h; t < H; ++t) total = __builtin_fmaf(x[r * H + t], static_cast<float>(w[c * w_c + t]), total);
      y[r * O + c * y_c] = total;
    }
}

// R rows of x by one panel: 4 outputs, strided as in dot_block, or a single one (width 1).
template <int W, int R, typename T>
INKLING_INLINE void dot_panel(const float* x, int64_t H, const T* w, int64_t w_c, int64_t O, int width, float* y,
                              int64_t y_c, int64_t ahead) {
  if (width == 4) dot_block<W, R, 4>(x, H, w, w_c, O, y, y_c, ahead);
  else dot_block<W, R, 1>(x, H, w, w_c, O, y, y_c, ahead);
}

// One panel for all n rows, in blocks of rows that each read the panel's weights: from memory in the
// first block, from L1 in the others. Rows go 4 at a time where there are 32 registers (16
// accumulators), 2 at a time where there are 16.
template <int W> constexpr int kDotRows = W == 16 ? 4 : 2;
template <int W, typename T>
INKLING_INLINE void dot_panel_rows(const float* x, int64_t n, int64_t H, const T* w, int64_t w_c, int64_t O,
                                   int width, float* y, int64_t y_c, int64_t ahead) {
  constexpr int kRows = kDotRows<W>;
  int64_t r = 0;
  for (; r + kRows <= n; r += kRows) dot_panel<W, kRows>(x + r * H, H, w, w_c, O, width, y + r * O, y_c, ahead);
  switch (n - r) {
    case 3: dot_panel<W, 3>(x + r * H, H, w, w_c, O, width, y + r * O, y_c, ahead); break;
    case 2: dot_panel<W, 2>(x + r * H, H, w, w_c, O, width, y + r * O, y_c, ahead); break;
    case 1: dot_panel<W, 1>(x + r * H, H, w, w_c, O, width, y + r * O, y_c, ahead); break;
    default: break;
  }
}

// The calling thread's buffer for int8 weights widened to floats (dot_outputs, axpy_rows_outputs),
// aligned to a cache line: a vector that straddled two lines would cost every read of it two.
float* panel_buffer(int64_t floats) {
  thread_local std::vector<float> buffer;
  constexpr int64_t kLineFloats = 16;
  if (static_cast<int64_t>(buffer.size()) < floats + kLineFloats) buffer.resize(floats + kLineFloats);
  const auto at = reinterpret_cast<std::uintptr_t>(buffer.data());
  return buffer.data() + (kLineFloats - at / 4 % kLineFloats) % kLineFloats;
}

// W's layout, outputs [o0, o1). A panel's four outputs lie a quarter of the range apart, so the weight
// streams from memory as four sequential streams at once (panel p reads rows o0 + p + {0, 1, 2, 3} *
// quarter): on an AMD EPYC (Zen 4) 1-8 MB weights read this way came at 24-28 GB/s a thread at one or
// two rows where panels of four adjacent rows came at 17-21 (tools/bench_matmul.py --from-memory 512).
// With one or two rows of x the hardware's prefetchers keep up alone with fp32 weights (asking for the
// next row cost 10-15 % in a standalone loop), but not with int8 ones, whose widening puts three
// instructions between a stream's loads where fp32 has one: each stream asks for the bytes 2 KB or a
// row ahead, whichever is further (a 512x512 int8 weight at one row of x, from memory: 25-29 to 22-25
// us; 512x1024: 54-56 to 41 us).
// From three rows, the multiply-adds between loads leave them short with either type, and each stream
// asks for its next row. The rest of the range (under 4 outputs) goes one output at a
// time. Which panel an output lands in changes no operation on it: the result is the same whatever
// the range. int8 weights read by one block of rows (up to 4 rows; 2 on AVX2) are widened in registers;
// past that each panel is widened once into a cache-line-aligned buffer of floats that every block
// reads, where widening it in every block put two conversions beside every four multiply-adds (on the
// Xeon VM, tools/bench_matmul.py --int8 --rows 16 32, us a call in cache, 32 rows: 512x512 174-177 ->
// 135-139, 1024x512 350 -> 275-287; 16 rows: 512x512 88-90 -> 72-74; see the README's int8 section).
//
// Past kRowGroupFrom rows, x no longer fits in L1 beside a panel (32 rows of 512 floats are 64 KB), and
// every panel would read all of it from L2. There the panels go in chunks of kChunkPanels, and each
// chunk takes the rows a group at a time: 16 KB of x (never under 4 rows, which pass 16 KB past 1,024
// terms) stays in L1 across the chunk's panels, whose weights, read from memory by the first group,
// stay in L2 for the others. Up to kRowGroupFrom rows all rows are one group and all panels one chunk
// (an int8 weight widened once: one panel a chunk, its buffer 4 rows of floats). A widened chunk is
// four times its int8 bytes, so past 512 terms it takes fewer panels (kWidenedChunkBytes): a bound for
// caches smaller than this VM's 2 MB L2 and on the buffer (at 512x1024 and 32 rows the two stayed
// within this VM's spread).
// Only the order in which (row, output) pairs are computed changes, not the operations of any one: the
// same bits as panel by panel. `tools/bench_matmul.py --rows 24 32 --best-of 15` on the Xeon VM, in
// turns, us a call, panel by panel -> in groups, at 32 rows: 512x512 139-153 -> 125-126, 1024x512
// 313-330 -> 263-269, 512x1024 285-332 -> 226-235, 4000x512 1291-1317 -> 1087-1094; at 24 rows 512x512
// 109-110 -> 95, 1024x512 238-246 -> 206-210. With `--from-memory 384` the two stay within this VM's
// spread. At 12-16 rows (x fits) the groups gained nothing, so they start past 16.
constexpr int64_t kRowGroupFrom = 16, kRowGroupBytes = 16 << 10, kChunkPanels = 16, kWidenedChunkBytes = 128 << 10;

// Rows of x a group takes: 16 KB of them (8 rows of 512 floats), a multiple of 4, at least 4.
INKLING_INLINE int64_t row_group_rows(int64_t H) {
  return std::max<int64_t>(4, kRowGroupBytes / (4 * std::max<int64_t>(1, H)) / 4 * 4);
}

// A panel's four int8 weight rows (w + c * w_c, H terms each) widened to floats, row c at out + c * H,
// asking for each stream's bytes `ahead` elements further on, one line at a time.
template <int W>
INKLING_INLINE void widen_panel(const int8_t* w, int64_t w_c, int64_t H, float* out, int64_t ahead) {
  int64_t h = 0;
  for (; h + W <= H; h += W) {
    if (ahead > 0 && starts_line<W, int8_t>(h))
      for (int c = 0; c < 4; ++c) __builtin_prefetch(w + c * w_c + ahead + h, 0, 2);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) storev<W>(out + c * H + h, loadw<W>(w + c * w_c + h));
  }
  for (; h < H; ++h)
    for (int c = 0; c < 4; ++c) out[c * H + h] = static_cast<float>(w[c * w_c + h]);
}

template <int W, typename T>
INKLING_INLINE void dot_outputs(const float* x, int64_t n, int64_t H, const T* w, int64_t O, int64_t w_o,
                                int64_t o0, int64_t o1, float* y) {
  const int64_t quarter = (o1 - o0) / 4, rest = o0 + 4 * quarter;
  constexpr bool kInt8 = std::is_same_v<T, int8_t>;
  const int64_t ahead = n > 2 ? w_o : kInt8 ? std::max<int64_t>(w_o, 2048) : 0;
  const bool grouped = n > kRowGroupFrom;
  const int64_t group = grouped ? row_group_rows(H) : n;
  // An int8 panel that more than one block of rows reads is widened once, into a buffer of floats that
  // every block reads: a chunk's panels side by side (a panel is 16 * H bytes widened), or one panel at
  // a time below kRowGroupFrom rows.
  const bool widen_once = kInt8 && n > kDotRows<W>;
  int64_t chunk_panels = grouped ? kChunkPanels : quarter;
  if (widen_once)
    chunk_panels = grouped ? std::clamp<int64_t>(kWidenedChunkBytes / (16 * std::max<int64_t>(1, H)), 1, kChunkPanels) : 1;
  float* widened = widen_once ? panel_buffer(std::min(chunk_panels, std::max<int64_t>(1, quarter)) * 4 * H) : nullptr;
  for (int64_t chunk = o0; chunk < o0 + quarter; chunk += chunk_panels) {
    const int64_t end = std::min(chunk + chunk_panels, o0 + quarter);
    for (int64_t r = 0; r < n; r += group)  // the first group reads the weights, asking ahead
      for (int64_t p = chunk; p < end; ++p) {
        const int64_t rows = std::min(group, n - r);
        if constexpr (kInt8) {
          if (widen_once) {
            float* panel = widened + (p - chunk) * 4 * H;
            if (r == 0) widen_panel<W>(w + p * w_o, quarter * w_o, H, panel, ahead);
            dot_panel_rows<W>(x + r * H, rows, H, static_cast<const float*>(panel), H, O, 4, y + r * O + p, quarter, 0);
            continue;
          }
        }
        dot_panel_rows<W>(x + r * H, rows, H, w + p * w_o, quarter * w_o, O, 4, y + r * O + p, quarter,
                          r == 0 ? ahead : 0);
      }
  }
  for (int64_t o = rest; o < o1; ++o) dot_panel_rows<W>(x, n, H, w + o * w_o, 0, O, 1, y + o, 0, ahead);
}

constexpr int64_t kGroup = 8;  // rows of W^T read together (axpy_outputs below)

// W columns contiguous (W^T stored [H, O] row-major), outputs [o0, o1) (o0 a multiple of W), terms
// h in [h0, h1): W^T is read kGroup of its rows at a time, front to back, so that the weight streams in
// order; each group adds its kGroup terms to every row's partial sums in y (cache-resident). Every
// output sums its terms in order h = h0, h0 + 1, ..., whatever the grouping.
template <int W, typename T>
INKLING_INLINE void axpy_outputs(const float* x, int64_t n, int64_t H, const T* w, int64_t O, int64_t w_h,
                                 int64_t o0, int64_t o1, int64_t h0, int64_t h1, float* y) {
  const int64_t full = o0 + (o1 - o0) / W * W;
  constexpr int64_t ahead = kPrefetch * 4 / sizeof(T);  // the same distance in bytes for either type
  for (int64_t hg = h0; hg < h1; hg += kGroup) {
    const int64_t g = std::min(kGroup, h1 - hg);
    const T* wg = w + hg * w_h;
    for (int64_t o = o0; o < full; o += W) {
      vecf<W> wv[kGroup];
      for (int64_t j = 0; j < g; ++j) {
        if (starts_line<W, T>(o)) __builtin_prefetch(wg + j * w_h + o + ahead);  // one per line
        wv[j] = loadw<W>(wg + j * w_h + o);
      }
      for (int64_t r = 0; r < n; ++r) {
        const float* xr = x + r * H + hg;
        float* yr = y + r * O + o;
        vecf<W> acc = hg == h0 ? vecf<W>{} : loadv<W>(yr);
        if (g == kGroup) {
#pragma GCC unroll 8
          for (int64_t j = 0; j < kGroup; ++j) acc += xr[j] * wv[j];
        } else {
          for (int64_t j = 0; j < g; ++j) acc += xr[j] * wv[j];
        }
        storev<W>(yr, acc);
      }
    }
    for (int64_t o = full; o < o1; ++o)  // the columns past the last full vector: plain loops
      for (int64_t r = 0; r < n; ++r) {
        float total = hg == h0 ? 0.0f : y[r * O + o];
        for (int64_t j = 0; j < g; ++j) total += x[r * H + hg + j] * wg[j * w_h + o];
        y[r * O + o] = total;
      }
  }
}

// From this many rows, W^T's layout takes axpy_rows_outputs below: the weight is reused by so many rows
// that the multiply-adds, not the bytes, set the time, and the partial sums belong in registers.
// Measured with tools/bench_matmul.py --from-memory: faster on every shape of `small` from 20 rows;
// at 16 the lm_head's (4000 x 512) was slower than on axpy_outputs.
constexpr int64_t kBlockedRows = 20;
// Columns a task of that path takes at a time (SplitMatmul): a multiple of every build's panel.
constexpr int64_t kBlockedColumns = 64;

// The strip of the weight a tile asks the caches for while it runs (the next one), one term's lines
// per term: spread over the multiply-adds, where a burst of requests would stall on the fill buffers.
struct StripAhead {
  const char* at = nullptr;  // its first term's first byte, or null
  int64_t stride = 0;        // bytes from one term to the next
  int64_t terms = 0;
  int lines = 0;             // 64-byte lines a term
};

// R rows x V vectors of outputs, their partial sums in registers over `terms` terms (added onto y's
// sums so far when `onto_y`): per term V weight vectors (`w_h` floats a term) and R broadcasts of x
// (`x_h` floats a row) feed R x V multiply-adds.
template <int W, int R, int V>
INKLING_INLINE void axpy_tile(const float* x, int64_t x_h, const float* w, int64_t w_h, int64_t terms, float* y,
                              int64_t O, bool onto_y, StripAhead ahead) {
  vecf<W> acc[R][V] = {};
  if (onto_y)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = loadv<W>(y + r * O + v * W);
  for (int64_t h = 0; h < terms; ++h) {
    if (ahead.at && h < ahead.terms)
      for (int l = 0; l < ahead.lines; ++l) __builtin_prefetch(ahead.at + h * ahead.stride + 64 * l, 0, 2);
    const float* wh = w + h * w_h;
    vecf<W> wv[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) wv[v] = loadv<W>(wh + v * W);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xs = x[r * x_h + h];
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] += xs * wv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) storev<W>(y + r * O + v * W, acc[r][v]);
}

// Rows of x at a time in axpy_tile: with 32 registers, 6 rows x 4 vectors of partial sums; with 16, 4 x 2.
template <int W> constexpr int kTileRows = W == 16 ? 6 : 4;

// The last n < kTileRows rows of x: one tile of exactly that many.
template <int W, int V, int R = kTileRows<W> - 1>
INKLING_INLINE void axpy_rest_rows(const float* x, int64_t n, int64_t x_h, const float* w, int64_t w_h, int64_t terms,
                                   float* y, int64_t O, bool onto_y, StripAhead ahead) {
  if constexpr (R > 0) {
    if (n == R) axpy_tile<W, R, V>(x, x_h, w, w_h, terms, y, O, onto_y, ahead);
    else axpy_rest_rows<W, V, R - 1>(x, n, x_h, w, w_h, terms, y, O, onto_y, ahead);
  }
}

// Every row of x times one strip of V full vectors of outputs, in blocks of kTileRows rows; the first
// block asks for the next strip, which the later ones give time to arrive.
template <int W, int V>
INKLING_INLINE void axpy_strip_rows(const float* x, int64_t n, int64_t H, const float* w, int64_t w_h, int64_t terms,
                                    float* y, int64_t O, bool onto_y, StripAhead ahead) {
  constexpr int R = kTileRows<W>;
  int64_t r = 0;
  for (; r + R <= n; r += R, ahead = {}) axpy_tile<W, R, V>(x + r * H, H, w, w_h, terms, y + r * O, O, onto_y, ahead);
  axpy_rest_rows<W, V>(x + r * H, n - r, H, w, w_h, terms, y + r * O, O, onto_y, ahead);
}

// W^T's layout for kBlockedRows rows or more: outputs [o0, o1) (o0 a multiple of W), terms [h0, h1).
// The outputs go in panels of kPanelVecs vectors, a panel's terms in strips of kStripTerms (16 KB of
// fp32 on AVX-512, 4 KB on AVX2): a strip comes from memory once, in the first block of rows (asked
// for a strip ahead), and from cache for every later block; the partial sums stay in registers over
// a strip and in y between strips, so each output sums its terms in order h = h0, h0 + 1, ... An int8
// strip is read once, by its widening into a float buffer (widening it in every block would cost
// more than the multiply-adds). Columns past the last full vector go to axpy_outputs' loops.
constexpr int64_t kStripTerms = 64;
template <int W, typename T>
INKLING_INLINE void axpy_rows_outputs(const float* x, int64_t n, int64_t H, const T* w, int64_t O, int64_t w_h,
                                      int64_t o0, int64_t o1, int64_t h0, int64_t h1, float* y) {
  constexpr int kPanelVecs = W == 16 ? 4 : 2;
  constexpr int64_t kPanel = kPanelVecs * W;
  constexpr bool widened = std::is_same_v<T, int8_t>;
  const int64_t full = o0 + (o1 - o0) / W * W;
  float* buffer = widened ? panel_buffer(kStripTerms * kPanel) : nullptr;
  for (int64_t o = o0; o < full; o += kPanel) {
    const int vecs = static_cast<int>(std::min<int64_t>(kPanelVecs, (full - o) / W));
    for (int64_t hs = h0; hs < h1; hs += kStripTerms) {
      const int64_t terms = std::min(h1, hs + kStripTerms) - hs;
      // The next strip: this panel's next terms, or the next panel's first.
      StripAhead ahead;
      const bool last = hs + terms == h1;
      const int64_t next_o = last ? o + kPanel : o, next_h = last ? h0 : hs + terms;
      if (next_o < full) {
        ahead.at = reinterpret_cast<const char*>(w + next_h * w_h + next_o);
        ahead.stride = w_h * static_cast<int64_t>(sizeof(T));
        ahead.terms = std::min(h1, next_h + kStripTerms) - next_h;
        ahead.lines = static_cast<int>((std::min(kPanel, full - next_o) * static_cast<int64_t>(sizeof(T)) + 63) / 64);
      }
      const float* strip;
      int64_t strip_h;
      if constexpr (widened) {
        for (int64_t h = 0; h < terms; ++h)
          for (int v = 0; v < vecs; ++v)
            storev<W>(buffer + h * kPanel + v * W, loadw<W>(w + (hs + h) * w_h + o + v * W));
        strip = buffer, strip_h = kPanel;
      } else {
        strip = w + hs * w_h + o, strip_h = w_h;
      }
      const float* xs = x + hs;
      const bool onto_y = hs > h0;
      switch (vecs) {
        case 4: if constexpr (kPanelVecs >= 4) axpy_strip_rows<W, 4>(xs, n, H, strip, strip_h, terms, y + o, O, onto_y, ahead); break;
        case 3: if constexpr (kPanelVecs >= 3) axpy_strip_rows<W, 3>(xs, n, H, strip, strip_h, terms, y + o, O, onto_y, ahead); break;
        case 2: axpy_strip_rows<W, 2>(xs, n, H, strip, strip_h, terms, y + o, O, onto_y, ahead); break;
        default: axpy_strip_rows<W, 1>(xs, n, H, strip, strip_h, terms, y + o, O, onto_y, ahead); break;
      }
    }
  }
  if (full < o1) axpy_outputs<W>(x, n, H, w, O, w_h, full, o1, h0, h1, y);
}

// y[n, O] (row stride O) = the terms h in [h0, h1) of x @ W^T, for outputs [o0, o1). W's layout
// (w_h == 1) takes every term at once (h0 = 0, h1 = H).
// out[r, c] (row stride cols) = q[r * stride + c] times row_scale[r], or col_scale[c]: a block of an
// int8 weight dequantized for ATen's GEMM (linear_int8 past kMaxFewRowsInt8 rows).
template <int W>
INKLING_INLINE void widen_scaled_body(const int8_t* q, int64_t rows, int64_t cols, int64_t stride,
                                      const float* row_scale, const float* col_scale, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* qr = q + r * stride;
    float* o = out + r * cols;
    int64_t c = 0;
    if (row_scale) {
      const float s = row_scale[r];
      for (; c + W <= cols; c += W) storev<W>(o + c, loadw<W>(qr + c) * s);
      for (; c < cols; ++c) o[c] = qr[c] * s;
    } else {
      for (; c + W <= cols; c += W) storev<W>(o + c, loadw<W>(qr + c) * loadv<W>(col_scale + c));
      for (; c < cols; ++c) o[c] = qr[c] * col_scale[c];
    }
  }
}

template <int W, typename T>
INKLING_INLINE void matmul_outputs(const float* x, int64_t n, int64_t H, const T* w, int64_t O, int64_t w_o,
                                   int64_t w_h, int64_t o0, int64_t o1, int64_t h0, int64_t h1, float* y) {
  if (w_h == 1) dot_outputs<W>(x, n, H, w, O, w_o, o0, o1, y);
  else if (n >= kBlockedRows) axpy_rows_outputs<W>(x, n, H, w, O, w_h, o0, o1, h0, h1, y);
  else axpy_outputs<W>(x, n, H, w, O, w_h, o0, o1, h0, h1, y);
}

#define INKLING_MATMUL_FOR(isa_name, features, width)                                                          \
  __attribute__((target(features), optimize("fp-contract=fast"))) void matmul_outputs_##isa_name(              \
      const float* x, int64_t n, int64_t H, const float* w, int64_t O, int64_t w_o, int64_t w_h, int64_t o0,    \
      int64_t o1, int64_t h0, int64_t h1, float* y) {                                                           \
    matmul_outputs<width>(x, n, H, w, O, w_o, w_h, o0, o1, h0, h1, y);                                          \
  }                                                                                                            \
  __attribute__((target(features), optimize("fp-contract=fast"))) void matmul_q8_outputs_##isa_name(           \
      const float* x, int64_t n, int64_t H, const int8_t* w, int64_t O, int64_t w_o, int64_t w_h, int64_t o0,   \
      int64_t o1, int64_t h0, int64_t h1, float* y) {                                                           \
    matmul_outputs<width>(x, n, H, w, O, w_o, w_h, o0, o1, h0, h1, y);                                          \
  }                                                                                                            \
  __attribute__((target(features))) void widen_scaled_##isa_name(const int8_t* q, int64_t rows, int64_t cols,   \
      int64_t stride, const float* row_scale, const float* col_scale, float* out) {                            \
    widen_scaled_body<width>(q, rows, cols, stride, row_scale, col_scale, out);                                \
  }
INKLING_MATMUL_FOR(avx512, "avx512f,avx512vl,avx2,fma", 16)
INKLING_MATMUL_FOR(avx2, "avx2,fma", 8)

template <int W>
INKLING_INLINE float dot_body(const float* a, const float* b, int64_t n) {
  vecf<W> acc = {};
  int64_t i = 0;
  for (; i + W <= n; i += W) acc += loadv<W>(a + i) * loadv<W>(b + i);
  float total = sumv(acc);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

template <int W>
INKLING_INLINE void axpy_body(float s, const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) storev<W>(y + i, loadv<W>(y + i) + s * loadv<W>(x + i));
  for (; i < n; ++i) y[i] += s * x[i];
}

// e^x in W lanes: x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts), e^r by Cephes' degree-7
// polynomial, times 2^n (as 2^a 2^b, a + b = n, so that n = 128 still has exponent bits); within 2 ulp
// of std::exp, 0 below -87.3 (where std::exp is denormal) and inf above log(FLT_MAX). The softmax and
// SiLU use it in place of W calls of std::exp.
template <int W>
INKLING_INLINE vecf<W> expv(vecf<W> x) {
  typedef vecf<W> V;
  const V lo = V{} - 87.3365447f, hi = V{} + 88.7228394f;
  const V c = x < lo ? lo : (x > hi ? hi : x);
  const V shifter = V{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (c * 1.44269504f + shifter) - shifter;
  V r = c - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const V e = p * (r * r) + r + 1.0f;
  const veci<W> whole = __builtin_convertvector(n, veci<W>), half = whole >> 1;
  const veci<W> bits_a = (half + 127) << 23, bits_b = (whole - half + 127) << 23;
  V scale_a, scale_b;
  std::memcpy(&scale_a, &bits_a, sizeof scale_a);
  std::memcpy(&scale_b, &bits_b, sizeof scale_b);
  const V out = (e * scale_a) * scale_b;
  return x < lo ? V{} : (x > hi ? V{} + INFINITY : out);
}

// expv over n floats in place; the tail through a padded copy.
template <int W>
INKLING_INLINE void exp_in_place(float* x, int64_t n, float shift) {
  int64_t j = 0;
  for (; j + W <= n; j += W) storev<W>(x + j, expv<W>(loadv<W>(x + j) - shift));
  if (j < n) {
    float tail[W];
    std::fill(tail, tail + W, -INFINITY);
    std::copy(x + j, x + n, tail);
    const vecf<W> e = expv<W>(loadv<W>(tail) - shift);
    std::memcpy(tail, &e, sizeof e);
    std::copy(tail, tail + (n - j), x + j);
  }
}

// Each of g rows of n scores: s = s * scale + bias, then its softmax in place.
template <int W>
INKLING_INLINE void softmax_rows_body(float* s, const float* bias, int64_t g, int64_t n, float scale) {
  for (int64_t h = 0; h < g; ++h) {
    float* sh = s + h * n;
    const float* bh = bias + h * n;
    // The scaled scores W at a time, each lane keeping its own maximum (a maximum is exact, so lanes
    // then tail give the same one as a single pass would).
    vecf<W> top = vecf<W>{} - INFINITY;
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const vecf<W> v = loadv<W>(sh + i) * scale + loadv<W>(bh + i);
      storev<W>(sh + i, v);
      top = v > top ? v : top;
    }
    float mx = -INFINITY;
    for (int l = 0; l < W; ++l) mx = top[l] > mx ? top[l] : mx;
    for (; i < n; ++i) {
      sh[i] = sh[i] * scale + bh[i];
      mx = sh[i] > mx ? sh[i] : mx;
    }
    exp_in_place<W>(sh, n, mx);
    vecf<W> acc = {};
    int64_t j = 0;
    for (; j + W <= n; j += W) acc += loadv<W>(sh + j);
    float total = sumv(acc);
    for (; j < n; ++j) total += sh[j];
    for (j = 0; j < n; ++j) sh[j] = sh[j] / total;
  }
}

// act[p, :] = silu(gate) * up for rows gu[p] = [gate (I) | up (I)].
template <int W>
INKLING_INLINE void silu_mul_body(const float* gu, int64_t rows, int64_t I, float* act) {
  for (int64_t p = 0; p < rows; ++p) {
    const float* g = gu + p * 2 * I;
    const float* u = g + I;
    float* a = act + p * I;
    for (int64_t i = 0; i < I; ++i) a[i] = -g[i];
    exp_in_place<W>(a, I, 0.0f);
    for (int64_t i = 0; i < I; ++i) a[i] = (g[i] / (1.0f + a[i])) * u[i];
  }
}

// ---- The sampler's passes over one row of V logits (sample_tokens, verify_tokens) ----------------------

// ln x in W lanes for normal x > 0 (the sampler's noise stays within (2^-25, 17)): x = m 2^e with m in
// [sqrt(1/2), sqrt(2)), ln m by Cephes' logf polynomial in m - 1, plus e ln 2 in two parts; within about
// an ulp of std::log.
template <int W>
INKLING_INLINE vecf<W> logv(vecf<W> x) {
  typedef vecf<W> V;
  veci<W> bits;
  std::memcpy(&bits, &x, sizeof bits);
  const veci<W> mantissa = (bits & 0x007fffff) | 0x3f000000;  // m in [0.5, 1), x = m 2^(e + 1)
  V m;
  std::memcpy(&m, &mantissa, sizeof m);
  const veci<W> low = m < (V{} + 0.70710678f);  // -1 where m < sqrt(1/2): take 2m and one less exponent
  const V e = __builtin_convertvector(((bits >> 23) & 0xff) - 126 + low, V);
  const V f = (low ? m + m : m) - 1.0f;
  const V z = f * f;
  V y = V{} + 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z + e * -2.12194440e-4f - 0.5f * z;
  return f + y + e * 0.693359375f;
}

// uniform_noise's hash of (row key, vocabulary id), W ids from i on, as U(0, 1) (unit_interval): the
// Python's int64 products masked to 32 bits are these uint32 products.
template <int W>
INKLING_INLINE vecf<W> uniform_lanes(uint32_t key, int64_t i) {
  vecu<W> x;
  for (int l = 0; l < W; ++l) x[l] = static_cast<uint32_t>(i + l);
  x = (x * 0x165667B1u) ^ key;
  for (int round = 0; round < 2; ++round) {
    x ^= x >> 16;
    x *= 0x45D9F3Bu;
  }
  x ^= x >> 16;
  x >>= 9;  // 23 bits: an int32 as it is
  return (__builtin_convertvector(reinterpret_cast<veci<W>&>(x), vecf<W>) + 0.5f) * (1.0f / 8388608.0f);
}

// Whether any lane of a comparison's result is set (halves OR-ed down to four lanes).
template <int W>
INKLING_INLINE bool any_lane(veci<W> m) {
  if constexpr (W == 4) {
    return ((m[0] | m[1]) | (m[2] | m[3])) != 0;
  } else {
    veci<W / 2> lo, hi;
    std::memcpy(&lo, &m, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&m) + sizeof lo, sizeof hi);
    return any_lane<W / 2>(lo | hi);
  }
}

// The order the sampler ranks values in, torch's: NaN above every number (and equal to NaN).
INKLING_INLINE bool ranks_above(float a, float b) { return a > b || (a != a && b == b); }
template <int W>  // lane by lane
INKLING_INLINE veci<W> ranks_above_lanes(vecf<W> a, vecf<W> b) { return (a > b) | ((a != a) & (b == b)); }

// A row's largest value, the first index that holds it (torch.argmax's choice), and the sum of e^(x - max)
// (the log-softmax's denominator, expv's exp); with a NaN anywhere, torch's answer (see below).
template <int W>
INKLING_INLINE void row_max_sum_body(const float* x, int64_t V, float* max_out, int64_t* at_out, float* sum_out) {
  vecf<W> top = vecf<W>{} - INFINITY;
  veci<W> nan = {};
  int64_t i = 0;
  for (; i + W <= V; i += W) {
    const vecf<W> v = loadv<W>(x + i);
    top = v > top ? v : top;
    nan |= v != v;
  }
  bool has_nan = any_lane<W>(nan);
  float mx = -INFINITY;
  for (int l = 0; l < W; ++l) mx = top[l] > mx ? top[l] : mx;
  for (; i < V; ++i) mx = x[i] > mx ? x[i] : mx, has_nan |= x[i] != x[i];
  if (has_nan) {  // as torch: the first NaN is the argmax, and every logprob is NaN
    int64_t at = 0;
    while (x[at] == x[at]) ++at;
    *max_out = NAN, *at_out = at, *sum_out = NAN;
    return;
  }
  int64_t at = 0;  // the first vector holding the maximum, then its first lane there
  while (at + W <= V && !any_lane<W>(loadv<W>(x + at) == (vecf<W>{} + mx))) at += W;
  while (at + 1 < V && x[at] != mx) ++at;
  vecf<W> acc = {};
  for (i = 0; i + W <= V; i += W) acc += expv<W>(loadv<W>(x + i) - mx);
  float total = sumv(acc);
  for (; i < V; ++i) total += std::exp(x[i] - mx);
  *max_out = mx, *at_out = at, *sum_out = total;
}

// The largest lane of a vector, as ranks_above ranks them (halves folded down to four lanes).
template <int W>
INKLING_INLINE float max_lane(vecf<W> v) {
  if constexpr (W == 4) {
    const float a = ranks_above(v[0], v[1]) ? v[0] : v[1], b = ranks_above(v[2], v[3]) ? v[2] : v[3];
    return ranks_above(a, b) ? a : b;
  } else {
    vecf<W / 2> lo, hi;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
    return max_lane<W / 2>(ranks_above_lanes<W / 2>(lo, hi) ? lo : hi);
  }
}

// The n (1 <= n <= V) largest of a row as ranks_above ranks them, largest first, equal values by lower
// index first: values to vals, indices to ids. The row's vectors of W are blocks: n blocks whose maxima are
// the n largest maxima hold n values at least the least of those maxima, so a block below it holds none of
// the n largest, and only the others are read value by value, in order (the tie rule).
template <int W>
INKLING_INLINE void top_n_body(const float* x, int64_t V, int64_t n, int64_t* ids, float* vals) {
  const int64_t blocks = V / W;
  thread_local std::vector<float> maxima, order;
  maxima.resize(blocks);
  for (int64_t k = 0; k < blocks; ++k) maxima[k] = max_lane<W>(loadv<W>(x + k * W));
  float bar = -INFINITY;  // no value below it is among the n largest
  if (blocks >= n) {
    order.assign(maxima.begin(), maxima.end());
    std::nth_element(order.begin(), order.begin() + (n - 1), order.end(), ranks_above);
    bar = order[n - 1];
  }
  int64_t kept = 0;
  auto offer = [&](int64_t i) {
    const float v = x[i];
    if (kept == n && !ranks_above(v, vals[n - 1])) return;
    int64_t p = kept < n ? kept++ : n - 1;
    for (; p > 0 && ranks_above(v, vals[p - 1]); --p) vals[p] = vals[p - 1], ids[p] = ids[p - 1];
    vals[p] = v, ids[p] = i;
  };
  for (int64_t k = 0; k < blocks; ++k)
    if (!ranks_above(bar, maxima[k]))
      for (int64_t i = k * W; i < (k + 1) * W; ++i) offer(i);
  for (int64_t i = blocks * W; i < V; ++i) offer(i);
}

// The first index of the largest c_i - ln(-ln u_i), u_i the row's noise at id i (uniform_lanes), with
// c_exclude (exclude >= 0) taken as -inf: the Gumbel-max draw of the reference, index 0 where every
// term is -inf.
template <int W>
INKLING_INLINE int64_t noisy_argmax_body(const float* c, int64_t V, uint32_t key, int64_t exclude) {
  // Each lane keeps its first largest term and that term's index; the lanes' winner is the largest,
  // the lowest index among equals: the first index of the largest over the row.
  vecf<W> best = vecf<W>{} - INFINITY;
  veci<W> at = {}, lane;
  for (int l = 0; l < W; ++l) lane[l] = l;
  for (int64_t i = 0; i < V; i += W) {
    vecf<W> cv = vecf<W>{} - INFINITY;  // (lanes past V: -inf, never above a lane's best)
    std::memcpy(&cv, c + i, std::min<int64_t>(W, V - i) * sizeof(float));
    const veci<W> index = lane + (veci<W>{} + static_cast<int32_t>(i));
    vecf<W> t = cv - logv<W>(vecf<W>{} - logv<W>(uniform_lanes<W>(key, i)));
    t = index == (veci<W>{} + static_cast<int32_t>(exclude)) ? vecf<W>{} - INFINITY : t;
    const veci<W> above = ranks_above_lanes<W>(t, best);
    best = above ? t : best;
    at = above ? index : at;
  }
  int64_t first = at[0];
  float top = best[0];
  for (int l = 1; l < W; ++l)
    if (ranks_above(best[l], top) || (!ranks_above(top, best[l]) && at[l] < first)) top = best[l], first = at[l];
  return first;
}

// The sums of four vectors, each by sumv's tree (so bit for bit what sumv gives); for 16 lanes with
// the shuffles shared.
INKLING_INLINE vec4 sum4(vec16 a0, vec16 a1, vec16 a2, vec16 a3) {
  const vec8 t0 = fold(a0), t1 = fold(a1), t2 = fold(a2), t3 = fold(a3);
  const vec8 u01 = __builtin_shufflevector(t0, t1, 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(t0, t1, 4, 5, 6, 7, 12, 13, 14, 15);
  const vec8 u23 = __builtin_shufflevector(t2, t3, 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(t2, t3, 4, 5, 6, 7, 12, 13, 14, 15);
  const vec8 v = __builtin_shufflevector(u01, u23, 0, 1, 4, 5, 8, 9, 12, 13) +
                 __builtin_shufflevector(u01, u23, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(v, v, 0, 2, 4, 6) + __builtin_shufflevector(v, v, 1, 3, 5, 7);
}
template <class V>
INKLING_INLINE vec4 sum4(V a0, V a1, V a2, V a3) {
  return vec4{sumv(a0), sumv(a1), sumv(a2), sumv(a3)};
}

// Decode attention for the g query heads that share a kv head: each key and value row is read from
// memory once for all of them. Row j is at base + loc[j] * stride; q and acc are [g, hd], s and p are
// [g, n]. V = hd / W: the row in V registers (0: generic loops, any hd). Key and value rows come from
// all over the cache, and in a decode step from memory (the weights read between two layers' attention
// push them out): each is asked for this many rows ahead of its use, the first ones before the loop,
// one request per 64-byte line, with the low-locality hint, which leaves more misses in flight than
// requests into L1 do (tools/bench_decode_attention.py --from-memory: a global layer of `small` at
// batch 32 and 1,000 keys took 4.3-4.6 ms a call at 16 rows ahead into L1, 2.9 ms this way).
constexpr int64_t kRowsAhead = 32;
INKLING_INLINE void prefetch_row(const float* row, int64_t hd) {
  for (int64_t i = 0; i < hd; i += 16) __builtin_prefetch(row + i, 0, 1);
}

// Query heads whose scores a block of four keys makes at once, and value rows' heads summed at once:
// each key or value row is loaded once per block of heads, not once per head, and the sums fit the
// registers (32 with AVX-512, 16 with AVX2). A (head, key) dot and a (head, column) sum take the same
// operations in the same order whatever the blocking.
template <int W> constexpr int kDotHeads = W == 16 ? 4 : 2;
template <int W> constexpr int kValueSums = W == 16 ? 16 : 8;

// Heads h0 .. h0 + HB - 1 against keys j .. j + 3 (rows k[0..3]).
template <int W, int V, int HB>
INKLING_INLINE void dots_four_keys(const float* q, int64_t hd, const float* const* k, int64_t h0, int64_t j, int64_t n,
                                   float* s) {
  vecf<W> acc[HB][4] = {};
#pragma GCC unroll 8
  for (int i = 0; i < V; ++i) {
    vecf<W> kv[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) kv[c] = loadv<W>(k[c] + W * i);
#pragma GCC unroll 4
    for (int b = 0; b < HB; ++b) {
      const vecf<W> qv = loadv<W>(q + (h0 + b) * hd + W * i);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[b][c] += qv * kv[c];
    }
  }
#pragma GCC unroll 4
  for (int b = 0; b < HB; ++b) {
    const vec4 sums = sum4(acc[b][0], acc[b][1], acc[b][2], acc[b][3]);
    for (int c = 0; c < 4; ++c) s[(h0 + b) * n + j + c] = sums[c];
  }
}

template <int W, int V>
INKLING_INLINE void group_dots_rows(const float* q, int64_t g, int64_t hd, const float* base, int64_t stride,
                                    const int64_t* loc, int64_t n, float* s) {
  for (int64_t c = 0; c < std::min(n, kRowsAhead); ++c) prefetch_row(base + loc[c] * stride, hd);
  int64_t j = 0;
  if constexpr (V > 0) {
    constexpr int HB = kDotHeads<W>;
    for (; j + 4 <= n; j += 4) {  // four keys at a time, their sums reduced together
      const float* k[4] = {base + loc[j] * stride, base + loc[j + 1] * stride, base + loc[j + 2] * stride,
                           base + loc[j + 3] * stride};
      for (int64_t c = j + kRowsAhead; c < std::min(n, j + kRowsAhead + 4); ++c) prefetch_row(base + loc[c] * stride, hd);
      int64_t h = 0;
      for (; h + HB <= g; h += HB) dots_four_keys<W, V, HB>(q, hd, k, h, j, n, s);
      if constexpr (HB > 2)
        for (; h + 2 <= g; h += 2) dots_four_keys<W, V, 2>(q, hd, k, h, j, n, s);
      for (; h < g; ++h) dots_four_keys<W, V, 1>(q, hd, k, h, j, n, s);
    }
  }
  for (; j < n; ++j) {
    const float* kj = base + loc[j] * stride;
    for (int64_t h = 0; h < g; ++h) s[h * n + j] = dot_body<W>(q + h * hd, kj, hd);
  }
}

// Heads h0 .. h0 + HB - 1 of acc += p . values, their sums in registers over every value row.
template <int W, int V, int HB>
INKLING_INLINE void values_heads(const float* p, int64_t h0, int64_t n, const float* base, int64_t stride,
                                 const int64_t* loc, int64_t hd, float* acc) {
  vecf<W> sum[HB][V];
#pragma GCC unroll 4
  for (int b = 0; b < HB; ++b)
#pragma GCC unroll 8
    for (int i = 0; i < V; ++i) sum[b][i] = loadv<W>(acc + (h0 + b) * hd + W * i);
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = base + loc[j] * stride;
    if (h0 == 0 && j + kRowsAhead < n) prefetch_row(base + loc[j + kRowsAhead] * stride, hd);
#pragma GCC unroll 8
    for (int i = 0; i < V; ++i) {
      const vecf<W> vv = loadv<W>(vj + W * i);
#pragma GCC unroll 4
      for (int b = 0; b < HB; ++b) sum[b][i] += p[(h0 + b) * n + j] * vv;
    }
  }
#pragma GCC unroll 4
  for (int b = 0; b < HB; ++b)
#pragma GCC unroll 8
    for (int i = 0; i < V; ++i) storev<W>(acc + (h0 + b) * hd + W * i, sum[b][i]);
}

template <int W, int V>
INKLING_INLINE void group_values_rows(const float* p, int64_t g, int64_t n, const float* base, int64_t stride,
                                      const int64_t* loc, int64_t hd, float* acc) {
  for (int64_t c = 0; c < std::min(n, kRowsAhead); ++c) prefetch_row(base + loc[c] * stride, hd);
  if constexpr (V > 0) {
    constexpr int HB = kValueSums<W> / V >= 4 ? 4 : kValueSums<W> / V >= 2 ? 2 : 1;
    int64_t h = 0;
    for (; h + HB <= g; h += HB) values_heads<W, V, HB>(p, h, n, base, stride, loc, hd, acc);
    if constexpr (HB > 2)
      for (; h + 2 <= g; h += 2) values_heads<W, V, 2>(p, h, n, base, stride, loc, hd, acc);
    for (; h < g; ++h) values_heads<W, V, 1>(p, h, n, base, stride, loc, hd, acc);
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = base + loc[j] * stride;
      for (int64_t h = 0; h < g; ++h) axpy_body<W>(p[h * n + j], vj, acc + h * hd, hd);
    }
  }
}

// The row in registers for head_dim 64 and 128 where it fits in 8 vectors; the generic loops otherwise.
template <int W>
INKLING_INLINE void group_dots_body(const float* q, int64_t g, int64_t hd, const float* base, int64_t stride,
                                    const int64_t* loc, int64_t n, float* s) {
  constexpr int V64 = 64 / W <= 8 ? 64 / W : 0, V128 = 128 / W <= 8 ? 128 / W : 0;
  if (V64 && hd == 64) group_dots_rows<W, V64>(q, g, hd, base, stride, loc, n, s);
  else if (V128 && hd == 128) group_dots_rows<W, V128>(q, g, hd, base, stride, loc, n, s);
  else group_dots_rows<W, 0>(q, g, hd, base, stride, loc, n, s);
}

template <int W>
INKLING_INLINE void group_values_body(const float* p, int64_t g, int64_t n, const float* base, int64_t stride,
                                      const int64_t* loc, int64_t hd, float* acc) {
  constexpr int V64 = 64 / W <= 8 ? 64 / W : 0, V128 = 128 / W <= 8 ? 128 / W : 0;
  if (V64 && hd == 64) group_values_rows<W, V64>(p, g, n, base, stride, loc, hd, acc);
  else if (V128 && hd == 128) group_values_rows<W, V128>(p, g, n, base, stride, loc, hd, acc);
  else group_values_rows<W, 0>(p, g, n, base, stride, loc, hd, acc);
}

// Prefill attention in tiles: up to kTileLanes (query, head) lanes of one sequence and kv head (a
// few consecutive queries x the heads that share the kv head) over the n consecutive keys they read.
// Scores are kept transposed, [key][lane], so that each element of a key row, broadcast once, serves
// every lane in two registers: four keys at a time make eight accumulators, and the values likewise
// eight head_dim columns at a time. The decode kernels above read each key once per query instead.

// s[j][m] = scale * (q_m . k_j) for keys j = j0 .. j0 + C - 1 (row j at k + j * ks); qt is q^T, [hd][lanes].
template <int C>
INKLING_INLINE void tile_dots(const float* qt, int64_t hd, const float* k, int64_t ks, int64_t j0, float scale,
                              float* s) {
  vec16 acc[C][2] = {};
  for (int64_t d = 0; d < hd; ++d) {
    const vec16 q0 = loadv<16>(qt + d * kTileLanes), q1 = loadv<16>(qt + d * kTileLanes + 16);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const float kd = k[(j0 + c) * ks + d];
      acc[c][0] += kd * q0;
      acc[c][1] += kd * q1;
    }
  }
  for (int c = 0; c < C; ++c) {
    storev<16>(s + (j0 + c) * kTileLanes, acc[c][0] * scale);
    storev<16>(s + (j0 + c) * kTileLanes + 16, acc[c][1] * scale);
  }
}

INKLING_INLINE void tile_scores_body(const float* qt, int64_t hd, const float* k, int64_t ks, int64_t n, float scale,
                                     float* s) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) tile_dots<4>(qt, hd, k, ks, j, scale, s);
  for (; j < n; ++j) tile_dots<1>(qt, hd, k, ks, j, scale, s);
}

// ot[d][m] += sum_j p[j][m] v_j[d] over the n keys given, for columns d = d0 .. d0 + C - 1.
template <int C>
INKLING_INLINE void tile_values(const float* p, int64_t n, const float* v, int64_t vs, int64_t d0, float* ot) {
  vec16 acc[C][2];
  for (int c = 0; c < C; ++c) {
    acc[c][0] = loadv<16>(ot + (d0 + c) * kTileLanes);
    acc[c][1] = loadv<16>(ot + (d0 + c) * kTileLanes + 16);
  }
  for (int64_t j = 0; j < n; ++j) {
    const vec16 p0 = loadv<16>(p + j * kTileLanes), p1 = loadv<16>(p + j * kTileLanes + 16);
    const float* vj = v + j * vs + d0;
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      acc[c][0] += vj[c] * p0;
      acc[c][1] += vj[c] * p1;
    }
  }
  for (int c = 0; c < C; ++c) {
    storev<16>(ot + (d0 + c) * kTileLanes, acc[c][0]);
    storev<16>(ot + (d0 + c) * kTileLanes + 16, acc[c][1]);
  }
}

// Keys per block of the softmax's second half: a block's probabilities (8 KB) stay in L1 while every
// head_dim column block reads them.
constexpr int64_t kTileKeys = 64;

// Each lane's softmax over the n keys (a key hidden from a lane holds -inf: probability exactly 0),
// then ot = p v / the lane's sum. After the maximum, the keys go in blocks: exp, then p v.
INKLING_INLINE void tile_softmax_values_body(float* s, int64_t n, const float* v, int64_t vs, int64_t hd,
                                             float* ot) {
  vec16 mx[2] = {vec16{} - INFINITY, vec16{} - INFINITY};
  for (int64_t j = 0; j < n; ++j)
    for (int h = 0; h < 2; ++h) {
      const vec16 x = loadv<16>(s + j * kTileLanes + 16 * h);
      mx[h] = x > mx[h] ? x : mx[h];
    }
  std::fill(ot, ot + hd * kTileLanes, 0.0f);
  vec16 total[2] = {};
  for (int64_t j0 = 0; j0 < n; j0 += kTileKeys) {
    const int64_t nb = std::min(kTileKeys, n - j0);
    float* p = s + j0 * kTileLanes;
    for (int64_t j = 0; j < nb; ++j)
      for (int h = 0; h < 2; ++h) {
        const vec16 e = expv<16>(loadv<16>(p + j * kTileLanes + 16 * h) - mx[h]);
        storev<16>(p + j * kTileLanes + 16 * h, e);
        total[h] += e;
      }
    int64_t d = 0;
    for (; d + 8 <= hd; d += 8) tile_values<8>(p, nb, v + j0 * vs, vs, d, ot);
    for (; d < hd; ++d) tile_values<1>(p, nb, v + j0 * vs, vs, d, ot);
  }
  for (int64_t d = 0; d < hd; ++d)
    for (int h = 0; h < 2; ++h) storev<16>(ot + d * kTileLanes + 16 * h, loadv<16>(ot + d * kTileLanes + 16 * h) / total[h]);
}

// Built per instruction set, like the matmul, each on vectors of its register width; `attributes`
// empty gives the portable build (SSE2, 4 floats).
#define INKLING_VECTOR_FOR(isa_name, attributes, width)                                                       \
  attributes void group_dots_##isa_name(const float* q, int64_t g, int64_t hd, const float* base, int64_t stride, \
                                        const int64_t* loc, int64_t n, float* s) {                              \
    group_dots_body<width>(q, g, hd, base, stride, loc, n, s);                                                 \
  }                                                                                                            \
  attributes void group_values_##isa_name(const float* p, int64_t g, int64_t n, const float* base,             \
                                          int64_t stride, const int64_t* loc, int64_t hd, float* acc) {         \
    group_values_body<width>(p, g, n, base, stride, loc, hd, acc);                                             \
  }                                                                                                            \
  attributes void softmax_rows_##isa_name(float* s, const float* bias, int64_t g, int64_t n, float scale) {    \
    softmax_rows_body<width>(s, bias, g, n, scale);                                                            \
  }                                                                                                            \
  attributes void silu_mul_##isa_name(const float* gu, int64_t rows, int64_t I, float* act) {                  \
    silu_mul_body<width>(gu, rows, I, act);                                                                    \
  }                                                                                                            \
  attributes void row_max_sum_##isa_name(const float* x, int64_t V, float* mx, int64_t* at, float* total) {    \
    row_max_sum_body<width>(x, V, mx, at, total);                                                              \
  }                                                                                                            \
  attributes void top_n_##isa_name(const float* x, int64_t V, int64_t n, int64_t* ids, float* vals) {          \
    top_n_body<width>(x, V, n, ids, vals);                                                                     \
  }                                                                                                            \
  attributes int64_t noisy_argmax_##isa_name(const float* c, int64_t V, uint32_t key, int64_t exclude) {       \
    return noisy_argmax_body<width>(c, V, key, exclude);                                                       \
  }
#define INKLING_AVX512 __attribute__((target("avx512f,avx512vl,avx2,fma"), optimize("fp-contract=fast")))
INKLING_VECTOR_FOR(avx512, INKLING_AVX512, 16)
INKLING_VECTOR_FOR(avx2, __attribute__((target("avx2,fma"), optimize("fp-contract=fast"))), 8)
INKLING_VECTOR_FOR(portable, , 4)

// The prefill tiles: AVX-512 only (see fp32_tiles_built).
INKLING_AVX512 void tile_scores_avx512(const float* qt, int64_t hd, const float* k, int64_t ks, int64_t n,
                                       float scale, float* s) {
  tile_scores_body(qt, hd, k, ks, n, scale, s);
}
INKLING_AVX512 void tile_softmax_values_avx512(float* s, int64_t n, const float* v, int64_t vs, int64_t hd,
                                               float* ot) {
  tile_softmax_values_body(s, n, v, vs, hd, ot);
}

// Without wide registers the blocked kernel spills: plain loops the compiler vectorises for SSE, the
// terms of each output in order h = 0, 1, ... (16 partial sums in W's layout, added lane by lane).
template <typename T>
void portable_outputs(const float* x, int64_t n, int64_t H, const T* w, int64_t O, int64_t w_o, int64_t w_h,
                      int64_t o0, int64_t o1, int64_t h0, int64_t h1, float* y) {
  constexpr int64_t L = 16;
  if (w_h == 1) {  // rows of W contiguous: one dot product per (row, output)
    for (int64_t o = o0; o < o1; ++o) {
      const T* wo = w + o * w_o;
      for (int64_t r = 0; r < n; ++r) {
        const float* xr = x + r * H;
        float acc[L] = {0};
        int64_t h = 0;
        for (; h + L <= H; h += L)
          for (int64_t j = 0; j < L; ++j) acc[j] += xr[h + j] * wo[h + j];
        float total = 0.0f;
        for (int64_t j = 0; j < L; ++j) total += acc[j];
        for (; h < H; ++h) total += xr[h] * wo[h];
        y[r * O + o] = total;
      }
    }
    return;
  }
  for (int64_t r = 0; r < n; ++r) std::fill(y + r * O + o0, y + r * O + o1, 0.0f);
  for (int64_t h = h0; h < h1; ++h) {  // columns of W contiguous: y[r, o0:o1] += x[r, h] * W^T[h, o0:o1]
    const T* wh = w + h * w_h;
    for (int64_t r = 0; r < n; ++r) {
      const float xv = x[r * H + h];
      float* yr = y + r * O;
      for (int64_t o = o0; o < o1; ++o) yr[o] += xv * wh[o];
    }
  }
}
void matmul_outputs_portable(const float* x, int64_t n, int64_t H, const float* w, int64_t O, int64_t w_o,
                             int64_t w_h, int64_t o0, int64_t o1, int64_t h0, int64_t h1, float* y) {
  portable_outputs(x, n, H, w, O, w_o, w_h, o0, o1, h0, h1, y);
}
void matmul_q8_outputs_portable(const float* x, int64_t n, int64_t H, const int8_t* w, int64_t O, int64_t w_o,
                                int64_t w_h, int64_t o0, int64_t o1, int64_t h0, int64_t h1, float* y) {
  portable_outputs(x, n, H, w, O, w_o, w_h, o0, o1, h0, h1, y);
}
void widen_scaled_portable(const int8_t* q, int64_t rows, int64_t cols, int64_t stride, const float* row_scale,
                           const float* col_scale, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = q[r * stride + c] * (row_scale ? row_scale[r] : col_scale[c]);
}

using MatmulKernel = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t, int64_t,
                              int64_t, int64_t, int64_t, float*);
using MatmulQ8Kernel = void (*)(const float*, int64_t, int64_t, const int8_t*, int64_t, int64_t, int64_t, int64_t,
                                int64_t, int64_t, int64_t, float*);

struct MatmulChoice {
  const char* isa;
  MatmulKernel kernel;
  MatmulQ8Kernel kernel_q8;
  void (*group_dots)(const float*, int64_t, int64_t, const float*, int64_t, const int64_t*, int64_t, float*);
  void (*group_values)(const float*, int64_t, int64_t, const float*, int64_t, const int64_t*, int64_t, float*);
  void (*softmax_rows)(float*, const float*, int64_t, int64_t, float);
  void (*silu_mul)(const float*, int64_t, int64_t, float*);
  void (*tile_scores)(const float*, int64_t, const float*, int64_t, int64_t, float, float*);  // AVX-512 only
  void (*tile_softmax_values)(float*, int64_t, const float*, int64_t, int64_t, float*);
  void (*widen_scaled)(const int8_t*, int64_t, int64_t, int64_t, const float*, const float*, float*);
  void (*row_max_sum)(const float*, int64_t, float*, int64_t*, float*);
  void (*top_n)(const float*, int64_t, int64_t, int64_t*, float*);
  int64_t (*noisy_argmax)(const float*, int64_t, uint32_t, int64_t);
};

MatmulChoice choose_matmul() {
  __builtin_cpu_init();
  const char* forced = std::getenv("INKLING_CPU_ISA");
  const std::string want = forced ? forced : "";
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("fma");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if ((want.empty() || want == "avx512") && avx512)
    return {"avx512", matmul_outputs_avx512, matmul_q8_outputs_avx512, group_dots_avx512, group_values_avx512, softmax_rows_avx512,
          silu_mul_avx512, tile_scores_avx512, tile_softmax_values_avx512, widen_scaled_avx512,
          row_max_sum_avx512, top_n_avx512, noisy_argmax_avx512};
  if ((want.empty() || want == "avx512" || want == "avx2") && avx2)
    return {"avx2", matmul_outputs_avx2, matmul_q8_outputs_avx2, group_dots_avx2, group_values_avx2, softmax_rows_avx2,
          silu_mul_avx2, nullptr, nullptr, widen_scaled_avx2,
          row_max_sum_avx2, top_n_avx2, noisy_argmax_avx2};
  return {"portable", matmul_outputs_portable, matmul_q8_outputs_portable, group_dots_portable, group_values_portable, softmax_rows_portable,
          silu_mul_portable, nullptr, nullptr, widen_scaled_portable,
          row_max_sum_portable, top_n_portable, noisy_argmax_portable};
}

const MatmulChoice& matmul_choice() {
  static const MatmulChoice choice = choose_matmul();
  return choice;
}

// A task of the intra-op pool should read at least this much weight: below it, waking a thread
// costs more than the task saves.
constexpr int64_t kTaskBytes = 64 << 10;
constexpr int64_t kChunkRows = 64;     // rows of W^T per task: a contiguous block of the weight
constexpr int64_t kChunkCols = 4096;   // columns of W^T per task at most
constexpr int64_t kMaxScratchFloats = 1 << 20;  // partial sums of one matmul (4 MB) at most
// Working buffers kept with their thread between calls up to this size (decode); larger ones (a
// prefill's) are freed after the call.
constexpr size_t kKeepScratchFloats = 4 << 20;

// One matmul cut into tasks that each read one contiguous block of the weight and write outputs no
// other task writes, so that tasks run in any order on any thread with the same result:
// - W's layout: ranges of outputs (whole rows of W), one task each;
// - W^T's: (chunk of rows of W^T, range of columns) pairs; each chunk's partial sums go to a scratch
//   buffer of their own, and `reduce` adds the chunks in order. The chunks depend on the shape and the
//   rows only, never on the thread count. From kBlockedRows rows: ranges of kBlockedColumns columns, each
//   with every row of W^T (one chunk, no scratch).
// An int8 weight (wq, with one scale per output) splits the same way; `reduce` then scales each output.
struct SplitMatmul {
  const float* x;
  int64_t n, H;
  const float* w;      // fp32 weight, or null ...
  const int8_t* wq;    // ... and the int8 one with its scales
  const float* scale;
  int64_t O, w_o, w_h;
  float* y;
  float* partial;  // h_chunks x n x O floats when h_chunks > 1, else unused
  int64_t o_step = 0, o_tasks = 0, h_chunks = 1, chunk_rows = 0;

  SplitMatmul(const float* x_, int64_t n_, int64_t H_, const float* w_, int64_t O_, int64_t w_o_, int64_t w_h_,
              float* y_)
      : SplitMatmul(x_, n_, H_, w_, nullptr, nullptr, O_, w_o_, w_h_, y_) {}
  SplitMatmul(const float* x_, int64_t n_, int64_t H_, const int8_t* wq_, const float* scale_, int64_t O_,
              int64_t w_o_, int64_t w_h_, float* y_)
      : SplitMatmul(x_, n_, H_, nullptr, wq_, scale_, O_, w_o_, w_h_, y_) {}
  SplitMatmul(const float* x_, int64_t n_, int64_t H_, const float* w_, const int8_t* wq_, const float* scale_,
              int64_t O_, int64_t w_o_, int64_t w_h_, float* y_)
      : x(x_), n(n_), H(H_), w(w_), wq(wq_), scale(scale_), O(O_), w_o(w_o_), w_h(w_h_), y(y_), partial(nullptr) {
    if (w_h == 1) {
      // One range of outputs per thread, each at least kTaskBytes of weight: a longer range streams
      // faster (dot_outputs), and outputs are independent, so the split changes no result.
      const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
      o_step = std::max<int64_t>({1, (O + threads - 1) / threads, kTaskBytes / std::max<int64_t>(1, elem_bytes() * H)});
    } else if (n >= kBlockedRows) {
      // Every term in one task: axpy_rows_outputs sums each output over all of them in order (fewer
      // rows add chunks' partial sums, so a row's last bits may differ from the same row in a smaller
      // batch). Columns kBlockedColumns at a time, enough of them that a task reads kTaskBytes.
      o_step = kBlockedColumns *
               std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, kBlockedColumns * elem_bytes() * H));
      chunk_rows = H;
    } else {
      o_step = std::min<int64_t>(kChunkCols, (O + 15) / 16 * 16);
      // Chunks of kChunkRows rows, fewer (and longer, in steps of kGroup) where the partial sums would
      // pass kMaxScratchFloats: the chunking depends on the shape and the rows only.
      h_chunks = std::min((H + kChunkRows - 1) / kChunkRows,
                          std::max<int64_t>(1, kMaxScratchFloats / std::max<int64_t>(1, n * O)));
      chunk_rows = (H + h_chunks - 1) / h_chunks;
      chunk_rows = (chunk_rows + kGroup - 1) / kGroup * kGroup;
      h_chunks = (H + chunk_rows - 1) / chunk_rows;
    }
    o_tasks = (O + o_step - 1) / o_step;
  }
  int64_t elem_bytes() const { return wq ? 1 : 4; }
  int64_t weight_bytes() const { return O * H * elem_bytes(); }
  int64_t tasks() const { return o_tasks * h_chunks; }
  int64_t scratch_floats() const { return h_chunks > 1 ? h_chunks * n * O : 0; }
  bool reduces() const { return h_chunks > 1 || scale != nullptr; }
  void run(int64_t task, const MatmulChoice& kernels) const {
    const int64_t chunk = task / o_tasks, o0 = task % o_tasks * o_step, o1 = std::min(O, o0 + o_step);
    const int64_t h0 = chunk * chunk_rows, h1 = w_h == 1 ? H : std::min(H, h0 + chunk_rows);
    float* out = h_chunks > 1 ? partial + chunk * n * O : y;
    if (wq) kernels.kernel_q8(x, n, H, wq, O, w_o, w_h, o0, o1, h0, h1, out);
    else kernels.kernel(x, n, H, w, O, w_o, w_h, o0, o1, h0, h1, out);
  }
  // y = the chunks' partial sums, added in chunk order, times the scales of an int8 weight; outputs
  // [o0, o1) of every row.
  void reduce(int64_t o0, int64_t o1) const {
    for (int64_t r = 0; r < n; ++r) {
      float* yr = y + r * O;
      if (h_chunks > 1) {
        std::copy(partial + r * O + o0, partial + r * O + o1, yr + o0);
        for (int64_t c = 1; c < h_chunks; ++c) {
          const float* pr = partial + (c * n + r) * O;
          for (int64_t o = o0; o < o1; ++o) yr[o] += pr[o];
        }
      }
      if (scale)
        for (int64_t o = o0; o < o1; ++o) yr[o] *= scale[o];
    }
  }
};

// The calling thread's scratch for partial sums, grown as needed (no allocation per call once warm);
// past kKeepScratchFloats it is freed after the call (release_large_scratch).
std::vector<float>& scratch_buffer() {
  thread_local std::vector<float> buffer;
  return buffer;
}
float* scratch(int64_t floats) {
  auto& buffer = scratch_buffer();
  if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}
void release_large_scratch() {
  if (scratch_buffer().capacity() > kKeepScratchFloats) std::vector<float>().swap(scratch_buffer());
}

// Runs the tasks of every matmul in `parts` on the intra-op pool, then their reductions.
void run_split(std::vector<SplitMatmul>& parts) {
  int64_t floats = 0, tasks = 0, bytes = 0;
  for (const auto& p : parts) floats += p.scratch_floats();
  float* buffer = scratch(floats);
  std::vector<std::pair<int64_t, int64_t>> all;  // (part, task)
  for (size_t i = 0; i < parts.size(); ++i) {
    parts[i].partial = buffer;
    buffer += parts[i].scratch_floats();
    for (int64_t t = 0; t < parts[i].tasks(); ++t) all.emplace_back(i, t);
    tasks += parts[i].tasks();
    bytes += parts[i].weight_bytes();
  }
  const MatmulChoice& kernels = matmul_choice();
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, bytes / std::max<int64_t>(1, tasks)));
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) parts[all[t].first].run(all[t].second, kernels);
  });
  constexpr int64_t kReduceCols = 1024;
  std::vector<std::pair<int64_t, int64_t>> sums;  // (part, first column)
  for (size_t i = 0; i < parts.size(); ++i)
    if (parts[i].reduces())
      for (int64_t o = 0; o < parts[i].O; o += kReduceCols) sums.emplace_back(i, o);
  at::parallel_for(0, static_cast<int64_t>(sums.size()), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto& p = parts[sums[t].first];
      p.reduce(sums[t].second, std::min(p.O, sums[t].second + kReduceCols));
    }
  });
  release_large_scratch();
}

// y[n, O] = x[n, H] @ W^T over the intra-op pool.
void few_rows_matmul(const float* x, int64_t n, int64_t H, const float* w, int64_t O, int64_t w_o, int64_t w_h,
                     float* y) {
  std::vector<SplitMatmul> one{SplitMatmul(x, n, H, w, O, w_o, w_h, y)};
  run_split(one);
}

void fp32_group_dots(const float* q, int64_t g, int64_t hd, const float* base, int64_t stride, const int64_t* loc,
                     int64_t n, float* s) {
  matmul_choice().group_dots(q, g, hd, base, stride, loc, n, s);
}
void fp32_group_values(const float* p, int64_t g, int64_t n, const float* base, int64_t stride, const int64_t* loc,
                       int64_t hd, float* acc) {
  matmul_choice().group_values(p, g, n, base, stride, loc, hd, acc);
}
void fp32_softmax_rows(float* s, const float* bias, int64_t g, int64_t n, float scale) {
  matmul_choice().softmax_rows(s, bias, g, n, scale);
}
void fp32_tile_scores(const float* qt, int64_t hd, const float* k, int64_t ks, int64_t n, float scale, float* s) {
  matmul_choice().tile_scores(qt, hd, k, ks, n, scale, s);
}
void fp32_tile_softmax_values(float* s, int64_t n, const float* v, int64_t vs, int64_t hd, float* ot) {
  matmul_choice().tile_softmax_values(s, n, v, vs, hd, ot);
}
bool fp32_tiles_built() { return matmul_choice().tile_scores != nullptr; }

// ---- which kernel serves a weight shape: measured per machine, set from Python -------------------
// Per (O, H, layout, thread count): bit r-1 of the mask set = this kernel for r rows (r <= 64), else
// ATen's. Shapes never measured take this kernel up to kDefaultFewRows rows. INKLING_FEW_ROWS=N
// overrides every choice: this kernel up to N rows (to compare the two).
constexpr int64_t kMaxFewRows = 64;
constexpr int64_t kDefaultFewRows = 16;
// int8 weights: this kernel up to this many rows; past it the FMAs, not the weight's bytes, set the
// time, and int8_gemm (blocks dequantized for ATen's GEMM) is faster (tools/bench_matmul.py --int8).
constexpr int64_t kMaxFewRowsInt8 = 32;

struct ShapeKey {
  int64_t O, H, column_major, threads;
  bool operator==(const ShapeKey& o) const {
    return O == o.O && H == o.H && column_major == o.column_major && threads == o.threads;
  }
};
struct ShapeKeyHash {
  size_t operator()(const ShapeKey& k) const {
    size_t h = std::hash<int64_t>()(k.O);
    for (int64_t v : {k.H, k.column_major, k.threads}) h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};

std::shared_mutex choices_lock;
std::unordered_map<ShapeKey, uint64_t, ShapeKeyHash>& matmul_choices() {
  static std::unordered_map<ShapeKey, uint64_t, ShapeKeyHash> choices;
  return choices;
}

int64_t few_rows_override() {
  static const int64_t limit = [] {
    const char* set = std::getenv("INKLING_FEW_ROWS");
    return set ? std::max<int64_t>(0, std::atoll(set)) : int64_t{-1};
  }();
  return limit;
}

// Whether n rows times the weight [O, H] (stride 1 along H, or along O if column-major) take this kernel.
bool few_rows_serves(int64_t O, int64_t H, bool column_major, int64_t n) {
  const int64_t forced = few_rows_override();
  if (forced >= 0) return n <= forced;
  if (n < 1 || n > kMaxFewRows) return false;
  std::shared_lock<std::shared_mutex> read(choices_lock);
  const auto& choices = matmul_choices();
  const auto found = choices.find({O, H, column_major, at::get_num_threads()});
  if (found == choices.end()) return n <= kDefaultFewRows;
  return (found->second >> (n - 1)) & 1u;
}

// Per routed-expert bank (I, H, layouts = 2 * gate_up column-major + down column-major, thread count): bit
// r-1 set = an expert with r rows takes this kernel for both its projections, else ATen's. Measured as the
// two projections' times together (kernel_choice.KernelChoices.experts); a bank never measured takes
// this kernel where both projections' own choices say so.
std::unordered_map<ShapeKey, uint64_t, ShapeKeyHash>& experts_choices() {
  static std::unordered_map<ShapeKey, uint64_t, ShapeKeyHash> choices;
  return choices;
}

bool experts_serve(int64_t I, int64_t H, bool gu_cm, bool down_cm, int64_t n) {
  const int64_t forced = few_rows_override();
  if (forced >= 0) return n <= forced;
  if (n < 1 || n > kMaxFewRows) return false;
  {
    std::shared_lock<std::shared_mutex> read(choices_lock);
    const auto& choices = experts_choices();
    const auto found = choices.find({I, H, 2 * int64_t{gu_cm} + int64_t{down_cm}, at::get_num_threads()});
    if (found != choices.end()) return (found->second >> (n - 1)) & 1u;
  }
  return few_rows_serves(2 * I, H, gu_cm, n) && few_rows_serves(H, I, down_cm, n);
}

// A float buffer that grows without initialising what it holds: every reader here reads only what
// was written first, and a prefill's buffers (tens of MB) would otherwise be zeroed at every call.
struct FloatScratch {
  std::unique_ptr<float[]> data;
  size_t size = 0;
  float* hold(size_t floats) {
    if (floats > size) data.reset(new float[floats]), size = floats;
    return data.get();
  }
  void release() { data.reset(), size = 0; }
};

// The routed experts' working buffers, one set per calling thread, kept between calls: a decode step
// allocates none of them once warm.
struct MoeScratch {
  std::vector<std::vector<int64_t>> rows, slots, token_pairs;
  std::vector<int64_t> first;
  std::vector<char> ours;
  std::vector<float> pair_weight;
  FloatScratch xs, gu, act, ys;
};
MoeScratch& moe_scratch() {
  thread_local MoeScratch scratch;
  return scratch;
}

// An int8 weight's values as the op references define them: q * scale (one scale per row, fp32),
// then cast to the activations' dtype. The paths that hand a weight to ATen's GEMM use it.
at::Tensor dequantized(const at::Tensor& q, const at::Tensor& scale, at::ScalarType dtype) {
  return (q.to(at::kFloat) * scale.unsqueeze(-1)).to(dtype);
}

void check_int8_weight(const char* op, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.scalar_type() == at::kChar, op, ": int8 weight expected, got ", q.scalar_type());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.sizes() == q.sizes().slice(0, q.dim() - 1),
              op, ": one contiguous fp32 scale per weight row expected, got ", scale.sizes(), " for ", q.sizes());
}

// y[n, O] (row stride y_stride) = x[n, H] @ (q * scale)^T for fp32 x, many rows: the weight is dequantized
// a block of outputs at a time into a cache-resident buffer, each block multiplied by ATen's GEMM as it
// comes. A whole dequantized copy would be written to memory and read back by every call, which costs
// a prefill chunk more than the GEMMs (q either layout: [O, H] with stride(1) == 1, or W^T's).
void int8_gemm(const float* x, int64_t n, int64_t H, const at::Tensor& q, const float* scale, float* y,
               int64_t y_stride) {
  const int64_t O = q.size(0);
  TORCH_CHECK(y_stride >= O, "int8_gemm: an output row of ", y_stride, " floats cannot hold ", O, " outputs");
  const bool column_major = q.stride(1) != 1;
  const int64_t block = std::max<int64_t>(16, std::min<int64_t>(O, (256 << 10) / std::max<int64_t>(1, H)) / 16 * 16);
  thread_local FloatScratch buffer;
  float* wb = buffer.hold(block * H);
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  const auto xt = at::from_blob(const_cast<float*>(x), {n, H}, opts);
  const int8_t* qp = q.data_ptr<int8_t>();
  for (int64_t o0 = 0; o0 < O; o0 += block) {
    const int64_t width = std::min(block, O - o0);
    // The block's products go straight to their columns of y (a row stride ATen's GEMM takes as it is):
    // through a buffer, copying them out cost more than the dequantization (2,048 rows: 4 MB a block).
    auto yt = at::from_blob(y + o0, {n, width}, {y_stride, 1}, opts);
    if (column_major) {  // W^T rows h, columns [o0, o0 + width): a [H, width] block, each column its scale
      matmul_choice().widen_scaled(qp + o0, H, width, q.stride(1), nullptr, scale + o0, wb);
      at::mm_out(yt, xt, at::from_blob(wb, {H, width}, opts));
    } else {  // rows [o0, o0 + width) of W, each its scale
      matmul_choice().widen_scaled(qp + o0 * q.stride(0), width, H, q.stride(0), scale + o0, nullptr, wb);
      at::mm_out(yt, xt, at::from_blob(wb, {width, H}, opts).t());
    }
  }
}

// Routed experts: tokens grouped by expert (stable), each chosen expert's weights read once. Experts
// whose rows the measured choice gives to the kernel above run on it, split over the intra-op pool by
// (expert, output range); the others go through ATen's GEMM (prefill). Each token's output sums its
// experts' contributions in expert order: the same result at any thread count. With scales the banks
// are int8 (moe_experts_int8): the kernel above reads them as they are, the busy experts go through
// int8_gemm, and other activation dtypes get dequantized copies.
at::Tensor moe_experts_impl(const at::Tensor& x_in, const at::Tensor& expert_ids, const at::Tensor& weights,
                            const at::Tensor& gate_up, const at::Tensor& down, const at::Tensor* gate_up_scale,
                            const at::Tensor* down_scale) {
  const auto ids = in_dtype(expert_ids, at::kLong).contiguous();
  const auto x = x_in.contiguous();
  const int64_t T = ids.size(0), k = ids.size(1), E = gate_up.size(0), H = x.size(1), I = down.size(2);
  const int64_t* ip = ids.data_ptr<int64_t>();
  MoeScratch& buffers = moe_scratch();  // bound here: tasks on other threads must see this thread's buffers
  auto& rows = buffers.rows;
  auto& slots = buffers.slots;
  for (auto* lists : {&rows, &slots}) {
    if (static_cast<int64_t>(lists->size()) < E) lists->resize(E);
    for (int64_t e = 0; e < E; ++e) (*lists)[e].clear();
  }
  for (int64_t i = 0; i < T * k; ++i) {
    if (ip[i] < 0) continue;  // another rank's expert (expert parallelism): nothing to add here
    TORCH_CHECK(ip[i] < E, "moe_experts: expert id ", ip[i], " outside the bank of ", E);
    rows[ip[i]].push_back(i / k);
    slots[ip[i]].push_back(i);
  }
  const auto flat_w = in_dtype(weights.reshape({-1}), at::kFloat).contiguous();
  auto out = at::zeros_like(x);
  const bool quantized = gate_up_scale != nullptr;
  const auto bank_type = quantized ? at::kChar : at::kFloat;
  const bool fp32 = x.scalar_type() == at::kFloat && gate_up.scalar_type() == bank_type &&
                    down.scalar_type() == bank_type && (gate_up.stride(2) == 1 || gate_up.stride(1) == 1) &&
                    (down.stride(2) == 1 || down.stride(1) == 1);
  const auto opts = at::TensorOptions().dtype(at::kLong);
  auto expert_weight = [&](const at::Tensor& bank, const at::Tensor* scale, int64_t e) {
    return quantized ? dequantized(bank[e], (*scale)[e], x.scalar_type()) : bank[e];
  };
  auto aten_expert = [&](const at::Tensor& xe, int64_t e) {  // down(silu(gate) * up) by ATen's GEMM
    const auto g = at::linear(xe, expert_weight(gate_up, gate_up_scale, e));
    return at::linear(at::silu(g.narrow(1, 0, I)) * g.narrow(1, I, I), expert_weight(down, down_scale, e));
  };
  if (!fp32) {  // bf16 and other dtypes: ATen per expert, in expert order
    for (int64_t e = 0; e < E; ++e) {
      const int64_t n = static_cast<int64_t>(rows[e].size());
      if (n == 0) continue;
      const auto r = at::from_blob(rows[e].data(), {n}, opts);
      const auto s = at::from_blob(slots[e].data(), {n}, opts);
      out.index_add_(0, r, aten_expert(x.index_select(0, r), e) *
                               flat_w.index_select(0, s).unsqueeze(1).to(x.scalar_type()));
    }
    return out;
  }
  // Each (expert, row) pair gets a row of the scratch buffers, experts in order.
  auto& first = buffers.first;
  first.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) first[e + 1] = first[e] + static_cast<int64_t>(rows[e].size());
  const int64_t pairs = first[E];
  float* xs = buffers.xs.hold(pairs * H);
  float* gu = buffers.gu.hold(pairs * 2 * I);
  float* act = buffers.act.hold(pairs * I);
  float* ys = buffers.ys.hold(pairs * H);
  const float* xp = x.data_ptr<float>();
  for (int64_t e = 0; e < E; ++e)
    for (size_t r = 0; r < rows[e].size(); ++r)
      std::memcpy(xs + (first[e] + r) * H, xp + rows[e][r] * H, H * sizeof(float));
  const bool gu_cm = gate_up.stride(1) == 1, down_cm = down.stride(1) == 1;
  auto& ours = buffers.ours;
  ours.assign(E, 0);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = first[e + 1] - first[e];
    // int8 banks: this kernel up to kMaxFewRowsInt8 rows, whatever the fp32 choice says.
    ours[e] = n > 0 && (quantized ? n <= kMaxFewRowsInt8 : experts_serve(I, H, gu_cm, down_cm, n));
  }
  // One matmul of every expert the kernel serves, their tasks on the intra-op pool together.
  auto experts_matmul = [&](const at::Tensor& bank, const at::Tensor* scale, int64_t O, int64_t in,
                            const float* src, float* dst) {
    std::vector<SplitMatmul> parts;
    for (int64_t e = 0; e < E; ++e) {
      if (!ours[e]) continue;
      const float* xe = src + first[e] * in;
      const int64_t n = first[e + 1] - first[e];
      if (quantized)
        parts.emplace_back(xe, n, in, bank.data_ptr<int8_t>() + e * bank.stride(0),
                           scale->data_ptr<float>() + e * O, O, bank.stride(1), bank.stride(2), dst + first[e] * O);
      else
        parts.emplace_back(xe, n, in, bank.data_ptr<float>() + e * bank.stride(0), O, bank.stride(1),
                           bank.stride(2), dst + first[e] * O);
    }
    run_split(parts);
  };
  experts_matmul(gate_up, gate_up_scale, 2 * I, H, xs, gu);
  std::vector<std::pair<int64_t, int64_t>> our_pairs;  // [first, end) of each expert this kernel serves
  for (int64_t e = 0; e < E; ++e)
    if (ours[e]) our_pairs.emplace_back(first[e], first[e + 1]);
  // About 16 rows a task: a decode step's experts (a row or two each) stay on the calling thread.
  const int64_t served = static_cast<int64_t>(our_pairs.size());
  int64_t served_rows = 0;
  for (const auto& [p0, p1] : our_pairs) served_rows += p1 - p0;
  const int64_t silu_grain = std::max<int64_t>(1, 16 * served / std::max<int64_t>(1, served_rows));
  at::parallel_for(0, served, silu_grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [p0, p1] = our_pairs[i];
      matmul_choice().silu_mul(gu + p0 * 2 * I, p1 - p0, I, act + p0 * I);
    }
  });
  experts_matmul(down, down_scale, H, I, act, ys);
  for (int64_t e = 0; e < E; ++e) {  // the busy experts: ATen's GEMM, itself on the intra-op pool
    const int64_t n = first[e + 1] - first[e];
    if (n == 0 || ours[e]) continue;
    // Two GEMMs into the scratch rows this expert owns, and the kernel's silu * up between them: no other
    // ATen call (the glue of views, silu and a product cost a batch-1 step of `small` about 0.4 ms).
    float* ge = gu + first[e] * 2 * I;
    float* ae = act + first[e] * I;
    auto silu_mul_rows = [&] {  // on the intra-op pool, as the GEMMs are: a busy expert has many rows
      at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
        matmul_choice().silu_mul(ge + begin * 2 * I, end - begin, I, ae + begin * I);
      });
    };
    if (quantized) {  // blocks of each bank dequantized as the GEMM goes (int8_gemm)
      int8_gemm(xs + first[e] * H, n, H, gate_up[e], gate_up_scale->data_ptr<float>() + e * 2 * I, ge, 2 * I);
      silu_mul_rows();
      int8_gemm(ae, n, I, down[e], down_scale->data_ptr<float>() + e * H, ys + first[e] * H, H);
      continue;
    }
    auto matrix = [&](const at::Tensor& bank) {  // expert e of a bank, in its layout
      return at::from_blob(bank.data_ptr<float>() + e * bank.stride(0), {bank.size(1), bank.size(2)},
                           {bank.stride(1), bank.stride(2)}, x.options());
    };
    auto g = at::from_blob(ge, {n, 2 * I}, x.options());
    at::mm_out(g, at::from_blob(xs + first[e] * H, {n, H}, x.options()), matrix(gate_up).t());
    silu_mul_rows();
    auto ye = at::from_blob(ys + first[e] * H, {n, H}, x.options());
    at::mm_out(ye, at::from_blob(ae, {n, I}, x.options()), matrix(down).t());
  }
  // Each token adds its experts' rows, weighted, in expert order.
  auto& token_pairs = buffers.token_pairs;
  if (static_cast<int64_t>(token_pairs.size()) < T) token_pairs.resize(T);
  for (int64_t t = 0; t < T; ++t) token_pairs[t].clear();
  auto& pair_weight = buffers.pair_weight;
  pair_weight.resize(pairs);
  const float* wp = flat_w.data_ptr<float>();
  for (int64_t e = 0; e < E; ++e)
    for (size_t r = 0; r < rows[e].size(); ++r) {
      token_pairs[rows[e][r]].push_back(first[e] + r);
      pair_weight[first[e] + r] = wp[slots[e][r]];
    }
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, H)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (const int64_t p : token_pairs[t]) {
        const float wgt = pair_weight[p];
        float* dst = op + t * H;
        const float* src = ys + p * H;
        for (int64_t h = 0; h < H; ++h) dst[h] += src[h] * wgt;
      }
  });
  // Kept for the next call up to decode sizes; a prefill's buffers go with it.
  if (buffers.xs.size + buffers.gu.size + buffers.act.size + buffers.ys.size > kKeepScratchFloats)
    for (auto* buffer : {&buffers.xs, &buffers.gu, &buffers.act, &buffers.ys}) buffer->release();
  return out;
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights,
                       const at::Tensor& gate_up, const at::Tensor& down) {
  return moe_experts_impl(x, expert_ids, weights, gate_up, down, nullptr, nullptr);
}

at::Tensor moe_experts_int8(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights,
                            const at::Tensor& gate_up, const at::Tensor& gate_up_scale, const at::Tensor& down,
                            const at::Tensor& down_scale) {
  check_int8_weight("moe_experts_int8", gate_up, gate_up_scale);
  check_int8_weight("moe_experts_int8", down, down_scale);
  return moe_experts_impl(x, expert_ids, weights, gate_up, down, &gate_up_scale, &down_scale);
}

// y = x @ W^T; fp32 rows through few_rows_matmul where the measured choice says so, else ATen.
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& weight) {
  const int64_t H = x_in.size(-1), O = weight.size(0);
  const int64_t n = H ? x_in.numel() / H : 0;
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == H, "linear: weight [O, ", H, "] expected");
  const bool fp32 = x_in.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                    (weight.stride(1) == 1 || weight.stride(0) == 1);
  if (!fp32 || !few_rows_serves(O, H, weight.stride(1) != 1, n)) return at::linear(x_in, weight);
  const auto x = x_in.contiguous();
  auto sizes = x_in.sizes().vec();
  sizes.back() = O;
  auto y = at::empty(sizes, x.options());
  few_rows_matmul(x.data_ptr<float>(), n, H, weight.data_ptr<float>(), O, weight.stride(0), weight.stride(1),
                  y.data_ptr<float>());
  return y;
}

// y = x @ (q * scale)^T for an int8 weight q [O, H] with one scale per output: fp32 rows up to
// kMaxFewRowsInt8 through the kernel above, which reads q as it is; more rows (prefill) through
// int8_gemm, q dequantized a block at a time for ATen's GEMM. Other dtypes (bf16) take a whole
// dequantized copy per call: correct, not fast.
at::Tensor linear_int8(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scale) {
  const int64_t H = x_in.size(-1), O = weight.size(0);
  const int64_t n = H ? x_in.numel() / H : 0;
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == H, "linear_int8: weight [O, ", H, "] expected");
  check_int8_weight("linear_int8", weight, scale);
  const bool fp32 = x_in.scalar_type() == at::kFloat && (weight.stride(1) == 1 || weight.stride(0) == 1);
  if (!fp32 || n == 0) return at::linear(x_in, dequantized(weight, scale, x_in.scalar_type()));
  const auto x = x_in.contiguous();
  auto sizes = x_in.sizes().vec();
  sizes.back() = O;
  auto y = at::empty(sizes, x.options());
  if (n > kMaxFewRowsInt8) {
    int8_gemm(x.data_ptr<float>(), n, H, weight, scale.data_ptr<float>(), y.data_ptr<float>(), O);
    return y;
  }
  std::vector<SplitMatmul> one{SplitMatmul(x.data_ptr<float>(), n, H, weight.data_ptr<int8_t>(),
                                           scale.data_ptr<float>(), O, weight.stride(0), weight.stride(1),
                                           y.data_ptr<float>())};
  run_split(one);
  return y;
}

// The least value a row keeps under top_k (0 or >= V: off) and then top_p (>= 1: off): its top_k values, then
// the smallest prefix of them whose softmax mass reaches top_p (the top value always kept); -inf where
// neither filters. `ord` is the caller's scratch of V floats.
float filter_threshold(const float* row, int64_t V, int64_t want_k, float p, float* ord) {
  const int64_t k = want_k > 0 && want_k < V ? want_k : V;
  if (k == V && p >= 1.0f) return -INFINITY;
  std::copy(row, row + V, ord);
  std::partial_sort(ord, ord + k, ord + V, ranks_above);  // (a NaN first, where a NaN row filters nothing)
  float total = 0.0f;
  for (int64_t j = 0; j < k; ++j) total += std::exp(ord[j] - ord[0]);
  float threshold = ord[0], mass_before = 0.0f;
  for (int64_t j = 0; j < k && mass_before < p; ++j) {  // the top value is always kept
    threshold = ord[j];
    mass_before += std::exp(ord[j] - ord[0]) / total;
  }
  return threshold;
}

// Sampling filter: rows asking for neither top-k nor top-p are copied as they are (no sort); the others
// keep the values filter_threshold keeps.
at::Tensor top_k_top_p(const at::Tensor& scaled_in, const at::Tensor& top_k, const at::Tensor& top_p) {
  TORCH_CHECK(scaled_in.scalar_type() == at::kFloat, "top_k_top_p takes fp32 scores");
  const auto scaled = scaled_in.contiguous();
  auto out = scaled.clone();
  const auto tk = in_dtype(top_k, at::kLong).contiguous();
  const auto tp = in_dtype(top_p, at::kFloat).contiguous();
  const int64_t B = scaled.size(0), V = scaled.size(1);
  const float* sp = scaled.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Rows are independent: split over the intra-op pool by rows (a sort of V values each).
  at::parallel_for(0, B, task_grain(8 * V), [&](int64_t b0, int64_t b1) {
    std::vector<float> ord(V);
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = sp + b * V;
      const float threshold = filter_threshold(row, V, tk.data_ptr<int64_t>()[b], tp.data_ptr<float>()[b], ord.data());
      float* dst = op + b * V;
      for (int64_t v = 0; v < V; ++v)
        if (row[v] < threshold) dst[v] = -INFINITY;
    }
  });
  return out;
}

// ---- The sampler of a decode or verify step, row by row (custom_ops/sampling.py has its reference) ----
// A greedy row (temperature 0) costs two passes over its logits (maximum and e^ sum, then its top n); only
// a sampled row pays for its filter and its noise, where the reference computes both for every row.

uint32_t mix32(uint32_t x) {
  for (int round = 0; round < 2; ++round) {
    x ^= x >> 16;
    x *= 0x45D9F3Bu;
  }
  return x ^ (x >> 16);
}

// uniform_noise's value at (row key, vocabulary id): uniform_lanes for one id.
float uniform_at(uint32_t key, int64_t id) {
  return (static_cast<float>(mix32(key ^ static_cast<uint32_t>(id) * 0x165667B1u) >> 9) + 0.5f) * (1.0f / 8388608.0f);
}

// One row's draw: its temperature and filters, and its noise key (uniform_noise's first mix, of the
// request's 32-bit seed key and the index of the token being drawn).
struct RowDraw {
  float temperature, top_p;
  int64_t top_k;
  uint32_t key;
};

// Per-row parameter tensors read in place (converted only where a caller passed another dtype).
struct RowParams {
  at::Tensor temperature, top_k, top_p, seed, counter;
  RowParams(const at::Tensor& t, const at::Tensor& k, const at::Tensor& p, const at::Tensor& s, const at::Tensor& c,
            int64_t rows, const char* op)
      : temperature(in_dtype(t, at::kFloat).contiguous()), top_k(in_dtype(k, at::kLong).contiguous()),
        top_p(in_dtype(p, at::kFloat).contiguous()), seed(in_dtype(s, at::kLong).contiguous()),
        counter(in_dtype(c, at::kLong).contiguous()) {
    for (const auto* x : {&temperature, &top_k, &top_p, &seed, &counter})
      TORCH_CHECK(x->dim() == 1 && x->size(0) == rows, op, ": one sampling parameter per row expected");
  }
  // Row b drawing the token `ahead` places after its counter's.
  RowDraw draw(int64_t b, int64_t ahead) const {
    const uint32_t salt = static_cast<uint32_t>(counter.data_ptr<int64_t>()[b] + ahead) * 0x27D4EB2Du;
    return {temperature.data_ptr<float>()[b], top_p.data_ptr<float>()[b], top_k.data_ptr<int64_t>()[b],
            mix32(static_cast<uint32_t>(seed.data_ptr<int64_t>()[b]) ^ salt)};
  }
};

// One row of logits: its greedy token, log-softmax denominator and top n, and (for a sampled row) its
// candidates, the scaled and filtered logits the draw reads, in `work` (2 V floats of the caller's).
struct RowLogits {
  const float* x;
  int64_t V;
  float mx, log_total;
  int64_t greedy;

  RowLogits(const float* x_, int64_t V_, const MatmulChoice& kernels) : x(x_), V(V_) {
    float total;
    kernels.row_max_sum(x, V, &mx, &greedy, &total);
    log_total = std::log(total);
  }
  float logprob(int64_t id) const { return (x[id] - mx) - log_total; }
  void top(int64_t n, const MatmulChoice& kernels, int64_t* ids, float* vals) const {
    if (n == 0) return;
    kernels.top_n(x, V, n, ids, vals);
    for (int64_t j = 0; j < n; ++j) vals[j] = (vals[j] - mx) - log_total;
  }
  // x / temperature (at least 1e-6), -inf outside the row's top_k and top_p, into work[0, V).
  const float* candidates(const RowDraw& d, float* work) const {
    const float t = std::max(d.temperature, 1e-6f);
    for (int64_t i = 0; i < V; ++i) work[i] = x[i] / t;
    const float threshold = filter_threshold(work, V, d.top_k, d.top_p, work + V);
    for (int64_t i = 0; i < V; ++i)
      if (work[i] < threshold) work[i] = -INFINITY;
    return work;
  }
};

void check_logits(const at::Tensor& logits, int64_t dims, int64_t top_n, const char* op) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == dims && logits.size(-1) >= 1, op,
              ": fp32 logits of ", dims, " dimensions expected, got ", logits.scalar_type(), " ", logits.sizes());
  TORCH_CHECK(top_n >= 0, op, ": top_n must be >= 0");
}

// A decode (or prefill) step's sampler: per row its token (the argmax where temperature is 0, else the
// Gumbel-max draw over its candidates), the token's logprob and the top_n (at most V) logprobs, most
// likely first.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sample_tokens(
    const at::Tensor& logits_in, const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
    const at::Tensor& seed, const at::Tensor& counter, int64_t top_n) {
  check_logits(logits_in, 2, top_n, "sample_tokens");
  const auto logits = logits_in.contiguous();
  const int64_t B = logits.size(0), V = logits.size(1), n = std::min(top_n, V);
  const RowParams params(temperature, top_k, top_p, seed, counter, B, "sample_tokens");
  auto tokens = at::empty({B}, logits.options().dtype(at::kLong));
  auto chosen = at::empty({B}, logits.options());
  auto top_ids = at::empty({B, n}, logits.options().dtype(at::kLong));
  auto top_vals = at::empty({B, n}, logits.options());
  const MatmulChoice& kernels = matmul_choice();
  at::parallel_for(0, B, task_grain(4 * V), [&](int64_t b0, int64_t b1) {
    std::vector<float> work;
    for (int64_t b = b0; b < b1; ++b) {
      const RowLogits row(logits.data_ptr<float>() + b * V, V, kernels);
      const RowDraw d = params.draw(b, 0);
      int64_t token = row.greedy;
      if (d.temperature > 0) {
        work.resize(2 * V);
        token = kernels.noisy_argmax(row.candidates(d, work.data()), V, d.key, -1);
      }
      tokens.data_ptr<int64_t>()[b] = token;
      chosen.data_ptr<float>()[b] = row.logprob(token);
      row.top(n, kernels, top_ids.data_ptr<int64_t>() + b * n, top_vals.data_ptr<float>() + b * n);
    }
  });
  return {tokens, chosen, top_ids, top_vals};
}

// A verify step's sampler over rows of T positions (logits [B, T, V]; inputs [B, T], the row's newest
// token then its drafts; drafted [B], the real drafts): position i checks draft inputs[b, i + 1] (the last
// position a stand-in, inputs[b, 0]); a greedy row accepts a draft that is its argmax, a sampled one with
// the draft's probability under its candidates (the accept draw is noise column V), and where it stops
// takes its argmax, or draws from its candidates with the draft removed. Returns (tokens [B, T]: the
// accepted drafts then each position's own, accepted [B], each token's logprob [B, T], the top_n [B, T, n]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> verify_tokens(
    const at::Tensor& logits_in, const at::Tensor& inputs_in, const at::Tensor& drafted_in,
    const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& seed,
    const at::Tensor& counter, int64_t top_n) {
  check_logits(logits_in, 3, top_n, "verify_tokens");
  const auto logits = logits_in.contiguous();
  const auto inputs = in_dtype(inputs_in, at::kLong).contiguous();
  const auto drafted = in_dtype(drafted_in, at::kLong).contiguous();
  const int64_t B = logits.size(0), T = logits.size(1), V = logits.size(2), n = std::min(top_n, V);
  TORCH_CHECK(inputs.dim() == 2 && inputs.size(0) == B && inputs.size(1) == T && drafted.numel() == B,
              "verify_tokens: inputs [B, T] and drafted [B] expected for logits ", logits.sizes());
  const RowParams params(temperature, top_k, top_p, seed, counter, B, "verify_tokens");
  auto tokens = at::empty({B, T}, logits.options().dtype(at::kLong));
  auto accepted = at::empty({B}, logits.options().dtype(at::kLong));
  auto chosen = at::empty({B, T}, logits.options());
  auto top_ids = at::empty({B, T, n}, logits.options().dtype(at::kLong));
  auto top_vals = at::empty({B, T, n}, logits.options());
  const MatmulChoice& kernels = matmul_choice();
  at::parallel_for(0, B, task_grain(4 * T * V), [&](int64_t b0, int64_t b1) {
    std::vector<float> work;
    std::vector<RowLogits> rows;  // the row's positions
    rows.reserve(T);
    std::vector<int64_t> own(T);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t* in = inputs.data_ptr<int64_t>() + b * T;
      const int64_t real = drafted.data_ptr<int64_t>()[b];
      int64_t* out = tokens.data_ptr<int64_t>() + b * T;
      int64_t run = 0;  // the leading run of accepted drafts
      bool running = true;
      rows.clear();
      for (int64_t i = 0; i < T; ++i) {
        const RowLogits& row = rows.emplace_back(logits.data_ptr<float>() + (b * T + i) * V, V, kernels);
        const RowDraw d = params.draw(b, i);
        const int64_t draft = std::clamp<int64_t>(in[(i + 1) % T], 0, V - 1);
        const bool has_draft = i < real;
        bool accept = draft == row.greedy;
        own[i] = row.greedy;
        if (d.temperature > 0) {
          work.resize(2 * V);
          const float* c = row.candidates(d, work.data());
          float cmax, ctotal;
          int64_t ctop;
          kernels.row_max_sum(c, V, &cmax, &ctop, &ctotal);
          accept = uniform_at(d.key, V) < std::exp(c[draft] - cmax) / ctotal;  // the accept draw: column V
          own[i] = kernels.noisy_argmax(c, V, d.key, has_draft ? draft : -1);
        }
        running = running && accept && has_draft;
        run += running;
        out[i] = draft;  // (past the run, the position's own token replaces it below)
        row.top(n, kernels, top_ids.data_ptr<int64_t>() + (b * T + i) * n, top_vals.data_ptr<float>() + (b * T + i) * n);
      }
      accepted.data_ptr<int64_t>()[b] = run;
      for (int64_t i = 0; i < T; ++i) {
        if (i >= run) out[i] = own[i];
        chosen.data_ptr<float>()[b * T + i] = rows[i].logprob(out[i]);
      }
    }
  });
  return {tokens, accepted, chosen, top_ids, top_vals};
}

}  // namespace

// Which matmul build the loader picked, for Python (ctypes) to report.
extern "C" const char* inkling_cpu_isa() { return matmul_choice().isa; }

// The measured choice for one weight shape at one thread count (see few_rows_serves), from Python
// (ctypes): bit r-1 of `rows_mask` set = the few-rows kernel for r rows.
extern "C" void inkling_set_matmul_choice(int64_t O, int64_t H, int64_t column_major, int64_t threads,
                                          uint64_t rows_mask) {
  std::unique_lock<std::shared_mutex> write(choices_lock);
  matmul_choices()[{O, H, column_major != 0, threads}] = rows_mask;
}

// The measured choice for one routed-expert bank (see experts_serve): bit r-1 of `rows_mask` set = the
// few-rows kernel for an expert with r rows.
extern "C" void inkling_set_experts_choice(int64_t I, int64_t H, int64_t gate_up_column_major,
                                           int64_t down_column_major, int64_t threads, uint64_t rows_mask) {
  std::unique_lock<std::shared_mutex> write(choices_lock);
  experts_choices()[{I, H, 2 * (gate_up_column_major != 0) + (down_column_major != 0), threads}] = rows_mask;
}

// Forgets every measured choice (shapes and expert banks fall back to the default).
extern "C" void inkling_clear_matmul_choices() {
  std::unique_lock<std::shared_mutex> write(choices_lock);
  matmul_choices().clear();
  experts_choices().clear();
}

TORCH_LIBRARY_IMPL(inkling, CPU, m) {
  m.impl("sconv_decode", &sconv_decode);
  m.impl("sconv_extend", &sconv_extend);
  m.impl("sconv_verify", &sconv_verify);
  m.impl("commit_conv_windows", &commit_conv_windows);
  m.impl("kv_write", &kv_write);
  m.impl("sconv_checkpoint", &sconv_checkpoint);
  m.impl("ring_checkpoint", &ring_checkpoint);
  m.impl("paged_attention", &paged_attention);
  m.impl("ring_attention", &ring_attention);
  m.impl("extend_attention", &extend_attention);
  m.impl("cached_extend_attention", &cached_extend_attention);
  m.impl("moe_experts", &moe_experts);
  m.impl("moe_experts_int8", &moe_experts_int8);
  m.impl("linear_int8", &linear_int8);
  m.impl("top_k_top_p", &top_k_top_p);
  m.impl("sample_tokens", &sample_tokens);
  m.impl("verify_tokens", &verify_tokens);
  m.impl("linear", &linear);
}
