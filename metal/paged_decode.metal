// Body of the kernel mlxkv_paged_decode. mx.fast.metal_kernel generates
// the signature from the input and output names (see mlxkv/kernels.py).
//
// Decode attention (one query token per sequence) read straight from the
// paged pools through the block table, shaped like MLX's sdpa_vector. One
// threadgroup of NSG simdgroups serves one (partition, kv head, sequence);
// all query heads of the GQA group share every K/V read.
//   1. Lanes split the head dim: each holds its slice of the group's
//      queries (pre-scaled) in registers, and reads its slice of a K or V
//      row as contiguous vectors, so a simdgroup reads whole rows.
//   2. Simdgroups take tokens in turn (a tile is NSG tokens, one each).
//      Per token: Q.K summed over lanes with simd_sum, then each simdgroup
//      updates its own online softmax (fp32) and accumulates p x V.
//   3. At the end the simdgroups' states merge through threadgroup memory.
// One partition (n_parts == 1) writes `out`; several write normalized
// rows plus their maximum and sum to `partials` for mlxkv_paged_reduce.
//
// A sliding-window layer sees only its last tokens: window_starts gives
// each sequence's first visible token (0 for full attention), anywhere in
// a block, and partitions count from it. Attention sinks (gpt-oss) are one
// logit per query head that joins the softmax and adds no value: the first
// simdgroup of the first partition starts its running maximum and sum from
// it, so it is counted once however many partitions there are.
//
// A quantized pool (built with MLXKV_QUANTIZED; see common.metal) holds a
// record per row. The simdgroups then take the tokens of a span of STEP in
// step: the threadgroup copies the span's visible K and V records to
// threadgroup memory (whole segments, common.metal), and each lane
// dequantizes its slice of a row from there, so nothing is dequantized
// twice or stored as float.
//
// Template: T (dtype), D (head dim), G (query heads per kv head, rounded
// up; the real count is params[2]), BS (block size), NSG (simdgroups);
// quantized: BITS, QG (quantization group). params: n_heads, n_kv_heads,
// group, table_width, part_tokens, n_parts, has_sinks.

  constexpr int THREADS = NSG * 32;
  constexpr int E = (D + 31) / 32;  // head-dim elements per lane
  // Elements per vector load: a lane's slice, or 16 bytes of it when it is
  // longer (float, D 256), so that each load of the simdgroup is contiguous.
  // A quantized lane's slice is contiguous (it reads threadgroup memory).
#if defined(MLXKV_QUANTIZED)
  constexpr int W = E;
#else
  constexpr int W = E * int(sizeof(T)) <= 16 ? E : 16 / int(sizeof(T));
#endif
  constexpr bool FULL = E * 32 == D;  // no lane reads past the row

  const int n_heads = params[0];
  const int n_kv_heads = params[1];
  const int group = params[2];
  const int table_width = params[3];
  const int part_tokens = params[4];
  const int n_parts = params[5];
  const bool has_sinks = params[6] != 0;

  const int part = int(threadgroup_position_in_grid.x);
  const int kv_head = int(threadgroup_position_in_grid.y);
  const int seq = int(threadgroup_position_in_grid.z);
  const int tid = int(thread_index_in_threadgroup);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int lane = int(thread_index_in_simdgroup);

  const int ctx = context_lens[seq];
  const int first = window_starts[seq] + part * part_tokens;
  const int last = min(ctx, first + part_tokens);
  const int head0 = kv_head * group;  // the group's first query head
  const int row0 = seq * n_heads + head0;
  const device int32_t* table = block_tables + size_t(seq) * table_width;

  if (first >= last) {  // an empty partition (a shorter row of the batch): its rows are 0, its sums too
    for (int x = tid; x < group * (D + 2); x += THREADS) {
      const int g = x / (D + 2);
      const int d = x % (D + 2);
      if (n_parts == 1 && d < D) {
        out[size_t(row0 + g) * D + d] = T(0.0f);
      } else if (n_parts > 1) {
        partials[(size_t(row0 + g) * n_parts + part) * (D + 2) + d] = d == D ? MLXKV_NO_SCORE : 0.0f;
      }
    }
    return;  // uniform over the threadgroup: no barrier waits for it
  }

  // The head-dim elements of lane `lane`: its e-th is d(e), e < E.
  int dims[E];
  MLXKV_UNROLL
  for (int e = 0; e < E; e++) {
    dims[e] = (e / W) * 32 * W + lane * W + e % W;
  }

  const float scale_log2 = scale * MLXKV_LOG2E;  // scores in log2 units (common.metal)
  float q[G][E];
  float m[G];     // running maximum
  float l[G];     // running sum of exp2(score - m)
  float o[G][E];  // running sum of exp2(score - m) x V
  const bool sink_here = has_sinks && part == 0 && sg == 0;
  MLXKV_UNROLL
  for (int g = 0; g < G; g++) {
    MLXKV_UNROLL
    for (int e = 0; e < E; e++) {
      const bool real = g < group && (FULL || dims[e] < D);
      q[g][e] = real ? float(queries[size_t(row0 + g) * D + dims[e]]) * scale_log2 : 0.0f;
      o[g][e] = 0.0f;
    }
    // exp2(sink - m) == 1 when the running maximum starts at the sink.
    m[g] = sink_here && g < group ? sinks[head0 + g] * MLXKV_LOG2E : MLXKV_NO_SCORE;
    l[g] = sink_here && g < group ? 1.0f : 0.0f;
  }

  // Each simdgroup takes TPI consecutive tokens per iteration, from a multiple of TPI (so
  // that they lie in one block: BS is a multiple of TPI), and rescales its running sums once
  // per group of tokens rather than once per token. Fewer tokens per iteration at head dim
  // 256, where each of them holds 2E values per lane.
  constexpr int TPI = E <= 4 ? 4 : 2;
  constexpr int STEP = NSG * TPI;
#if defined(MLXKV_QUANTIZED)
  // Spans of STEP tokens from a multiple of STEP, all simdgroups in step; SPAN rows of a
  // span lie in one block (STEP is 16 or 32, BS too).
  constexpr int RW = mlxkv_record_words<T, D, BITS, QG>();
  constexpr int SPAN = STEP < BS ? STEP : BS;
  threadgroup uint32_t records[2 * STEP * RW];  // the span's K records, then its V records
  for (int p0 = first - first % STEP; p0 < last; p0 += STEP) {
    MLXKV_UNROLL
    for (int b = 0; b < STEP / SPAN; b++) {
      const int b0 = p0 + b * SPAN;
      const int r0 = max(first, b0) - b0;
      const int r1 = min(last, b0 + SPAN) - b0;
      if (r0 < r1) {  // uniform over the threadgroup
        const size_t at = ((size_t(table[b0 / BS]) * n_kv_heads + kv_head) * BS + b0 % BS) * RW;
        mlxkv_copy_records<RW>(records + (b0 - p0) * RW, records + (STEP + b0 - p0) * RW, k_pool + at,
                               v_pool + at, r0, r1, tid, THREADS);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the span is in
    const int t0 = p0 + sg * TPI;
#else
  // The group's block id is loaded an iteration ahead, so the K/V loads never wait on it.
  int t0 = first - first % TPI + sg * TPI;
  int block = t0 < last ? table[t0 / BS] : 0;
  for (; t0 < last; t0 += STEP) {
    const int next_block = t0 + STEP < last ? table[(t0 + STEP) / BS] : 0;
    // The group's first row of the pools [blocks, kv heads, BS, ...]: 64-bit math once per
    // group, 32-bit offsets from there (a block of a kv head is BS * D elements).
    const size_t row = (size_t(block) * n_kv_heads + kv_head) * BS + t0 % BS;
    block = next_block;
#endif
    bool seen[TPI];  // within [first, last): uniform over the simdgroup
    float k[TPI][E];
    float v[TPI][E];
    MLXKV_UNROLL
    for (int j = 0; j < TPI; j++) {
      seen[j] = t0 + j >= first && t0 + j < last;
#if defined(MLXKV_QUANTIZED)
      if (seen[j]) {
        const threadgroup uint32_t* rec = records + (t0 + j - p0) * RW;
        mlxkv_dequantize<T, D, E, BITS, QG>(k[j], rec, lane * E);
        mlxkv_dequantize<T, D, E, BITS, QG>(v[j], rec + STEP * RW, lane * E);
      } else {  // 0, not garbage: p = 0 times a NaN would still be NaN
        MLXKV_UNROLL
        for (int e = 0; e < E; e++) {
          k[j][e] = 0.0f;
          v[j][e] = 0.0f;
        }
      }
#else
      const device T* k_row = k_pool + row * D;
      const device T* v_row = v_pool + row * D;
      MLXKV_UNROLL
      for (int e = 0; e < E; e++) {
        k[j][e] = seen[j] && (FULL || dims[e] < D) ? float(k_row[j * D + dims[e]]) : 0.0f;
      }
      MLXKV_UNROLL
      for (int e = 0; e < E; e++) {  // in flight while the scores reduce
        v[j][e] = seen[j] && (FULL || dims[e] < D) ? float(v_row[j * D + dims[e]]) : 0.0f;
      }
#endif
    }
    MLXKV_UNROLL
    for (int g = 0; g < G; g++) {
      if (g >= group) {
        continue;  // G rounds the group up: the padded heads do no work (uniform over the threadgroup;
                   // continue, not break: a loop of constant count unrolls in full)
      }
      float s[TPI];
      float m_new = m[g];
      MLXKV_UNROLL
      for (int j = 0; j < TPI; j++) {
        s[j] = 0.0f;
        MLXKV_UNROLL
        for (int e = 0; e < E; e++) {
          s[j] += q[g][e] * k[j][e];
        }
        s[j] = simd_sum(s[j]);
        m_new = seen[j] ? max(m_new, s[j]) : m_new;
      }
      // Rescale only when the maximum grew (uniform over the simdgroup): after a row's first
      // tokens it seldom does, and the exp2 and E multiplies are skipped.
      if (m_new > m[g]) {
        const float correction = fast::exp2(m[g] - m_new);
        l[g] *= correction;
        MLXKV_UNROLL
        for (int e = 0; e < E; e++) {
          o[g][e] *= correction;
        }
        m[g] = m_new;
      }
      float p[TPI];
      MLXKV_UNROLL
      for (int j = 0; j < TPI; j++) {
        p[j] = seen[j] ? fast::exp2(s[j] - m_new) : 0.0f;
        l[g] += p[j];
      }
      MLXKV_UNROLL
      for (int e = 0; e < E; e++) {
        float acc = o[g][e];
        MLXKV_UNROLL
        for (int j = 0; j < TPI; j++) {
          acc += p[j] * v[j][e];
        }
        o[g][e] = acc;
      }
    }
#if defined(MLXKV_QUANTIZED)
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the span is free
#endif
  }

  // Merge the simdgroups: each rescales its own sums to the threadgroup's maximum (one exp2
  // a lane per head), and the rescaled sums add up.
  threadgroup float m_s[NSG * G];
  threadgroup float l_s[NSG * G];  // each simdgroup's sum, rescaled
  threadgroup float o_s[NSG * D];  // one query head at a time
  if (lane == 0) {
    for (int g = 0; g < G; g++) {
      m_s[sg * G + g] = m[g];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // maxima visible
  for (int g = 0; g < G; g++) {
    if (g < group) {  // uniform over the threadgroup
      float m_max = MLXKV_NO_SCORE;
      for (int w = 0; w < NSG; w++) {
        m_max = max(m_max, m_s[w * G + g]);
      }
      const float own = fast::exp2(m[g] - m_max);
      MLXKV_UNROLL
      for (int e = 0; e < E; e++) {
        if (FULL || dims[e] < D) {
          o_s[sg * D + dims[e]] = o[g][e] * own;
        }
      }
      if (lane == 0) {
        l_s[sg * G + g] = l[g] * own;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // this head's rows visible
      float total = 0.0f;
      for (int w = 0; w < NSG; w++) {
        total += l_s[w * G + g];
      }
      // total is 0 only for an empty partition, whose rows are all 0.
      const float inv = total > 0.0f ? 1.0f / total : 0.0f;
      const size_t row = size_t(row0 + g);
      for (int d = tid; d < D; d += THREADS) {
        float sum = 0.0f;
        for (int w = 0; w < NSG; w++) {
          sum += o_s[w * D + d];
        }
        if (n_parts == 1) {
          out[row * D + d] = T(sum * inv);
        } else {
          const size_t base = (row * n_parts + part) * (D + 2);
          partials[base + d] = sum * inv;
          if (d == 0) {
            partials[base + D] = m_max;
            partials[base + D + 1] = total;
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // o_s free for the next head
    }
  }
