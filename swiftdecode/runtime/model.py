"""A Hugging Face causal LM driven token by token on one SwiftCache: full or layer-skipped forwards under
explicit (tree) attention masks, and a full or vocabulary-subset output head."""

from __future__ import annotations

from collections.abc import Callable

import torch

from swiftdecode.kernels.modules import QuantLinear
from swiftdecode.kernels.qweight import QuantWeight
from swiftdecode.runtime import fastpath, lean
from swiftdecode.runtime.cache import KVLayout, SwiftCache
from swiftdecode.runtime.skip import LayerSkipper, SkipSet
from swiftdecode.runtime.tree import attention_mask

Observer = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, hidden in, hidden out)

# Tokens of the forward `warm_up` runs: two rows take every kernel path a prompt's prefill takes (several-row
# products, causal attention); both loops' forwards together took 14-22 ms on SmolLM2-135M, 31-33 ms on
# Qwen2.5-0.5B (Intel Xeon, 2 threads).
WARM_UP_TOKENS = 2


Part = tuple[list[int], torch.Tensor, torch.Tensor, SwiftCache]  # one sequence's rows of a forward_batch


class SwiftModel:
    """Holds the model and its sublayer skipper; every forward runs on the caches it is given."""

    def __init__(self, model: torch.nn.Module):
        self.model = model.eval()
        self.config = model.config.get_text_config()
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.skipper = LayerSkipper.of(model)
        self.n_layers = len(self.skipper.layers)
        self.quantized = isinstance(self.lm_head, QuantLinear)
        self.vocab_size = self.lm_head.out_features
        self.dtype = torch.float32 if self.quantized else self.lm_head.weight.dtype
        self.device = torch.device("cpu") if self.quantized else self.lm_head.weight.device
        types = set(getattr(self.config, "layer_types", None) or [])
        self.window = getattr(self.config, "sliding_window", None) if "sliding_attention" in types else None
        self.layer_types = types if self.window else None
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        self.max_length = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        self.draft_ids: torch.Tensor | None = None
        self.draft_weight: torch.Tensor | QuantWeight | None = None
        self.lean = lean.LeanDecoder(model) if lean.why_not(model) is None else None

    def kv_layout(self) -> KVLayout:
        """This model's caches: each layer's sliding window where our kernels run the layers (their masks hide the
        keys beyond it, so its cache drops them; elsewhere None: transformers' masks index every entry), and a
        token's keys and values in one layer (fp16 on the lean forward's quantized weights, else the model's)."""
        c, lean_ = self.config, self._lean_kernel() is not None
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        dtype = (self.lean.kv_dtype if lean_ else None) or self.dtype
        windows = (
            [self.lean.window if s.sliding else None for s in self.lean.specs] if lean_ else [None] * self.n_layers
        )
        return KVLayout(tuple(windows), 2 * kv_heads * head_dim * torch.finfo(dtype).bits // 8)

    @torch.inference_mode()
    def forward(
        self,
        ids: list[int],
        positions: torch.Tensor,
        new_allowed: torch.Tensor,
        cache: SwiftCache,
        visible: torch.Tensor | int | None = None,
        skip: SkipSet | None = None,
        observe: Observer | None = None,
    ) -> torch.Tensor:
        """Run q new tokens (positions [q], mutual visibility [q, q]) on top of `cache`; append their KV.

        Cached entries below `visible` (default: all) are visible to each query; `observe(layer, hidden in,
        hidden out)` sees each layer of the lean forward (the transformers path: hook the modules). Returns hidden
        states [q, H].
        """
        prefix = cache.length
        vis = prefix if visible is None else visible
        mask = attention_mask(positions, prefix, vis, new_allowed, self.dtype)
        kernel, sparsity = self._lean_kernel(), fastpath.info_of(self.model).sparsity
        if kernel is not None:  # its sliding layers' masks built there (lean.windowed)
            ids_t = torch.tensor(ids, device=self.device)
            with sparsity.draft(skip.sparsity if skip else 0):
                return self.lean.forward(ids_t, positions, [mask[0, 0]], [cache], skip or SkipSet(), kernel, observe)
        if any(cache.windows):
            raise RuntimeError("this cache drops keys beyond the sliding window, which transformers' layers index")
        if self.layer_types:
            sliding = attention_mask(positions, prefix, vis, new_allowed, self.dtype, self.window)
            mask = {t: sliding if t == "sliding_attention" else mask for t in self.layer_types}
        with self.skipper.use(skip), sparsity.draft(skip.sparsity if skip else 0):
            out = self.decoder(
                input_ids=torch.tensor([ids], device=self.device),
                position_ids=positions[None].to(self.device),
                attention_mask=mask,
                cache=cache,
                use_cache=True,
            )
        return out.last_hidden_state[0]

    def _lean_kernel(self):
        """The fp32 kernel library when this model runs the lean forward (lean.why_not: None; fast path on), else
        None."""
        kernel = fastpath.info_of(self.model).kernel
        return kernel if self.lean is not None else None

    def layer_loop(self) -> str:
        """What runs the decoder's layers: "native" (one C call), "python" (the lean loop) or "transformers". The
        first two run our batch-invariant kernels: a token's cache entries are the same bits from any forward."""
        kernel = self._lean_kernel()
        return "transformers" if kernel is None else "native" if self.lean._native(kernel) else "python"

    def calibrating(self):
        """Context: the forward inside sets the MLPs' activation-sparsity thresholds from its inputs."""
        return fastpath.info_of(self.model).sparsity.calibrate()

    @torch.inference_mode()
    def forward_batch(self, parts: list[Part]) -> list[torch.Tensor]:
        """Full-model forwards of several sequences, part j = (ids, positions [q_j], new_allowed [q_j, q_j], cache)
        appended after its own cache (all of it visible). On the lean kernel path one pass over the weights serves
        all rows; elsewhere the parts run one after another. Either way part j's hidden states [q_j, H] are
        bit-identical to its own `forward`."""
        kernel = self._lean_kernel()
        if kernel is None or len(parts) == 1:
            return [self.forward(*part) for part in parts]
        masks = [attention_mask(p, c.length, c.length, a, self.dtype)[0, 0] for _, p, a, c in parts]
        ids = torch.tensor([t for part in parts for t in part[0]], device=self.device)
        positions = torch.cat([part[1] for part in parts])
        hidden = self.lean.forward(ids, positions, masks, [part[3] for part in parts], SkipSet(), kernel)
        return list(hidden.split([len(part[0]) for part in parts]))

    def prefill(self, ids: list[int], cache: SwiftCache, observe: Observer | None = None) -> torch.Tensor:
        """Causal forward of `ids` after `cache`; returns hidden states [len(ids), H]."""
        start = cache.length
        causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril_()
        return self.forward(ids, torch.arange(start, start + len(ids)), causal, cache, observe=observe)

    def _cap(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [q, V] in float32."""
        return self._cap(self.lm_head(hidden)).float()

    @torch.inference_mode()
    def draft_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft logits [q, V'] over the draft vocabulary and the ids of its columns (None = full vocabulary)."""
        if self.draft_weight is None:
            return self.logits(hidden), None
        if self.quantized:
            return self._cap(self.lm_head.kernel.linear(hidden, self.draft_weight)).float(), self.draft_ids
        kernel = fastpath.info_of(self.model).kernel
        fast = kernel is not None and isinstance(self.lm_head, fastpath.FastLinear) and hidden.dtype == torch.float32
        logits = kernel.linear(hidden, self.draft_weight, None) if fast else hidden @ self.draft_weight.T
        return self._cap(logits).float(), self.draft_ids

    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Score drafts over these token ids only (verification always uses the full vocabulary). A set of the
        same size as the current one is updated in place: only the rows of the tokens that change are copied."""
        if ids is None:
            self.draft_ids = self.draft_weight = None
            return
        ids = ids.to(self.device)
        if self.draft_ids is None or len(ids) != len(self.draft_ids):
            self.draft_ids, self.draft_weight = ids.clone(), _rows(self.lm_head, ids)
            return
        slots, new = _changed(self.draft_ids, ids, self.vocab_size)
        self.draft_ids[slots] = new
        if self.quantized:
            self.draft_weight.put_rows(slots, self.lm_head.qweight, new)
        else:
            self.draft_weight[slots] = _rows(self.lm_head, new)


def _rows(head: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor | QuantWeight:
    """Rows `ids` of an output head's weight, quantized (a QuantWeight) or float."""
    return head.qweight.select_rows(ids) if isinstance(head, QuantLinear) else head.weight.index_select(0, ids)


def _changed(old: torch.Tensor, new: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For two id sets of one size (ids < size): the slots of `old` whose id is not in `new`, and the ids of
    `new` not in `old`. Membership by masks over the ids: 7x torch.isin's speed on 16k-id sets of 152k."""
    in_new = torch.zeros(size, dtype=torch.bool, device=old.device)
    in_new[new] = True
    in_old = torch.zeros(size, dtype=torch.bool, device=old.device)
    in_old[old] = True
    return torch.nonzero(~in_new[old]).flatten(), new[~in_old[new]]


def warm_up(sm: SwiftModel) -> SwiftModel:
    """Run a short forward on each layer loop `sm` has (the Python loop, with an observer, and the native one), on
    scratch caches, results discarded; returns sm. Why: in a fresh process under CPU contention torch's float32
    cos sometimes returned a reduced-accuracy table on its first call (README, "A process's first forward"). The
    lean forward no longer uses it (`lean.rotary`); the transformers layer loop still runs torch's
    transcendental functions, so their first calls happen here, not in a request. Call it from the thread that
    will decode."""
    observers = [lambda i, h_in, h_out: None, None] if sm.lean is not None else [None]
    for observe in observers:
        sm.prefill(list(range(WARM_UP_TOKENS)), SwiftCache(sm.kv_layout().windows), observe)
    return sm
