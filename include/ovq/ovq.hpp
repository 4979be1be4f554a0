#pragma once
// ovq: sequence-mixing layers for long contexts, header-only.
//
//   #include <ovq/ovq.hpp>
//
//   ovq::OvqOptions opt;                    // capacity N, chunk L, beta, growth, seeding, rate
//   opt.capacity = 512;
//   ovq::OvqAttention<float> mixer(opt);
//   auto state = mixer.make_state(dk, dv);  // what the layer remembers, constant size
//   ovq::RowMatrix<float> O = mixer.forward(state, Q, K, V);   // prefill, T x dv
//   mixer.step(state, q, k, v, o);          // decode one token: same result as forward
//
// The four mixers (SelfAttention, LinearAttention, VqAttention, OvqAttention) share this
// interface; MultiHead<Mixer> runs batch x heads with grouped queries; ovq::io saves and loads
// states and .npy arrays; fit_codebook fits VQ codebooks. ovq::ref holds plain,
// double-precision references of the mathematics (include <ovq/ref/reference.hpp>).
#include "ovq/version.hpp"
#include "ovq/config.hpp"
#include "ovq/core/error.hpp"
#include "ovq/core/types.hpp"
#include "ovq/core/online_softmax.hpp"
#include "ovq/core/merge.hpp"
#include "ovq/state/kv_cache.hpp"
#include "ovq/state/linear_state.hpp"
#include "ovq/state/dictionary.hpp"
#include "ovq/state/vq_state.hpp"
#include "ovq/state/ovq_state.hpp"
#include "ovq/state/policies.hpp"
#include "ovq/mixers/self_attention.hpp"
#include "ovq/mixers/linear_attention.hpp"
#include "ovq/mixers/vq_attention.hpp"
#include "ovq/mixers/ovq_attention.hpp"
#include "ovq/layers/multi_head.hpp"
#include "ovq/fit/kmeans.hpp"
#include "ovq/io/npy.hpp"
#include "ovq/io/state_file.hpp"
