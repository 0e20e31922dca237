// tandem_ggml::decoder_*: a decode step (one token per request) of a Llama-shaped model as one ggml
// graph, computed by ggml's CPU backend: the graph llama.cpp itself builds for a token, over
// Tandem's weights (GGUF blocks, byte for byte) and Tandem's paged KV cache.
//
// Why: called op by op from Python (or from inductor's Python wrapper), a 30-layer step of a
// 135M model pays ~10 us of host overhead per call, ~3 ms a step, as much as a third of the step
// on two cores. Here the step is one call; ggml runs the graph's nodes on its own threads.
//
// The paged cache stays Tandem's: each layer's cache [2, num_blocks, block_size, kv_heads,
// head_dim] (float32) is seen as two row tables (K rows, then V rows), one row per slot. The new
// K/V go in with ggml_set_rows at the requests' slots. Attention is the one node ggml has no op
// for: ggml's flash attention wants each request's K/V contiguous, and gathering them first
// (ggml_get_rows) copied 1.5 KB per position per layer, which grew a step by ~14 us per context
// position (SmolLM2, two cores) where llama.cpp's barely grows. So attention is a custom node
// (`paged_attention`, run by ggml's threads like any other) that reads each request's K/V rows
// where they lie, by slot: scores, softmax and the weighted sum of V, in float32. Its work items
// are (request, K/V head); when they are too few to share evenly among the threads (one request,
// SmolLM2's 3 K/V heads on 2 threads left one thread idle for a third of it), each item's context
// is cut into pieces computed apart and combined by a second node, as flash-decoding does
// (in-process A/B, int4 SmolLM2, 2 threads: -2% a step at 160 positions, -5.6% at 1000).
//
// Building and allocating a graph costs ~0.5 ms, so a graph is reused while it fits: each
// request's context length is rounded up to kPad positions (room in the context-slot input; the
// attention reads only a request's true length, an input too), so a request decodes kPad tokens
// on one graph and only the inputs change: embeddings and positions, and the slots (the new
// tokens', every request's context) that the step derives from the block tables it is given.
// Built with ggml_linear.cpp into one library by engine/model/ggml_kernels.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

namespace {

constexpr int64_t kPad = 64;

struct Linear {
  at::Tensor blocks;  // uint8 [out, row_bytes] in `type`'s blocks
  std::optional<at::Tensor> bias;
  ggml_type type;
  int64_t in, out;
  ggml_tensor* packed = nullptr;  // the weight in a layout of ggml's own (`repack`), if one suits it
};

struct Layer {
  at::Tensor attn_norm, ffn_norm, kv_cache;
  Linear qkv, o, gate_up, down;
};

struct Inputs {
  ggml_tensor *ids, *positions, *slots, *context, *lens;
};

// What the attention nodes need besides their inputs: the shapes, where each request's context
// slots start in the (padded) context-slot input, and how many pieces each (request, K/V head)'s
// context is cut into (`chunks`; 1: one node, no partial results).
struct Attention {
  int64_t heads, kv_heads, head_dim;
  float scale;
  std::vector<int64_t> offsets;
  int64_t chunks = 1;
};

constexpr int64_t kMaxGroup = 16;  // query heads per K/V head
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMinChunk = 32;  // context positions: shorter pieces cost more to combine than they save

// The `group` query heads that share one K/V head, over `len` context slots: scores, softmax
// numerators and the weighted sum of V, left unnormalized: `acc` [group, D] with each head's
// running `max` and `sum` (flash-decoding's partial result, combined over pieces by `combine_attention`).
// Each K and V row is read once for the whole group (reading it once per query head made the step
// ~3x slower per context position: the rows come from L3, not L1). kD is the head size when known
// at compile time (0: `D`), so the inner loops unroll into whole vectors.
template <int64_t kD>
void attend(const float* query, int64_t group, const char* k_base, const char* v_base, size_t k_stride,
            size_t v_stride, const int32_t* slots, int64_t len, int64_t D, float scale, float* scores, float* acc_out,
            float* max_out, float* sum_out) {
  const int64_t dim = kD > 0 ? kD : D;
  // Locals, not the outputs: the compiler keeps them apart from the rows it reads (no aliasing).
  float max[kMaxGroup], sum[kMaxGroup];
  float acc[kMaxGroup][kD > 0 ? kD : kMaxHeadDim] = {};
  for (int64_t g = 0; g < group; ++g) max[g] = -INFINITY, sum[g] = 0.f;
  for (int64_t l = 0; l < len; ++l) {
    const float* key = reinterpret_cast<const float*>(k_base + slots[l] * k_stride);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = query + g * dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += qg[d] * key[d];
      const float s = dot * scale;
      scores[g * len + l] = s;
      max[g] = s > max[g] ? s : max[g];
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * len;
    float total = 0.f;
    for (int64_t l = 0; l < len; ++l) total += (sg[l] = std::exp(sg[l] - max[g]));
    sum[g] = total;
  }
  for (int64_t l = 0; l < len; ++l) {
    const float* value = reinterpret_cast<const float*>(v_base + slots[l] * v_stride);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * len + l];
      float* ag = acc[g];
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) ag[d] += p * value[d];
    }
  }
  for (int64_t g = 0; g < group; ++g) std::memcpy(acc_out + g * dim, acc[g], dim * sizeof(float));
  std::memcpy(max_out, max, group * sizeof(float));
  std::memcpy(sum_out, sum, group * sizeof(float));
}

// One (request, K/V head, piece) of the attention: its slice of the context, unnormalized.
void attend_unit(const Attention& a, const ggml_tensor* dst, int64_t unit, float* acc, float* max, float* sum) {
  const ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2], *context = dst->src[3], *lens = dst->src[4];
  const int64_t D = a.head_dim, group = a.heads / a.kv_heads;
  const int64_t chunk = unit % a.chunks, kv_head = unit / a.chunks % a.kv_heads, b = unit / (a.chunks * a.kv_heads);
  const int64_t len = static_cast<const int32_t*>(lens->data)[b];
  const int64_t begin = len * chunk / a.chunks, end = len * (chunk + 1) / a.chunks;
  const int32_t* slots = static_cast<const int32_t*>(context->data) + a.offsets[b] + begin;
  const float* query =
      reinterpret_cast<const float*>(static_cast<const char*>(q->data) + b * q->nb[2] + kv_head * group * q->nb[1]);
  const char* k_base = static_cast<const char*>(k->data) + kv_head * D * sizeof(float);
  const char* v_base = static_cast<const char*>(v->data) + kv_head * D * sizeof(float);
  thread_local std::vector<float> buffer;
  std::vector<float>& scores = buffer;  // one TLS lookup, not one per access
  if (static_cast<int64_t>(scores.size()) < group * (end - begin)) scores.resize(group * (end - begin));
  const size_t ks = k->nb[1], vs = v->nb[1];
  if (D == 64) {
    attend<64>(query, group, k_base, v_base, ks, vs, slots, end - begin, D, a.scale, scores.data(), acc, max, sum);
  } else if (D == 128) {
    attend<128>(query, group, k_base, v_base, ks, vs, slots, end - begin, D, a.scale, scores.data(), acc, max, sum);
  } else {
    attend<0>(query, group, k_base, v_base, ks, vs, slots, end - begin, D, a.scale, scores.data(), acc, max, sum);
  }
}

// Node `dst` [heads * head_dim, B]: one query (the new token) per request over its context.
// Sources: q [head_dim, heads, B], the K and V row tables (after the step's writes), the context
// slots (int32) and lengths (int32 [B]). Work items are (request, K/V head), spread over ggml's
// threads; each reads its rows straight from the cache.
void paged_attention(ggml_tensor* dst, int ith, int nth, void* userdata) {
  const Attention& a = *static_cast<const Attention*>(userdata);
  const int64_t D = a.head_dim, group = a.heads / a.kv_heads, B = dst->ne[1];
  float acc[kMaxGroup * kMaxHeadDim], max[kMaxGroup], sum[kMaxGroup];
  for (int64_t unit = ith; unit < B * a.kv_heads; unit += nth) {
    attend_unit(a, dst, unit, acc, max, sum);
    const int64_t b = unit / a.kv_heads, kv_head = unit % a.kv_heads;
    float* out = reinterpret_cast<float*>(static_cast<char*>(dst->data) + b * dst->nb[1]) + kv_head * group * D;
    for (int64_t g = 0; g < group; ++g) {
      const float inv = 1.f / sum[g];
      for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv;
    }
  }
}

// With fewer (request, K/V head) items than threads to share them evenly (one request, 2-3 K/V
// heads, 2-16 threads), each item's context is cut into `chunks` pieces, as flash-decoding does:
// `partial_attention` computes every piece's unnormalized result, a row [group * (head_dim + 2)]
// of `dst` per (request, K/V head, piece): acc, then each query head's max, then its sum;
// `combine_attention` rescales the pieces to their common max and normalizes.
void partial_attention(ggml_tensor* dst, int ith, int nth, void* userdata) {
  const Attention& a = *static_cast<const Attention*>(userdata);
  const int64_t D = a.head_dim, group = a.heads / a.kv_heads;
  for (int64_t unit = ith; unit < dst->ne[1]; unit += nth) {
    float* row = reinterpret_cast<float*>(static_cast<char*>(dst->data) + unit * dst->nb[1]);
    attend_unit(a, dst, unit, row, row + group * D, row + group * (D + 1));
  }
}

// Node `dst` [heads * head_dim, B] from `partial_attention`'s rows (its only source).
void combine_attention(ggml_tensor* dst, int ith, int nth, void* userdata) {
  const Attention& a = *static_cast<const Attention*>(userdata);
  const ggml_tensor* parts = dst->src[0];
  const int64_t D = a.head_dim, group = a.heads / a.kv_heads, B = dst->ne[1], C = a.chunks;
  for (int64_t item = ith; item < B * a.heads; item += nth) {  // (request, query head)
    const int64_t b = item / a.heads, head = item % a.heads, kv_head = head / group, g = head % group;
    auto part = [&](int64_t c) {
      return reinterpret_cast<const float*>(static_cast<const char*>(parts->data) +
                                            ((b * a.kv_heads + kv_head) * C + c) * parts->nb[1]);
    };
    float top = -INFINITY;
    for (int64_t c = 0; c < C; ++c) top = std::max(top, part(c)[group * D + g]);
    float* out = reinterpret_cast<float*>(static_cast<char*>(dst->data) + b * dst->nb[1]) + head * D;
    std::fill(out, out + D, 0.f);
    float total = 0.f;
    for (int64_t c = 0; c < C; ++c) {
      const float* row = part(c);
      if (row[group * (D + 1) + g] == 0.f) continue;  // an empty piece
      const float w = std::exp(row[group * D + g] - top);
      total += w * row[group * (D + 1) + g];
      for (int64_t d = 0; d < D; ++d) out[d] += w * row[g * D + d];
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < D; ++d) out[d] *= inv;
  }
}

// How many pieces each (request, K/V head)'s context is cut into: enough items for about two per
// thread, none shorter than kMinChunk positions (at the shortest padded context); `forced` > 0
// overrides (tests).
int64_t attention_chunks(int64_t items, int64_t threads, int64_t shortest, int64_t forced) {
  if (forced > 0) return forced;
  if (items >= 2 * threads || items % threads == 0) return 1;
  const int64_t wanted = (2 * threads + items - 1) / items;
  return std::max<int64_t>(1, std::min(wanted, shortest / kMinChunk));
}

// A built, allocated graph, reused while the batch's padded context lengths are the same.
struct Step {
  std::vector<int64_t> padded;
  int threads = 0;
  Attention attention;
  ggml_context* ctx = nullptr;
  ggml_cgraph* graph = nullptr;
  ggml_tensor* logits = nullptr;
  Inputs in{};
};

struct Decoder {
  int64_t hidden, heads, kv_heads, head_dim, intermediate, vocab, block_size;
  int64_t chunks;  // attention pieces per (request, K/V head); 0: chosen per graph
  int64_t repacked = 0;  // linears read from a layout of ggml's own
  float eps, theta, scale;
  std::vector<Layer> layers;
  at::Tensor final_norm, embedding;  // embedding: float32 [vocab, hidden], read by row
  Linear head;
  ggml_gallocr_t galloc = nullptr;
  std::vector<ggml_context*> packed_ctxs;  // the repacked weights' tensors and buffers
  std::vector<ggml_backend_buffer_t> packed_buffers;
  std::vector<uint8_t> meta, work;  // tensor/graph metadata; the graph's scratch (quantized activations)
  Step step;
  std::mutex mutex;
};

std::mutex registry_mutex;
std::vector<std::unique_ptr<Decoder>> registry;

Decoder& decoder_of(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(registry.size()) && registry[id], "tandem_ggml: no decoder ", id);
  return *registry[id];
}

ggml_tensor* external(ggml_context* ctx, const at::Tensor& t, ggml_type type, int64_t ne0, int64_t ne1 = 1) {
  ggml_tensor* out = ne1 == 1 ? ggml_new_tensor_1d(ctx, type, ne0) : ggml_new_tensor_2d(ctx, type, ne0, ne1);
  out->data = t.data_ptr();
  return out;
}

ggml_tensor* linear(ggml_context* ctx, const Linear& w, ggml_tensor* x) {
  ggml_tensor* weight = w.packed ? w.packed : external(ctx, w.blocks, w.type, w.in, w.out);
  ggml_tensor* out = ggml_mul_mat(ctx, weight, x);
  return w.bias ? ggml_add(ctx, out, external(ctx, *w.bias, GGML_TYPE_F32, w.out)) : out;
}

ggml_tensor* norm(ggml_context* ctx, ggml_tensor* x, const at::Tensor& weight, float eps) {
  return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), external(ctx, weight, GGML_TYPE_F32, weight.numel()));
}

// The step's graph: token ids [B] -> logits [V, B]; `lens` are the requests' padded context
// lengths, which size the context-slot input.
ggml_tensor* build(Decoder& d, ggml_context* ctx, const std::vector<int64_t>& lens, int threads, Inputs& in,
                   Attention& attention) {
  const int64_t B = static_cast<int64_t>(lens.size()), D = d.head_dim, Hq = d.heads, Hkv = d.kv_heads;
  int64_t total = 0;
  attention = Attention{Hq, Hkv, D, d.scale, {}};
  attention.chunks = attention_chunks(B * Hkv, threads, *std::min_element(lens.begin(), lens.end()), d.chunks);
  for (int64_t len : lens) {
    attention.offsets.push_back(total);
    total += len;
  }
  in.ids = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, B);
  in.positions = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, B);
  in.slots = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, B);
  in.context = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, total);
  in.lens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, B);
  for (ggml_tensor* t : {in.ids, in.positions, in.slots, in.context, in.lens}) ggml_set_input(t);

  ggml_tensor* x = ggml_get_rows(ctx, external(ctx, d.embedding, GGML_TYPE_F32, d.hidden, d.embedding.size(0)), in.ids);
  const size_t f = sizeof(float);
  for (const Layer& layer : d.layers) {
    ggml_tensor* qkv = linear(ctx, layer.qkv, norm(ctx, x, layer.attn_norm, d.eps));
    ggml_tensor* q = ggml_view_3d(ctx, qkv, D, Hq, B, D * f, qkv->nb[1], 0);
    ggml_tensor* k = ggml_view_3d(ctx, qkv, D, Hkv, B, D * f, qkv->nb[1], Hq * D * f);
    ggml_tensor* v = ggml_view_2d(ctx, qkv, Hkv * D, B, qkv->nb[1], (Hq + Hkv) * D * f);
    q = ggml_rope_ext(ctx, q, in.positions, nullptr, D, GGML_ROPE_TYPE_NEOX, 0, d.theta, 1.f, 0.f, 1.f, 0.f, 0.f);
    k = ggml_rope_ext(ctx, k, in.positions, nullptr, D, GGML_ROPE_TYPE_NEOX, 0, d.theta, 1.f, 0.f, 1.f, 0.f, 0.f);

    const int64_t slots = layer.kv_cache.numel() / (2 * Hkv * D);
    ggml_tensor* k_rows = external(ctx, layer.kv_cache, GGML_TYPE_F32, Hkv * D, slots);
    ggml_tensor* v_rows = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, Hkv * D, slots);
    v_rows->data = static_cast<float*>(layer.kv_cache.data_ptr()) + slots * Hkv * D;
    k_rows = ggml_set_rows(ctx, k_rows, ggml_reshape_2d(ctx, k, Hkv * D, B), in.slots);
    v_rows = ggml_set_rows(ctx, v_rows, v, in.slots);
    ggml_tensor* sources[] = {q, k_rows, v_rows, in.context, in.lens};
    ggml_tensor* attn;
    if (attention.chunks == 1) {
      attn = ggml_custom_4d(ctx, GGML_TYPE_F32, Hq * D, B, 1, 1, sources, 5, paged_attention, GGML_N_TASKS_MAX,
                            &attention);
    } else {
      ggml_tensor* parts = ggml_custom_4d(ctx, GGML_TYPE_F32, (Hq / Hkv) * (D + 2), B * Hkv * attention.chunks, 1, 1,
                                          sources, 5, partial_attention, GGML_N_TASKS_MAX, &attention);
      attn = ggml_custom_4d(ctx, GGML_TYPE_F32, Hq * D, B, 1, 1, &parts, 1, combine_attention, GGML_N_TASKS_MAX,
                            &attention);
    }
    x = ggml_add(ctx, linear(ctx, layer.o, attn), x);
    ggml_tensor* gate_up = linear(ctx, layer.gate_up, norm(ctx, x, layer.ffn_norm, d.eps));
    const int64_t I = d.intermediate;
    ggml_tensor* gate = ggml_view_2d(ctx, gate_up, I, B, gate_up->nb[1], 0);
    ggml_tensor* up = ggml_view_2d(ctx, gate_up, I, B, gate_up->nb[1], I * f);
    x = ggml_add(ctx, linear(ctx, layer.down, ggml_swiglu_split(ctx, gate, up)), x);
  }
  ggml_tensor* logits = linear(ctx, d.head, norm(ctx, x, d.final_norm, d.eps));
  ggml_set_output(logits);
  return logits;
}

Linear make_linear(const at::Tensor& blocks, const std::optional<at::Tensor>& bias, int64_t type, int64_t in) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "tandem_ggml::decoder_new: weights must be contiguous uint8 blocks");
  TORCH_CHECK(blocks.size(1) == static_cast<int64_t>(ggml_row_size(static_cast<ggml_type>(type), in)),
              "tandem_ggml::decoder_new: weight row bytes do not match in_features ", in);
  std::optional<at::Tensor> b;
  if (bias.has_value()) b = bias->to(at::kFloat).contiguous();
  return Linear{blocks, b, static_cast<ggml_type>(type), in, blocks.size(0)};
}

at::Tensor f32(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

// ggml's CPU backend has faster layouts for some weight types on some CPUs, its "extra buffer
// types" (llama.cpp's `--repack`, on by default there): AMX tiles for Q4_0/Q4_1/Q8_0 on Xeons
// with AMX, rows interleaved 8 at a time for Q4_0 on AVX2, and more on ARM. A weight in such a
// buffer is multiplied by that buffer's kernels. Which one suits a weight is asked the way
// llama.cpp asks: a matmul by the weight placed (as a dummy) in each buffer type in turn, and the
// CPU device says whether it supports it.
ggml_backend_buffer_type_t layout_for(const Linear& w, ggml_backend_dev_t dev,
                                      const std::vector<ggml_backend_buffer_type_t>& extras) {
  ggml_init_params params{4 * ggml_tensor_overhead(), nullptr, /*no_alloc=*/true};
  ggml_context* ctx = ggml_init(params);
  ggml_tensor* weight = ggml_new_tensor_2d(ctx, w.type, w.in, w.out);
  ggml_tensor* op = ggml_mul_mat(ctx, weight, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, w.in, 1));
  ggml_backend_buffer_type_t chosen = nullptr;
  for (ggml_backend_buffer_type_t buft : extras) {
    ggml_backend_buffer_t dummy = ggml_backend_buft_alloc_buffer(buft, 0);
    if (!dummy) continue;
    weight->buffer = dummy;
    const bool supported = ggml_backend_dev_supports_op(dev, op);
    weight->buffer = nullptr;
    ggml_backend_buffer_free(dummy);
    if (supported) {
      chosen = buft;
      break;
    }
  }
  ggml_free(ctx);
  return chosen;
}

// Copy each linear whose type has a faster layout here into a buffer of that layout (ggml converts
// it as it copies); the graph then reads that copy. Returns how many were repacked.
int64_t repack(Decoder& d) {
  ggml_backend_reg_t reg = ggml_backend_cpu_reg();
  ggml_backend_dev_t dev = ggml_backend_reg_dev_get(reg, 0);
  auto get_extras = reinterpret_cast<ggml_backend_dev_get_extra_bufts_t>(
      ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts"));
  std::vector<ggml_backend_buffer_type_t> extras;
  for (ggml_backend_buffer_type_t* b = get_extras ? get_extras(dev) : nullptr; b && *b; ++b) extras.push_back(*b);
  if (extras.empty()) return 0;
  std::vector<Linear*> linears{&d.head};
  for (Layer& layer : d.layers) {
    for (Linear* w : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down}) linears.push_back(w);
  }
  std::vector<std::pair<ggml_backend_buffer_type_t, std::vector<Linear*>>> groups;
  for (Linear* w : linears) {
    if (w->type == GGML_TYPE_F32) continue;  // float rows are read in place
    ggml_backend_buffer_type_t buft = layout_for(*w, dev, extras);
    if (!buft) continue;
    auto group = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == buft; });
    if (group == groups.end()) group = groups.insert(groups.end(), {buft, {}});
    group->second.push_back(w);
  }
  int64_t count = 0;
  for (auto& [buft, members] : groups) {
    ggml_init_params params{members.size() * ggml_tensor_overhead(), nullptr, /*no_alloc=*/true};
    ggml_context* ctx = ggml_init(params);
    for (Linear* w : members) w->packed = ggml_new_tensor_2d(ctx, w->type, w->in, w->out);
    ggml_backend_buffer_t buffer = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    if (!buffer) {  // out of memory for the copy: keep reading the weights in place
      for (Linear* w : members) w->packed = nullptr;
      ggml_free(ctx);
      continue;
    }
    ggml_backend_buffer_set_usage(buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    for (Linear* w : members) ggml_backend_tensor_set(w->packed, w->blocks.data_ptr(), 0, ggml_nbytes(w->packed));
    d.packed_ctxs.push_back(ctx);
    d.packed_buffers.push_back(buffer);
    count += static_cast<int64_t>(members.size());
  }
  return count;
}

// ggml's own messages: warnings and errors to stderr, not its per-tensor debug lines ("repack:
// repack tensor ...").
void log_quietly(ggml_log_level level, const char* text, void*) {
  if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

// tensors: per layer [attn_norm, qkv, o, ffn_norm, gate_up, down], then [final_norm, head, embedding];
// biases and types: per linear (4 a layer, then the head); dims: hidden, heads, kv_heads,
// head_dim, intermediate, vocab, block_size, attention chunks (0: chosen per graph), repack (1:
// weights in ggml's faster layouts where there are any); floats: rms eps, rope theta, attention scale.
int64_t decoder_new(at::TensorList tensors, const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef types,
                    at::TensorList kv_caches, at::IntArrayRef dims, at::ArrayRef<double> floats) {
  ggml_cpu_init();
  ggml_log_set(log_quietly, nullptr);
  TORCH_CHECK(dims.size() == 9 && floats.size() == 3, "tandem_ggml::decoder_new: bad dims");
  auto d = std::make_unique<Decoder>();
  d->hidden = dims[0], d->heads = dims[1], d->kv_heads = dims[2], d->head_dim = dims[3];
  d->intermediate = dims[4], d->vocab = dims[5], d->block_size = dims[6], d->chunks = dims[7];
  d->eps = floats[0], d->theta = floats[1], d->scale = floats[2];
  TORCH_CHECK(d->heads % d->kv_heads == 0 && d->heads / d->kv_heads <= kMaxGroup && d->head_dim <= kMaxHeadDim,
              "tandem_ggml::decoder_new: at most ", kMaxGroup, " query heads per K/V head and a head size of ", kMaxHeadDim);
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(L > 0 && d->block_size > 0, "tandem_ggml::decoder_new: a model with layers and a block size");
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == 6 * L + 3 && static_cast<int64_t>(types.size()) == 4 * L + 1 &&
                  static_cast<int64_t>(biases.size()) == 4 * L + 1,
              "tandem_ggml::decoder_new: expected 6 tensors and 4 linears a layer, plus the final norm, head and embedding");
  const int64_t q_size = d->heads * d->head_dim, kv_size = d->kv_heads * d->head_dim;
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor* t = &tensors[6 * i];
    const at::Tensor& cache = kv_caches[i];
    TORCH_CHECK(cache.scalar_type() == at::kFloat && cache.is_contiguous() && cache.size(0) == 2 &&
                    cache.size(-1) == d->head_dim && cache.size(-2) == d->kv_heads,
                "tandem_ggml::decoder_new: KV caches must be contiguous float32 [2, blocks, block_size, kv_heads, head_dim]");
    auto bias = [&](int64_t j) { return biases.get(4 * i + j); };
    d->layers.push_back(Layer{f32(t[0]), f32(t[3]), cache, make_linear(t[1], bias(0), types[4 * i], d->hidden),
                              make_linear(t[2], bias(1), types[4 * i + 1], q_size),
                              make_linear(t[4], bias(2), types[4 * i + 2], d->hidden),
                              make_linear(t[5], bias(3), types[4 * i + 3], d->intermediate)});
    TORCH_CHECK(d->layers.back().qkv.out == q_size + 2 * kv_size && d->layers.back().gate_up.out == 2 * d->intermediate,
                "tandem_ggml::decoder_new: fused projection sizes do not match the dims");
  }
  d->final_norm = f32(tensors[6 * L]);
  d->head = make_linear(tensors[6 * L + 1], biases.get(4 * L), types[4 * L], d->hidden);
  d->embedding = tensors[6 * L + 2];
  TORCH_CHECK(d->embedding.scalar_type() == at::kFloat && d->embedding.is_contiguous() && d->embedding.dim() == 2 &&
                  d->embedding.size(1) == d->hidden,
              "tandem_ggml::decoder_new: the embedding must be contiguous float32 [vocab, hidden]");
  if (dims[8]) d->repacked = repack(*d);
  d->galloc = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.push_back(std::move(d));
  return static_cast<int64_t>(registry.size()) - 1;
}

int64_t decoder_repacked(int64_t id) { return decoder_of(id).repacked; }

void decoder_free(int64_t id) {
  std::unique_ptr<Decoder> gone;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    if (id >= 0 && id < static_cast<int64_t>(registry.size())) gone = std::move(registry[id]);
  }
  if (gone && gone->step.ctx) ggml_free(gone->step.ctx);
  if (gone && gone->galloc) ggml_gallocr_free(gone->galloc);
  if (gone) {
    for (ggml_backend_buffer_t buffer : gone->packed_buffers) ggml_backend_buffer_free(buffer);
    for (ggml_context* ctx : gone->packed_ctxs) ggml_free(ctx);
  }
}

// Each request's context slots (oldest first, its new token last) from its block table, at its
// offset in the padded context-slot input; its length; the new token's slot.
void fill_slots(const Decoder& d, const Inputs& in, const std::vector<int64_t>& padded, at::IntArrayRef positions,
                at::IntArrayRef tables, int64_t width) {
  const int64_t B = static_cast<int64_t>(positions.size()), bs = d.block_size;
  const int64_t rows = d.layers.front().kv_cache.numel() / (2 * d.kv_heads * d.head_dim);
  int32_t* context = static_cast<int32_t*>(in.context->data);
  int32_t* lengths = static_cast<int32_t*>(in.lens->data);
  int64_t* new_slots = static_cast<int64_t*>(in.slots->data);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* table = tables.data() + b * width;
    const int64_t len = positions[b] + 1, blocks = (len + bs - 1) / bs;
    TORCH_CHECK(positions[b] >= 0 && blocks <= width, "tandem_ggml::decoder_step: position ", positions[b],
                " is past its block table's ", width, " blocks");
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t first = table[i] * bs, n = std::min(bs, len - i * bs);
      TORCH_CHECK(first >= 0 && first + bs <= rows, "tandem_ggml::decoder_step: block ", table[i], " is not in the cache");
      for (int64_t j = 0; j < n; ++j) context[i * bs + j] = static_cast<int32_t>(first + j);
    }
    new_slots[b] = context[len - 1];
    lengths[b] = static_cast<int32_t>(len);
    context += padded[b];
  }
}

// ids [B] (the new tokens), positions [B], block tables [B * width] (each request's blocks,
// padded on the right to `width`) -> logits [B, vocab] float32; writes the tokens' K/V at their
// positions' slots. Positions and tables come as plain lists: no tensors to build per step.
at::Tensor decoder_step(int64_t id, const at::Tensor& ids, at::IntArrayRef positions, at::IntArrayRef block_tables,
                        int64_t width) {
  Decoder& d = decoder_of(id);
  std::lock_guard<std::mutex> lock(d.mutex);
  const int64_t B = ids.numel();
  TORCH_CHECK(B > 0 && B == static_cast<int64_t>(positions.size()) && width > 0 &&
                  static_cast<int64_t>(block_tables.size()) == B * width,
              "tandem_ggml::decoder_step: one position and one block table (of `width` blocks) per token");
  const at::Tensor tokens = ids.to(at::kInt).contiguous();
  const int32_t* t = tokens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(t[b] >= 0 && t[b] < d.embedding.size(0), "tandem_ggml::decoder_step: token id ", t[b], " out of range");
  }
  std::vector<int64_t> padded(B);
  for (int64_t b = 0; b < B; ++b) padded[b] = (positions[b] + 1 + kPad - 1) / kPad * kPad;
  Step& step = d.step;
  const int threads = at::get_num_threads();
  if (padded != step.padded || threads != step.threads) {
    if (step.ctx) ggml_free(step.ctx);
    const size_t graph_size = 64 * d.layers.size() + 64;  // a layer makes ~32 tensors, whatever B is
    const size_t meta_size = ggml_tensor_overhead() * graph_size + ggml_graph_overhead_custom(graph_size, false);
    if (d.meta.size() < meta_size) d.meta.resize(meta_size);
    ggml_init_params params{meta_size, d.meta.data(), /*no_alloc=*/true};
    step.ctx = ggml_init(params);
    step.logits = build(d, step.ctx, padded, threads, step.in, step.attention);
    step.graph = ggml_new_graph_custom(step.ctx, graph_size, false);
    ggml_build_forward_expand(step.graph, step.logits);
    step.padded = padded, step.threads = threads;
    if (!ggml_gallocr_alloc_graph(d.galloc, step.graph)) {
      step.padded.clear();
      TORCH_CHECK(false, "tandem_ggml::decoder_step: could not allocate the graph");
    }
  }
  const Inputs& in = step.in;
  std::memcpy(in.ids->data, t, ggml_nbytes(in.ids));
  int32_t* pos = static_cast<int32_t*>(in.positions->data);
  for (int64_t b = 0; b < B; ++b) pos[b] = static_cast<int32_t>(positions[b]);
  fill_slots(d, in, padded, positions, block_tables, width);

  ggml_cplan plan = ggml_graph_plan(step.graph, threads, nullptr);
  if (d.work.size() < plan.work_size) d.work.resize(plan.work_size);
  plan.work_data = d.work.data();
  const ggml_status status = ggml_graph_compute(step.graph, &plan);
  at::Tensor out = at::empty({B, d.vocab}, ids.options().dtype(at::kFloat));
  if (status == GGML_STATUS_SUCCESS) std::memcpy(out.data_ptr(), step.logits->data, ggml_nbytes(step.logits));
  TORCH_CHECK(status == GGML_STATUS_SUCCESS, "tandem_ggml::decoder_step: ggml_graph_compute failed (", status, ")");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_ggml, m) {
  m.def("decoder_new(Tensor[] tensors, Tensor?[] biases, int[] types, Tensor[] kv_caches, int[] dims, "
        "float[] floats) -> int");
  m.def("decoder_free(int id) -> ()");
  m.def("decoder_repacked(int id) -> int");
  m.def("decoder_step(int id, Tensor ids, int[] positions, int[] block_tables, int width) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_ggml, CPU, m) {
  m.impl("decoder_step", &decoder_step);
}

TORCH_LIBRARY_IMPL(tandem_ggml, CompositeExplicitAutograd, m) {
  m.impl("decoder_new", &decoder_new);
  m.impl("decoder_free", &decoder_free);
  m.impl("decoder_repacked", &decoder_repacked);
}
