// Prompt lookup (n-gram drafting) for a batch of rows: services/worker/spec/ngram.py says what
// is found; this is the same search as its NumPy path, one pass per row instead of a few dozen
// array operations per batch (which cost ~0.2 ms a step at batch 16, on the host, between the
// GPU's steps).
//
// For row i (tokens[rows[i]][0, lengths[i])): among the earlier positions e < L - 1 where the
// last token occurs, the one whose preceding tokens match the row's suffix the longest (up to
// max_n tokens), the most recent of those; when that match is at least min_n tokens, the
// drafts are the up to ks[i] tokens after e. Writes starts[i] = e + 1 and counts[i] (0: none).
// The caller checks every index (rows, lengths against the array's shape) before the call.
#include <algorithm>
#include <cstdint>

extern "C" int meshllm_ngram_lookup(const int32_t* tokens, int64_t row_stride,
                                    const int64_t* rows, const int64_t* lengths,
                                    const int64_t* ks, int64_t num_rows, int64_t min_n,
                                    int64_t max_n, int64_t* starts, int64_t* counts) {
  for (int64_t i = 0; i < num_rows; ++i) {
    starts[i] = 0;
    counts[i] = 0;
    const int64_t length = lengths[i];
    const int64_t last = length - 1;
    if (ks[i] <= 0 || last < min_n) continue;
    const int32_t* t = tokens + rows[i] * row_stride;
    int64_t best = 0, best_end = -1;
    for (int64_t e = last - 1; e >= 0 && best < max_n; --e) {
      if (t[e] != t[last]) continue;
      int64_t matched = 1;
      while (matched < max_n && e - matched >= 0 && t[e - matched] == t[last - matched]) {
        ++matched;
      }
      if (matched > best) {  // strictly longer: the most recent of the longest wins
        best = matched;
        best_end = e;
      }
    }
    if (best >= min_n) {
      starts[i] = best_end + 1;
      counts[i] = std::min(ks[i], length - starts[i]);
    }
  }
  return 0;
}
