/* Grammar masks applied to logits, for the sampler (engine/sampler.py): token t of row r keeps its
 * logit when bit t % 32 of word t / 32 of the row's mask is set, and becomes -inf otherwise. A word
 * of all ones leaves its 32 logits alone and a word of zeros fills them, so a mask that allows few
 * tokens (a JSON grammar's usual state) costs a fill of the row. Rows are independent. */
#include <math.h>
#include <stdint.h>

int kv_mask_logits(int rows, int vocab, float *x, int64_t ldx, const int32_t *mask, int64_t ldm) {
    if (rows < 0 || vocab < 0 || ldx < vocab || ldm * 32 < vocab) return -1;
    for (int r = 0; r < rows; r++) {
        float *xr = x + (int64_t)r * ldx;
        const uint32_t *m = (const uint32_t *)(mask + (int64_t)r * ldm);
        for (int base = 0; base < vocab; base += 32) {
            const uint32_t bits = m[base / 32];
            const int n = vocab - base < 32 ? vocab - base : 32;
            if (bits == 0xffffffffu) continue;
            for (int i = 0; i < n; i++)
                if (!((bits >> i) & 1u)) xr[base + i] = -INFINITY;
        }
    }
    return 0;
}
