// Body of the kernel mlxkv_paged_reduce: the second pass of partitioned
// decode attention. One thread per (head-dim element, query head, sequence)
// merges the partitions' normalized rows, weighting each by its softmax sum
// rescaled to the common maximum. Empty partitions carry sum 0; a row
// whose partitions are all empty (no token visible) is 0, as in one pass.
//
// Template: T (output dtype). partials: [B, n_heads, n_parts, D + 2], each
// row D outputs then the partition's maximum (in log2 units: common.metal) and sum.
// params: n_heads, head_dim, n_parts.

  const int n_heads = params[0];
  const int head_dim = params[1];
  const int n_parts = params[2];

  const int d = int(thread_position_in_grid.x);
  const int head = int(thread_position_in_grid.y);
  const int seq = int(thread_position_in_grid.z);
  if (d >= head_dim) {
    return;
  }
  const size_t row = size_t(seq) * n_heads + head;
  const size_t stride = size_t(head_dim) + 2;
  const device float* rows = partials + row * n_parts * stride;

  float m_max = MLXKV_NO_SCORE;
  for (int p = 0; p < n_parts; p++) {
    m_max = max(m_max, rows[p * stride + head_dim]);
  }
  float total = 0.0f;
  float o = 0.0f;
  for (int p = 0; p < n_parts; p++) {
    const float w = rows[p * stride + head_dim + 1] * fast::exp2(rows[p * stride + head_dim] - m_max);  // log2 units
    total += w;
    o += w * rows[p * stride + d];
  }
  out[row * head_dim + d] = T(total > 0.0f ? o / total : 0.0f);
