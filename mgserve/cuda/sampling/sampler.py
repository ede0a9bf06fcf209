"""``DeviceSampler``: logits [B, V] and a ``SamplingBatch`` -> one token per row, on the device."""

from __future__ import annotations

import torch

from mgserve.cuda.sampling.chain import draw, filter_candidates_batch, modified_logits
from mgserve.cuda.sampling.inputs import SamplingBatch
from mgserve.cuda.sampling.output import SampleOutput
from mgserve.cuda.sampling.plan import SamplingPlan


class DeviceSampler:
    """logits [B, V] + SamplingBatch -> SampleOutput, on the logits' device, without a host sync.

    Stateless: every per-session state (seed, counter, penalty window) comes in the batch."""

    def sample(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        plan: SamplingPlan | None = None,
    ) -> SampleOutput:
        """Sample one token per row of ``logits`` (float32 [B, V], not modified) with the rows
        of ``batch`` (B between its live rows and its size); ``plan`` overrides batch.plan (a
        CUDA graph captured with a broad plan serves narrower batches)."""
        if logits.dim() != 2 or logits.dtype != torch.float32:
            raise ValueError(f"logits must be float32 [B, V], got {logits.dtype} {logits.shape}")
        if logits.shape[1] != batch.n_vocab:
            raise ValueError(f"logits have V={logits.shape[1]}, the batch n_vocab={batch.n_vocab}")
        if logits.device != batch.device:
            raise ValueError(f"logits on {logits.device}, the batch on {batch.device}")
        batch = batch.rows(logits.shape[0])
        plan = batch.plan if plan is None else plan

        x = modified_logits(logits, batch, plan)  # [B, V]
        greedy = x.argmax(dim=1)  # [B] int64, the first maximum
        if plan.candidates == 0:
            tokens = greedy
        else:
            ids, vals, keep = filter_candidates_batch(x, batch, plan)
            tokens = torch.where(batch.greedy, greedy, draw(ids, vals, keep, batch))

        logprob = top_ids = top_lp = None
        if plan.logprob or plan.n_top > 0:
            lp = torch.log_softmax(logits, dim=1)  # [B, V] of the raw logits
            if plan.logprob:
                logprob = lp.gather(1, tokens[:, None])[:, 0]
            if plan.n_top > 0:
                top_lp, top = torch.topk(lp, min(plan.n_top, lp.shape[1]), dim=1)
                top_ids = top.int()
        return SampleOutput(tokens.int(), logprob, top_ids, top_lp)
