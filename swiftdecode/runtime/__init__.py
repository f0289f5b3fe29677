"""Layer 3: the model as the engine drives it: the KV cache, draft trees and their masks, the layer-skip switch,
full and skipped forwards (`model.SwiftModel`, `lean`), the fast path's kernels wired into the HF model
(`fastpath`), the GGUF-backed model (`quantized`) and the prefix store."""
