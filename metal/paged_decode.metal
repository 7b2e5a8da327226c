// Body of the kernel mlxkv_paged_decode. mx.fast.metal_kernel generates
// the signature from the input and output names (see mlxkv/kernels.py).
//
// Decode attention (one query token per sequence) read straight from the
// paged pools through the block table. One threadgroup of NSG simdgroups
// serves one (partition, kv head, sequence): all query heads of the GQA
// group share every K/V read. Tokens go in tiles of TILE:
//   1. each thread scores whole tokens for all G query heads (q sits in
//      threadgroup memory, pre-scaled);
//   2. tile maxima over the threadgroup update the running maxima;
//   3. probabilities go to threadgroup memory, with the tile sums;
//   4. the running sums and accumulators are rescaled (online softmax, fp32);
//   5. simdgroups take tokens in turn, lanes split the head dim, and
//      accumulate probability x V.
// The simdgroups' accumulators are summed at the end. One partition
// (n_parts == 1) writes `out`; several write normalized rows plus their
// maximum and sum to `partials` for mlxkv_paged_reduce.
//
// A sliding-window layer sees only its last tokens: window_starts gives
// each sequence's first visible token (0 for full attention), anywhere in
// a block, and partitions count from it. Attention sinks (gpt-oss) are one
// logit per query head that joins the softmax and adds no value: the first
// partition starts its running maximum and sum from it, so it is counted
// once however many partitions there are.
//
// Template: T (dtype), D (head dim), G (query heads per kv head, rounded
// up; the real count is params[2]), NSG (simdgroups), TILE (tokens).
// params: n_heads, n_kv_heads, group, block_size, table_width,
//         part_tokens, n_parts, has_sinks.

  constexpr int THREADS = NSG * 32;
  constexpr int PER_THREAD = TILE / THREADS;  // tokens a thread scores per tile
  constexpr int PER_LANE = (D + 31) / 32;     // head-dim elements a lane accumulates

  const int n_heads = params[0];
  const int n_kv_heads = params[1];
  const int group = params[2];
  const int block_size = params[3];
  const int table_width = params[4];
  const int part_tokens = params[5];
  const int n_parts = params[6];
  const bool has_sinks = params[7] != 0;

  const int part = int(threadgroup_position_in_grid.x);
  const int kv_head = int(threadgroup_position_in_grid.y);
  const int seq = int(threadgroup_position_in_grid.z);
  const int tid = int(thread_index_in_threadgroup);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int lane = int(thread_index_in_simdgroup);

  threadgroup float q_s[G * D];      // the group's queries, times scale
  threadgroup float p_s[G * TILE];   // one tile's probabilities
  threadgroup float max_s[NSG * G];  // per-simdgroup tile maxima
  threadgroup float sum_s[NSG * G];  // per-simdgroup tile sums
  threadgroup float acc_s[NSG * D];  // the final sum, one query head at a time

  const int ctx = context_lens[seq];
  const int first = window_starts[seq] + part * part_tokens;
  const int last = min(ctx, first + part_tokens);
  const int head0 = kv_head * group;  // the group's first query head
  const int row0 = seq * n_heads + head0;
  const int table = seq * table_width;
  const size_t head_stride = size_t(block_size) * D;
  const size_t block_stride = size_t(n_kv_heads) * head_stride;
  const size_t kv_offset = size_t(kv_head) * head_stride;

  for (int i = tid; i < G * D; i += THREADS) {
    const int g = i / D;
    q_s[i] = g < group ? float(queries[size_t(row0 + g) * D + i % D]) * scale : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  float m[G];
  float l[G];
  float acc[G][PER_LANE];
  const bool sink_here = has_sinks && part == 0;
  for (int g = 0; g < G; g++) {
    // exp(sink - m) == 1 when the running maximum starts at the sink.
    m[g] = sink_here && g < group ? sinks[head0 + g] : MLXKV_NO_SCORE;
    l[g] = sink_here && g < group ? 1.0f : 0.0f;
    for (int e = 0; e < PER_LANE; e++) {
      acc[g][e] = 0.0f;
    }
  }

  for (int t0 = first; t0 < last; t0 += TILE) {
    const int n = min(TILE, last - t0);

    // 1. Scores of this thread's tokens.
    float s[PER_THREAD][G];
    float tile_max[G];
    for (int g = 0; g < G; g++) {
      tile_max[g] = MLXKV_NO_SCORE;
    }
    for (int i = 0; i < PER_THREAD; i++) {
      const int j = tid + i * THREADS;
      float dot[G];
      for (int g = 0; g < G; g++) {
        dot[g] = 0.0f;
      }
      if (j < n) {
        const int t = t0 + j;
        const int block = block_tables[table + t / block_size];
        const device T* k = k_pool + size_t(block) * block_stride + kv_offset
            + size_t(t % block_size) * D;
        for (int d = 0; d < D; d++) {
          const float kd = float(k[d]);
          for (int g = 0; g < G; g++) {
            dot[g] += q_s[g * D + d] * kd;
          }
        }
      }
      for (int g = 0; g < G; g++) {
        s[i][g] = j < n ? dot[g] : MLXKV_NO_SCORE;
        tile_max[g] = max(tile_max[g], s[i][g]);
      }
    }

    // 2. The tile maximum over the threadgroup; every thread derives the
    //    same new running maximum.
    for (int g = 0; g < G; g++) {
      tile_max[g] = simd_max(tile_max[g]);
    }
    if (lane == 0) {
      for (int g = 0; g < G; g++) {
        max_s[sg * G + g] = tile_max[g];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float m_new[G];
    for (int g = 0; g < G; g++) {
      m_new[g] = m[g];
      for (int w = 0; w < NSG; w++) {
        m_new[g] = max(m_new[g], max_s[w * G + g]);
      }
    }

    // 3. Probabilities for the value pass, and the tile sums.
    float tile_sum[G];
    for (int g = 0; g < G; g++) {
      tile_sum[g] = 0.0f;
    }
    for (int i = 0; i < PER_THREAD; i++) {
      const int j = tid + i * THREADS;
      if (j < n) {
        for (int g = 0; g < G; g++) {
          const float p = exp(s[i][g] - m_new[g]);
          p_s[g * TILE + j] = p;
          tile_sum[g] += p;
        }
      }
    }
    for (int g = 0; g < G; g++) {
      tile_sum[g] = simd_sum(tile_sum[g]);
    }
    if (lane == 0) {
      for (int g = 0; g < G; g++) {
        sum_s[sg * G + g] = tile_sum[g];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // probabilities and sums visible

    // 4. Rescale the running state to the new maximum.
    for (int g = 0; g < G; g++) {
      const float correction = exp(m[g] - m_new[g]);
      float total = 0.0f;
      for (int w = 0; w < NSG; w++) {
        total += sum_s[w * G + g];
      }
      l[g] = l[g] * correction + total;
      m[g] = m_new[g];
      for (int e = 0; e < PER_LANE; e++) {
        acc[g][e] *= correction;
      }
    }

    // 5. Probability x V: simdgroups take tokens in turn, lanes split D.
    for (int j = sg; j < n; j += NSG) {
      const int t = t0 + j;
      const int block = block_tables[table + t / block_size];
      const device T* v = v_pool + size_t(block) * block_stride + kv_offset
          + size_t(t % block_size) * D;
      float vv[PER_LANE];
      for (int e = 0; e < PER_LANE; e++) {
        const int d = lane + e * 32;
        vv[e] = d < D ? float(v[d]) : 0.0f;
      }
      for (int g = 0; g < G; g++) {
        const float p = p_s[g * TILE + j];
        for (int e = 0; e < PER_LANE; e++) {
          acc[g][e] += p * vv[e];
        }
      }
    }
    // No barrier here: the next tile writes max_s, p_s and sum_s only after
    // its first barrier, which every thread reaches after this loop.
  }

  // Sum the simdgroups' accumulators, one query head at a time, and write.
  for (int g = 0; g < G; g++) {
    if (g < group) {  // uniform over the threadgroup
      for (int e = 0; e < PER_LANE; e++) {
        const int d = lane + e * 32;
        if (d < D) {
          acc_s[sg * D + d] = acc[g][e];
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
      const size_t row = size_t(row0 + g);
      for (int d = tid; d < D; d += THREADS) {
        float o = 0.0f;
        for (int w = 0; w < NSG; w++) {
          o += acc_s[w * D + d];
        }
        if (n_parts == 1) {
          out[row * D + d] = T(o * inv);
        } else {
          const size_t base = (row * n_parts + part) * (D + 2);
          partials[base + d] = o * inv;
          if (d == 0) {
            partials[base + D] = m[g];
            partials[base + D + 1] = l[g];
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
