"""What each layer of a model costs a step, from its GGUF tensor table: the bytes it reads and
the FLOPs it does, the figures a stage plan balances (stages.py) and a GPU model turns into
times (gpumodel.py). Sizes in memory are the memory plan's (``ModelSizes``); these are traffic.

- weights: a layer's dense part (every tensor but the routed experts) is read once per step
  whatever its batch; of the routed experts (3-D ``*_exps`` tensors of n experts, top-k per token)
  a step of t tokens reads the share its tokens hit, ``1 - (1 - k/n)^t`` under uniform routing;
- FLOPs per token: 2 per weight of a matrix, an expert matrix's k/n share of it;
- per session and token at depth p: a full attention layer reads p cells of K and V (a sliding
  one at most its window; a QSA one about ``idx_budget + ratio - 1`` selected cells and scans
  p/ratio block keys); a DeltaNet layer reads and writes its state (conv and recurrent), about
  6 d^2 FLOPs per value head (read for the output, the delta, the update);
- the ends: the output head (and the norms after the last layer) is read by every decode step
  and multiplies 2 V d FLOPs per token that is sampled (a prompt samples only its last token);
- the hand-off: what crosses a link per token between stages (the residual, float32: hc streams
  of n_embd for qwen4exp, n_embd otherwise; plus a position and a sequence id), and what the host
  sends the first stage per token (the token, its position, the PLE rows it gathered).
"""

from __future__ import annotations

from dataclasses import dataclass

from mgserve.core.gguf.reader import GGUFFile
from mgserve.cuda.plan_sizes import PLE_TABLE, ModelSizes, kv_bytes, layer_of

STATE_FLOPS_PER_D2 = 6  # DeltaNet FLOPs per value head per token, in units of head_dim^2
HANDOFF_EXTRA = 8  # bytes per token beside the residual: position and sequence id (int32)
HOST_EXTRA = 8  # bytes per token the host sends the first stage: token id and position


@dataclass(frozen=True)
class LayerCost:
    kind: str  # "recurrent", "attention", "swa" (sliding window) or "qsa"
    dense_bytes: int  # read once per step
    expert_bytes: int  # all routed experts' bytes; a step reads its share
    dense_flops: int  # per token
    expert_flops: int  # per token, the routed k/n share


@dataclass(frozen=True)
class ModelCosts:
    """Per-layer costs of a model with given cache types."""

    sizes: ModelSizes
    layers: tuple[LayerCost, ...]
    expert_share: float  # k/n: the routed experts a token uses (0: no experts)
    head_bytes: int  # the output head and the tail (norms, HC head mix), read per decode step
    head_flops: int  # per sampled token
    kv_cell: int  # bytes of one token's K and V in one layer, in the cache types
    handoff_bytes: int  # per token, over each link between stages
    host_bytes: int  # per token, from the host to the first stage

    @classmethod
    def of(cls, g: GGUFFile, type_k: str = "f16", type_v: str = "f16") -> ModelCosts:
        sizes = ModelSizes.of(g)
        spec, hp, qp = sizes.spec, sizes.hp, sizes.qp
        n = spec.n_layer
        experts, dense_flops, expert_flops = [0] * n, [0] * n, [0] * n
        n_exp = hp.n_expert if hp else spec.n_expert
        share = (hp.n_expert_used if hp else spec.n_expert_used) / n_exp if n_exp else 0.0
        ple_rows = 0
        for t in g:
            il = layer_of(t)
            if t.name == PLE_TABLE:
                ple_rows = t.shape[-1]
            if il is None or il >= n or len([d for d in t.shape if d > 1]) < 2:
                continue
            if len(t.shape) == 3 and "_exps" in t.name:
                experts[il] += t.n_bytes
                expert_flops[il] += round(2 * t.n_elements * share)
            elif "norm" not in t.name and not t.name.endswith("conv1d.weight"):
                dense_flops[il] += 2 * t.n_elements
        layers = tuple(
            LayerCost(
                _kind(sizes, il),
                sizes.layer_weights[il] - experts[il],
                experts[il],
                dense_flops[il],
                expert_flops[il],
            )
            for il in range(n)
        )
        kv_cell = kv_bytes(type_k, spec.kv_dim) + kv_bytes(type_v, spec.kv_dim)
        hc = qp.hc if qp else 1
        host = HOST_EXTRA
        if qp is not None and qp.ple is not None and ple_rows:
            host += len(qp.ple.offsets) * (sizes.ple_table // ple_rows)
        return cls(
            sizes,
            layers,
            share,
            sizes.head + sizes.tail,
            2 * spec.n_vocab * spec.n_embd,
            kv_cell,
            4 * hc * spec.n_embd + HANDOFF_EXTRA,
            host,
        )

    def weight_read(self, il: int, tokens: int) -> float:
        """Bytes of layer ``il``'s weights a step of ``tokens`` tokens reads."""
        lc = self.layers[il]
        hit = 1.0 - (1.0 - self.expert_share) ** tokens if self.expert_share else 0.0
        return lc.dense_bytes + lc.expert_bytes * hit

    def token_flops(self, il: int) -> int:
        """FLOPs of layer ``il``'s matrices per token."""
        return self.layers[il].dense_flops + self.layers[il].expert_flops

    def _cells(self, il: int, depth: int) -> int:
        s, qp, kind = self.sizes.spec, self.sizes.qp, self.layers[il].kind
        if kind == "qsa" and qp is not None:
            return min(depth, qp.idx_budget + qp.ratio - 1)
        if kind == "swa":
            return min(depth, s.sliding_window)
        return depth

    def session_bytes(self, il: int, depth: int) -> int:
        """Bytes layer ``il`` reads (and writes) for one session's token at ``depth``: K/V cells
        and QSA block keys, or the DeltaNet state read and written."""
        kind, qp = self.layers[il].kind, self.sizes.qp
        if kind == "recurrent":
            return 2 * self.state_bytes
        out = self._cells(il, depth) * self.kv_cell
        if kind == "qsa" and qp is not None:
            out += (depth // qp.ratio) * qp.idx_dim * 4
        return out

    def session_flops(self, il: int, depth: int) -> int:
        """FLOPs of layer ``il``'s attention (or recurrence) for one token at ``depth``."""
        s, hp, qp, kind = self.sizes.spec, self.sizes.hp, self.sizes.qp, self.layers[il].kind
        if kind == "recurrent" and hp is not None:
            return STATE_FLOPS_PER_D2 * hp.ssm_v_heads * hp.ssm_head_dim**2
        out = 4 * s.n_head * s.head_dim * self._cells(il, depth)
        if kind == "qsa" and qp is not None:
            out += 2 * qp.idx_heads * qp.idx_dim * (depth // qp.ratio)
        return out

    @property
    def state_bytes(self) -> int:
        """One DeltaNet layer's state of one session (conv and recurrent, float32)."""
        hp = self.sizes.hp
        if hp is None:
            return 0
        return 4 * (max(hp.ssm_conv - 1, 0) * hp.conv_dim + hp.ssm_v_heads * hp.ssm_head_dim**2)

    def decode_weights(self) -> list[float]:
        """Per layer, the weight bytes one decode token reads: the default balance of a stage
        plan (the head's are ``head_bytes``)."""
        return [self.weight_read(il, 1) for il in range(len(self.layers))]


def _kind(sizes: ModelSizes, il: int) -> str:
    if sizes.hp is not None and sizes.hp.recurrent[il]:
        return "recurrent"
    if sizes.qp is not None and il in sizes.qp.qsa_layers:
        return "qsa"
    return "swa" if sizes.spec.swa_layers[il] else "attention"
