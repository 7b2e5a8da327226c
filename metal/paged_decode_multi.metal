// Body of the kernel mlxkv_paged_decode_multi: attention of a few query
// tokens per sequence (L of 2 to 8: a speculative verify step's last token
// and its proposals) read straight from the paged pools. A step's rows are
// padded to one L. Query j of a row sits at position ctx - L + j and sees
// the row's keys up to its own position (the causal rule among the
// proposals); with a sliding window only its last `window` of them.
// Attention sinks count once per query row, as in paged_decode.metal.
//
// One threadgroup serves one (partition, kv head, sequence) and all
// group x L query rows of it, so each K/V row is read from the pool once:
//   1. Tiles of TILE positions, aligned to TILE so that a tile lies in one
//      block: the threadgroup copies the tile's visible K and V rows into
//      threadgroup memory as float, 16 contiguous bytes a thread (a
//      quantized pool's records as they are, in tiles of 16: common.metal;
//      each lane dequantizes its slice as it reads it).
//   2. The simdgroups compute from there. They form row sets of RS query
//      rows each, held in registers with lanes splitting the head dim as in
//      paged_decode.metal, and streams that take the tile's positions in
//      turn; a simdgroup past the last stream only copies.
//   3. At the end each row set's streams merge through threadgroup memory
//      (the tiles' storage, no longer read), one row of the set at a time.
// Partitions start at the first query's first visible position rounded
// down to TILE and span part_tokens (a multiple of TILE): no tile is copied
// by two partitions.
//
// Template: T (dtype), D (head dim), RS (query rows per simdgroup: the
// smallest of 1, 2, 4, 8 covering group x L rows over NSG simdgroups),
// BS (block size), NSG (simdgroups); quantized: BITS, QG (quantization group).
// params: n_heads, n_kv_heads, group, table_width, part_tokens, n_parts,
//         has_sinks, q_len, window (0: none), chunk (0: none).
// Chunked attention (Llama 4): a query sees only its own chunk of `chunk`
// positions. window_starts is then the first query's chunk start, and a
// step may cross into the next chunk: each query's bound counts from there.
// A group's rows are (head, query) pairs in the order of out [B, Hq, L, D].

  constexpr int THREADS = NSG * 32;
  constexpr int E = (D + 31) / 32;  // head-dim elements per lane
#if defined(MLXKV_QUANTIZED)
  constexpr int TILE = 16;  // kernels.QUANT_TILE: a tile's records start a segment
  constexpr int W = E;
  constexpr int RW = mlxkv_record_words<T, D, BITS, QG>();
#else
  constexpr int TILE = 8;  // kernels.TILE
  constexpr int W = E * int(sizeof(T)) <= 16 ? E : 16 / int(sizeof(T));
  constexpr int CHUNK = 16 / int(sizeof(T));
#endif
  constexpr bool FULL = E * 32 == D;  // no lane reads past the row
  // Positions a stream takes per iteration (fewer at head dim 256: registers).
  constexpr int TPI = E <= 4 ? 4 : 2;

  const int n_heads = params[0];
  const int n_kv_heads = params[1];
  const int group = params[2];
  const int table_width = params[3];
  const int part_tokens = params[4];
  const int n_parts = params[5];
  const bool has_sinks = params[6] != 0;
  const int q_len = params[7];
  const int window = params[8];
  const int chunk = params[9];

  const int part = int(threadgroup_position_in_grid.x);
  const int kv_head = int(threadgroup_position_in_grid.y);
  const int seq = int(threadgroup_position_in_grid.z);
  const int tid = int(thread_index_in_threadgroup);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int lane = int(thread_index_in_simdgroup);

  const int rows = group * q_len;
  const int n_sets = (rows + RS - 1) / RS;
  const int streams = NSG / n_sets;
  const int set = sg % n_sets;
  const int stream = sg / n_sets;  // streams or more: this simdgroup only copies

  const int ctx = context_lens[seq];
  const int start = window_starts[seq];  // the first query's first visible position
  const int base = start - start % TILE + part * part_tokens;
  const int first = max(start, base);
  const int last = min(ctx, base + part_tokens);
  const int head0 = kv_head * group;
  const size_t row0 = size_t(seq * n_heads + head0) * q_len;  // the group's first output row
  const device int32_t* table = block_tables + size_t(seq) * table_width;

  // The head-dim elements of lane `lane`: its e-th is d(e), e < E.
  int dims[E];
  for (int e = 0; e < E; e++) {
    dims[e] = (e / W) * 32 * W + lane * W + e % W;
  }

  const float scale_log2 = scale * MLXKV_LOG2E;  // scores in log2 units (common.metal)
  float q[RS][E];
  float m[RS];     // running maximum
  float l[RS];     // running sum of exp2(score - m)
  float o[RS][E];  // running sum of exp2(score - m) x V
  int lo[RS];      // the row's visible positions: lo .. hi - 1
  int hi[RS];
  for (int i = 0; i < RS; i++) {
    const int r = set * RS + i;
    const int j = r % q_len;  // the row's query
    hi[i] = r < rows ? ctx - q_len + j + 1 : 0;
    lo[i] = window > 0 ? max(0, hi[i] - window) : 0;
    if (chunk > 0 && r < rows) {  // its own chunk's start (start is the first query's)
      lo[i] = start + (hi[i] - 1 - start) / chunk * chunk;
    }
    for (int e = 0; e < E; e++) {
      const bool real = r < rows && (FULL || dims[e] < D);
      q[i][e] = real ? float(queries[(row0 + r) * D + dims[e]]) * scale_log2 : 0.0f;
      o[i][e] = 0.0f;
    }
    // exp2(sink - m) == 1 when the running maximum starts at the sink.
    const bool sink_here = has_sinks && part == 0 && stream == 0 && r < rows;
    m[i] = sink_here ? sinks[head0 + r / q_len] * MLXKV_LOG2E : MLXKV_NO_SCORE;
    l[i] = sink_here ? 1.0f : 0.0f;
  }

#if defined(MLXKV_QUANTIZED)
  threadgroup uint32_t records[2 * TILE * RW];  // a tile's K records, then its V records
  threadgroup float stage[NSG * D];  // the merge's
#else
  threadgroup float stage[2 * TILE * D];  // a tile's K rows, then its V rows
  threadgroup float* k_tile = stage;
  threadgroup float* v_tile = stage + TILE * D;
#endif
  for (int p0 = base; p0 < last; p0 += TILE) {
    const int t0 = max(p0, first);
    const int n_rows = min(p0 + TILE, last) - t0;  // visible rows, from slot t0 - p0
#if defined(MLXKV_QUANTIZED)
    const size_t at = ((size_t(table[p0 / BS]) * n_kv_heads + kv_head) * BS + p0 % BS) * RW;
    mlxkv_copy_records<RW>(records, records + TILE * RW, k_pool + at, v_pool + at, t0 - p0, t0 - p0 + n_rows, tid,
                           THREADS);
#else
    const size_t prow = (size_t(table[t0 / BS]) * n_kv_heads + kv_head) * BS + t0 % BS;
    const int chunks = n_rows * (D / CHUNK);
    for (int c = tid; c < 2 * chunks; c += THREADS) {
      const bool is_v = c >= chunks;
      const int x = (is_v ? c - chunks : c) * CHUNK;  // element x of the rows from t0
      threadgroup float* dst = (is_v ? v_tile : k_tile) + (t0 - p0) * D + x;
      const device T* src = (is_v ? v_pool : k_pool) + prow * D + x;
      for (int w = 0; w < CHUNK; w++) {
        dst[w] = float(src[w]);
      }
    }
#endif
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the tile is in
    if (stream < streams) {
      // TPI of the stream's positions at a time (t, t + streams, ...), one rescale each.
      for (int t = t0 + stream; t < t0 + n_rows; t += TPI * streams) {
        int pos[TPI];
        float k[TPI][E];
        float v[TPI][E];
        MLXKV_UNROLL
        for (int j = 0; j < TPI; j++) {
          pos[j] = t + j * streams;
          const bool in_tile = pos[j] < t0 + n_rows;
#if defined(MLXKV_QUANTIZED)
          if (in_tile) {  // uniform over the simdgroup
            const threadgroup uint32_t* rec = records + (pos[j] - p0) * RW;
            mlxkv_dequantize<T, D, E, BITS, QG>(k[j], rec, lane * E);
            mlxkv_dequantize<T, D, E, BITS, QG>(v[j], rec + TILE * RW, lane * E);
          } else {
            MLXKV_UNROLL
            for (int e = 0; e < E; e++) {
              k[j][e] = 0.0f;
              v[j][e] = 0.0f;
            }
          }
#else
          const int slot = (pos[j] - p0) * D;
          MLXKV_UNROLL
          for (int e = 0; e < E; e++) {
            k[j][e] = in_tile && (FULL || dims[e] < D) ? k_tile[slot + dims[e]] : 0.0f;
            v[j][e] = in_tile && (FULL || dims[e] < D) ? v_tile[slot + dims[e]] : 0.0f;
          }
#endif
        }
        MLXKV_UNROLL
        for (int i = 0; i < RS; i++) {
          bool seen[TPI];  // uniform over the simdgroup
          float s[TPI];
          float m_new = m[i];
          MLXKV_UNROLL
          for (int j = 0; j < TPI; j++) {
            seen[j] = pos[j] < t0 + n_rows && pos[j] >= lo[i] && pos[j] < hi[i];
            s[j] = 0.0f;
            if (seen[j]) {
              MLXKV_UNROLL
              for (int e = 0; e < E; e++) {
                s[j] += q[i][e] * k[j][e];
              }
              s[j] = simd_sum(s[j]);
              m_new = max(m_new, s[j]);
            }
          }
          if (m_new > m[i]) {  // rescale only when the maximum grew (uniform over the simdgroup)
            const float correction = fast::exp2(m[i] - m_new);
            l[i] *= correction;
            MLXKV_UNROLL
            for (int e = 0; e < E; e++) {
              o[i][e] *= correction;
            }
            m[i] = m_new;
          }
          MLXKV_UNROLL
          for (int j = 0; j < TPI; j++) {
            s[j] = seen[j] ? fast::exp2(s[j] - m_new) : 0.0f;  // now the token's weight
            l[i] += s[j];
          }
          MLXKV_UNROLL
          for (int e = 0; e < E; e++) {
            float acc = o[i][e];
            MLXKV_UNROLL
            for (int j = 0; j < TPI; j++) {
              acc += s[j] * v[j][e];
            }
            o[i][e] = acc;
          }
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the tile is free
  }

  // Merge each row set's streams: rescale each to the set's maximum, sum.
  threadgroup float m_s[NSG * RS];
  threadgroup float l_s[NSG * RS];  // each stream's sum, rescaled to its set's maximum
  threadgroup float* o_s = stage;  // [NSG][D], one row of each set at a time
  if (lane == 0) {
    for (int i = 0; i < RS; i++) {
      m_s[sg * RS + i] = m[i];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // maxima visible
  for (int i = 0; i < RS; i++) {
    if (stream < streams) {
      float m_max = MLXKV_NO_SCORE;
      for (int w = 0; w < streams; w++) {
        m_max = max(m_max, m_s[(w * n_sets + set) * RS + i]);
      }
      const float own = fast::exp2(m[i] - m_max);
      for (int e = 0; e < E; e++) {
        if (FULL || dims[e] < D) {
          o_s[sg * D + dims[e]] = o[i][e] * own;
        }
      }
      if (lane == 0) {
        l_s[sg * RS + i] = l[i] * own;  // rescaled here: the sum below takes no exp2
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // row i of every set visible
    for (int x = tid; x < n_sets * D; x += THREADS) {
      const int s = x / D;
      const int d = x % D;
      const int r = s * RS + i;
      if (r < rows) {
        float m_max = MLXKV_NO_SCORE;
        for (int w = 0; w < streams; w++) {
          m_max = max(m_max, m_s[(w * n_sets + s) * RS + i]);
        }
        float total = 0.0f;
        float sum = 0.0f;
        for (int w = 0; w < streams; w++) {
          total += l_s[(w * n_sets + s) * RS + i];
          sum += o_s[(w * n_sets + s) * D + d];
        }
        // total is 0 only for a row that sees nothing in this partition.
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        const size_t row = row0 + r;
        if (n_parts == 1) {
          out[row * D + d] = T(sum * inv);
        } else {
          const size_t at = (row * n_parts + part) * (D + 2);
          partials[at + d] = sum * inv;
          if (d == 0) {
            partials[at + D] = m_max;
            partials[at + D + 1] = total;
          }
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // o_s free for the next row
  }
