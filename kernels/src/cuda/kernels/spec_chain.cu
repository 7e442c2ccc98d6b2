// A speculative decode chain on the device: after each verify step (and its spec_accept), chain_advance moves every
// sequence's counters and builds the next step's metadata, and chain_draft proposes the next step's drafts, so
// several verify steps run back to back with no host round trip. CPU twins: kernels/src/cpu/chain.rs (`advance_in`,
// `propose`), which documents the rules; the words below follow it line for line.
//
// Chain state per sequence, i32 × 8: [slot, position, ring_start, ring_len, ring_cap, conv_head, form, hist_len].

#define CHAIN_WORDS 8
#define FAULT_VERDICT 1
#define FAULT_RING 2
#define FAULT_HISTORY 4
#define FAULT_FOLD 8
#define FAULT_SLOT 16
#define FORM_RECURRENT 0
#define FORM_REPLAY 1
#define FORM_KV_ONLY 2

struct ChainParams {
    long long t, ring_capacity, window, threshold, conv_cap, hist_cap;
    // SlotCounters::decide(Verify): a replay step flushes unless the ring keeps room for the next window after it.
    __device__ bool flushes(int form, long long h) const {
        return form == FORM_REPLAY && h + t + (window > t ? window : t) > ring_capacity;
    }
};

// One sequence (the twin's `advance_in`): the fault bit to set, 0 when it advanced and wrote its outputs.
__device__ int chain_advance_one(int q, const int* __restrict__ verdict, const int* __restrict__ drafts,
                                 int* __restrict__ state, int* __restrict__ hist, int* __restrict__ meta,
                                 int* __restrict__ tokens, int* __restrict__ row_pos, int* __restrict__ lens,
                                 int max_seqs, const ChainParams& p) {
    int* st = state + (u64)q * CHAIN_WORDS;
    const int slot = st[0];
    const int form = st[6];
    if (slot < 0 || slot >= max_seqs) return FAULT_SLOT;
    const int a = verdict[2 * (u64)q];
    const int y = verdict[2 * (u64)q + 1];
    if (y < 0 || a < 0 || (long long)a > p.t - 1) return FAULT_VERDICT;
    long long ring_start = st[2], ring_len = st[3];
    const long long ring_cap = st[4];
    // The step's own flush folded the committed entries.
    if (p.flushes(form, ring_len)) {
        if (ring_cap <= 0) return FAULT_RING;
        ring_start = (ring_start + ring_len) % ring_cap;
        ring_len = 0;
    }
    // Commit the input token and the accepted drafts.
    const long long n = (long long)a + 1;
    if (form != FORM_RECURRENT) {
        if (ring_len + n > ring_cap) return FAULT_RING;
        ring_len += n;
    }
    const long long conv_head = p.conv_cap > 0 ? ((long long)st[5] + n) % p.conv_cap : (long long)st[5];
    const long long hist_len = st[7];
    if (hist_len < 0 || hist_len + n > p.hist_cap) return FAULT_HISTORY;
    // The next step would compress a kv-only ring: the host's to plan.
    if (form == FORM_KV_ONLY && ring_len >= p.threshold) return FAULT_FOLD;

    // Every check passed: write.
    int* h = hist + (u64)q * (u64)p.hist_cap + (u64)hist_len;
    const int* d = drafts + (u64)q * (u64)(p.t - 1);
    for (int i = 0; i < a; ++i) h[i] = d[i];
    h[a] = y;
    const int position = (int)((unsigned)st[1] + (unsigned)n);
    st[1] = position;
    st[2] = (int)ring_start;
    st[3] = (int)ring_len;
    st[5] = (int)conv_head;
    st[7] = (int)(hist_len + n);
    int* m = meta + (u64)q * 8;
    m[0] = slot;
    m[1] = (int)ring_start;
    m[2] = (int)ring_len;
    m[3] = (int)ring_cap;
    m[4] = p.flushes(form, ring_len) ? (int)ring_len : 0;
    m[5] = form != FORM_KV_ONLY;
    m[6] = (int)conv_head;
    m[7] = 0;
    const u64 row0 = (u64)q * (u64)p.t;
    tokens[row0] = y;
    for (long long i = 0; i < p.t; ++i) row_pos[row0 + i] = (int)((unsigned)position + (unsigned)i);
    lens[slot] = (int)((unsigned)position + (unsigned)p.t);
    return 0;
}

// One thread per sequence (grid-stride). verdict [seqs, 2], drafts [seqs, t − 1], state [seqs, 8] (read-write),
// hist [seqs, hist_cap] (read-write), fault [seqs] (read-write, sticky bits); outputs meta [seqs, 8] (the next
// step's replay rows), tokens [seqs · t] (row 0 of each sequence), row_pos [seqs · t], lens [max_seqs] (by slot).
// A sequence whose fault is set, or gets set, writes nothing else.
extern "C" __global__ void chain_advance(const int* __restrict__ verdict, const int* __restrict__ drafts,
                                         int* __restrict__ state, int* __restrict__ hist, int* __restrict__ fault,
                                         int* __restrict__ meta, int* __restrict__ tokens, int* __restrict__ row_pos,
                                         int* __restrict__ lens, int seqs, int max_seqs, int t, int ring_capacity,
                                         int window, int threshold, int conv_cap, int hist_cap) {
    const ChainParams p = {t, ring_capacity, window, threshold, conv_cap, hist_cap};
    for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < seqs; q += gridDim.x * blockDim.x) {
        if (fault[q] != 0) continue;
        const int bit = chain_advance_one(q, verdict, drafts, state, hist, meta, tokens, row_pos, lens, max_seqs, p);
        if (bit) fault[q] |= bit;
    }
}

// One block per sequence (the twin's `propose`): the next step's t − 1 drafts into drafts [seqs, t − 1] and into
// rows 1 .. t of the sequence in tokens [seqs · t]. mode 0: prompt lookup over the history's first hist_len tokens
// (n from min(max_n, len − 1) down to min_n; per n the block scans candidate starts from the latest down, a tile of
// blockDim starts at a time, and the first tile holding a match gives the latest one); mode 1: the table row's
// entries from position hist_len, up to the row's end or the first negative entry. Padded with the last token of
// the stream and the proposal (0 when both are empty). A sequence whose fault is set is skipped.
extern "C" __global__ void chain_draft(const int* __restrict__ hist, int hist_cap, const int* __restrict__ state,
                                       const int* __restrict__ fault, int mode, int min_n, int max_n,
                                       const int* __restrict__ table, int table_cap, int t, int* __restrict__ drafts,
                                       int* __restrict__ tokens) {
    const int q = blockIdx.x;
    const int count = t - 1;
    if (fault[q] != 0 || count <= 0) return;  // uniform over the block
    __shared__ int best;
    __shared__ int found_n;
    __shared__ int table_len;
    const int* s = hist + (u64)q * (u64)hist_cap;
    int len = state[(u64)q * CHAIN_WORDS + 7];
    len = len < 0 ? 0 : (len > hist_cap ? hist_cap : len);
    if (threadIdx.x == 0) {
        best = -1;
        found_n = 0;
        table_len = 0;
    }
    __syncthreads();
    const int* src;  // the proposal's first token
    int proposed;
    if (mode == 0) {
        const int top = max_n < len - 1 ? max_n : len - 1;
        const int lo = min_n > 1 ? min_n : 1;
        for (int n = top; n >= lo; --n) {
            const int* tail = s + (len - n);
            bool done = false;
            for (int base = len - n - 1; base >= 0; base -= blockDim.x) {
                const int start = base - (int)threadIdx.x;
                bool hit = start >= 0;
                for (int j = 0; j < n && hit; ++j) hit = s[start + j] == tail[j];
                if (__syncthreads_or(hit)) {
                    if (hit) atomicMax(&best, start);
                    if (threadIdx.x == 0) found_n = n;
                    done = true;
                    break;
                }
            }
            if (done) break;
        }
        __syncthreads();
        const int from = best < 0 ? len : best + found_n;
        src = s + from;
        proposed = best < 0 ? 0 : (len - from < count ? len - from : count);
    } else {
        const int* row = table + (u64)q * (u64)table_cap + len;
        if (threadIdx.x == 0) {
            int i = 0;
            while (i < count && (long long)len + i < table_cap && row[i] >= 0) ++i;
            table_len = i;
        }
        __syncthreads();
        src = row;
        proposed = table_len;
    }
    const int pad = proposed > 0 ? src[proposed - 1] : (len > 0 ? s[len - 1] : 0);
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        const int v = i < proposed ? src[i] : pad;
        drafts[(u64)q * count + i] = v;
        tokens[(u64)q * t + 1 + i] = v;
    }
}

// The one-pass requests of the next step of a chain whose sequences sample (the twin's `spec_requests`), one thread
// per row (grid-stride over seqs · t): sample [seqs, 6] = [sampled, bits of 1 / temperature, seed lo, seed hi,
// offset lo, offset hi]; state [seqs, 8] (word 1: the step's position, as chain_advance left it); tokens [seqs · t]
// (as chain_draft left them). Writes spec [seqs · t, 6] (the head's words: draft, 1 / temperature, seed, output
// index offset + position + row; the last row has no draft) and judge [seqs, 5] (spec_accept's: sampled, seed, row
// 0's index). A greedy sequence gets plain rows (draft −2) and greedy judging (zeros). A faulted sequence is skipped.
#define CHAIN_SAMPLE_WORDS 6
#define CHAIN_SPEC_WORDS 6
#define CHAIN_JUDGE_WORDS 5
extern "C" __global__ void chain_spec(const int* __restrict__ state, const int* __restrict__ fault,
                                      const u32* __restrict__ sample, const int* __restrict__ tokens, int seqs, int t,
                                      u32* __restrict__ spec, u32* __restrict__ judge) {
    const long long rows = (long long)seqs * t;
    for (long long r = blockIdx.x * (long long)blockDim.x + threadIdx.x; r < rows;
         r += (long long)gridDim.x * blockDim.x) {
        const int q = (int)(r / t), i = (int)(r % t);
        if (fault[q] != 0) continue;
        const u32* sp = sample + (u64)q * CHAIN_SAMPLE_WORDS;
        u32* o = spec + (u64)r * CHAIN_SPEC_WORDS;
        u32* jd = judge + (u64)q * CHAIN_JUDGE_WORDS;
        if (sp[0] == 0) {
            o[0] = (u32)-2;
            for (int w = 1; w < CHAIN_SPEC_WORDS; ++w) o[w] = 0;
            if (i == 0) {
                for (int w = 0; w < CHAIN_JUDGE_WORDS; ++w) jd[w] = 0;
            }
            continue;
        }
        const u64 first = ((u64)sp[4] | ((u64)sp[5] << 32)) + (u64)(u32)state[(u64)q * CHAIN_WORDS + 1];
        const u64 index = first + (u64)i;
        const int d = i + 1 < t ? tokens[(u64)r + 1] : -1;
        o[0] = (u32)(d >= 0 ? d : -1);
        o[1] = sp[1];
        o[2] = sp[2];
        o[3] = sp[3];
        o[4] = (u32)index;
        o[5] = (u32)(index >> 32);
        if (i == 0) {
            jd[0] = 1;
            jd[1] = sp[2];
            jd[2] = sp[3];
            jd[3] = (u32)first;
            jd[4] = (u32)(first >> 32);
        }
    }
}
